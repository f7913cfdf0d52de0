"""The attention function transformers calls per layer, over transformers' own dense cache
(one block per row, a strided view) or handed to a :class:`KVArenaCache`; 4-D masks and
what the hook could not read under ``torch.compile`` go to :mod:`.masked`."""

from __future__ import annotations

import functools

import torch

from kvarena.attention.ops import paged_attention
from kvarena.integrations.hf._common import _HANDOFF, _sink_logits, _unsupported, version_key
from kvarena.integrations.hf.mask import _Unpad
from kvarena.integrations.hf.masked import attend_4d, masked_attention, rule_mask

__all__ = ["kvarena_attention"]


def _check_packed(position_ids: torch.Tensor | None, kv_start: torch.Tensor | None, b: int, s: int, n: int,
                  forward: torch.Tensor | None = None) -> None:
    """Prefill rows whose positions restart inside (packed sequences) would be attended as
    one sequence: refuse them. One check per forward: ``forward`` is the mask hook's output
    (made anew per forward and mask kind), which records the ``position_ids`` it was checked
    with (the positions the model's rotary embedding read before its first layer). Without
    it, one check per ``position_ids`` tensor and version; an inference tensor (no version
    counter) is then checked at every layer."""
    if position_ids is None or s < 2:
        return
    if forward is not None and getattr(forward, "_kvarena_positions", None) is position_ids:
        return
    version = version_key(position_ids)
    key = None if version is None else (*version, id(kv_start))
    if forward is None and key is not None and _checked_positions.get(key) == (position_ids, kv_start):
        return
    pos = position_ids.expand(b, s) if position_ids.dim() == 2 else position_ids
    real = torch.ones(b, s, dtype=torch.bool, device=pos.device)
    pack = getattr(kv_start, "_kvarena_pack", None)
    if pack is not None:  # any padding: the hook's real queries
        real = pack.q_real.to(pos.device)
    elif kv_start is not None:
        real = (n - s + torch.arange(s, device=pos.device))[None, :] >= kv_start.to(pos.device)[:, None]
    step_ok = (pos[:, 1:] - pos[:, :-1] == 1) | ~real[:, :-1] | ~real[:, 1:]
    if not bool(step_ok.all()):
        raise _unsupported("packed sequences (position_ids that restart inside a row)")
    if forward is not None:
        forward._kvarena_positions = position_ids
    elif key is not None:
        _checked_positions.clear()
        _checked_positions[key] = (position_ids, kv_start)


_checked_positions: dict = {}


def kvarena_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                      softcap: float | None = None, s_aux: torch.Tensor | None = None, *, backend: str = "auto",
                      **kwargs):
    """The attention function ``transformers`` calls per layer.

    Parameters
    ----------
    query : Tensor ``[B, H_q, S, D]``
    key, value : Tensor ``[B, H_kv, L, D]``
        The layer's whole K/V (past and new), as transformers' cache returns it.
    attention_mask : None, int32 ``[B]`` or a 4-D mask
        What :func:`kvarena_mask` returned (left padding per row, carrying its reading of
        the mask), or a user's 4-D mask, which transformers passes on as is (boolean, True
        = attend, or additive; see :mod:`.masked`).

    Returns
    -------
    ``(out [B, S, H_q, D], None)``.
    """
    handoff = _HANDOFF.get(id(key))
    cache = handoff[1]() if handoff is not None and handoff[0]() is key else None
    if cache is None:
        return _attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                          s_aux, backend, kwargs, None)
    try:
        return _attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                          s_aux, backend, kwargs, (cache, handoff[2]))
    except BaseException:  # a refused step leaves a KVArenaCache as it was before the step
        cache._abort_step()
        raise


def _refuse(module, dropout, kwargs) -> None:
    weights = kwargs.get("output_attentions")
    if weights is None:  # not passed to the forward: the config's, as transformers' output capture reads it
        weights = getattr(getattr(module, "config", None), "output_attentions", False)
    if weights:
        raise _unsupported("output_attentions=True (kvarena never forms the attention weights; use "
                           "attn_implementation='eager' for them)")
    if dropout and module.training:
        raise _unsupported("attention dropout while training")


def _not_from_the_hook(query, key, value, attention_mask, scaling, softcap, s_aux, backend, handoff):
    """A mask the hook did not make: a 4-D mask (see :mod:`.masked`), else a refusal."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(
            attention_mask).__name__
        raise _unsupported(f"an attention mask that did not come from its mask hook (got {shape})")
    if handoff is not None:
        raise _unsupported("a 4-D attention mask with KVArenaCache (the arena attends each row's stored tokens "
                           "by its own plan; use transformers' cache, e.g. DynamicCache, for 4-D masks)")
    kernel = functools.partial(paged_attention, scale=scaling, softcap=softcap,
                               sink_logits=_sink_logits(s_aux, query.dtype), backend=backend)
    return attend_4d(query, key, value, attention_mask, scaling, softcap, s_aux, kernel), None


def _attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, s_aux,
               backend, kwargs, handoff):
    _refuse(module, dropout, kwargs)
    if attention_mask is not None and not hasattr(attention_mask, "_kvarena"):
        return _not_from_the_hook(query, key, value, attention_mask, scaling, softcap, s_aux, backend, handoff)
    dense = getattr(attention_mask, "_kvarena_dense", None)
    if dense is not None:  # under torch.compile: what the hook could not read without the host
        if handoff is not None:
            raise _unsupported("KVArenaCache under torch.compile")
        return masked_attention(query, key, value, dense, scaling, softcap, s_aux), None
    mask_in = attention_mask
    segments = None
    if attention_mask is None:  # the model made no mask: its own flags
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        window = sliding_window
    else:
        padded, causal, window = attention_mask._kvarena
        if window is None:  # the mask cut no key of this call; the layer's window cuts none either
            window = sliding_window
        elif sliding_window is not None and window != sliding_window:
            raise _unsupported(f"a mask window ({window}) that differs from the layer's sliding_window "
                               f"({sliding_window})")
        segments = getattr(attention_mask, "_kvarena_segments", None)
        attention_mask = attention_mask if padded or segments is not None else None
    b, h_q, s, d = query.shape
    pack = getattr(attention_mask, "_kvarena_pack", None)
    valid = getattr(mask_in, "_kvarena_valid", None)  # a static cache: only its first `valid` slots hold tokens
    slots_keep = getattr(mask_in, "_kvarena_slots_keep", None)
    if pack is not None and slots_keep is not None and torch.compiler.is_compiling():  # no unpadding in a graph
        visible = rule_mask(slots_keep, key.shape[2] if valid is None else valid, s, causal, window)
        return masked_attention(query, key, value, visible, scaling, softcap, s_aux), None
    if valid is not None and not (torch.compiler.is_compiling() and pack is None and segments is None):
        key, value, valid = key[:, :, : int(valid)], value[:, :, : int(valid)], None  # eager: a host read
    if handoff is not None:
        cache, layer = handoff
        return cache._attend(layer, query, key, value, attention_mask, scaling, causal, window, softcap, s_aux,
                             backend, kwargs.get("position_ids"), mask_in)
    n = key.shape[2]
    opts = dict(scale=scaling, window_left=None if window is None else window - 1, softcap=softcap,
                sink_logits=_sink_logits(s_aux, query.dtype), backend=backend)
    if segments is not None:  # packed sequences: one kvarena sequence each, in its row's block
        rows, ends, starts, cu, max_q = (t.to(query.device) if isinstance(t, torch.Tensor) else t for t in segments)
        out = paged_attention(query.transpose(1, 2).reshape(b * s, h_q, d), key.transpose(1, 2),
                              value.transpose(1, 2), rows, ends, cu, causal=True, kv_start=starts,
                              max_seqlen_q=max_q, max_seqlen_k=n, **opts)
        return out.view(b, s, h_q, d), None
    _check_packed(kwargs.get("position_ids"), attention_mask, b, s, n, mask_in)
    if pack is not None:
        return _attention_unpadded(query, key, value, pack, scaling, causal, window, softcap, s_aux, backend)
    # One block per row: [B, L, H_kv, D] strided views of the dense cache, no copy; a static
    # cache under torch.compile: every slot, its rows' lengths the slots holding tokens.
    dev = query.device
    lens = torch.full((b,), n, dtype=torch.int32, device=dev)
    if valid is not None:
        lens = torch.zeros_like(lens) + valid
    out = paged_attention(
        query.transpose(1, 2).reshape(b * s, h_q, d), key.transpose(1, 2), value.transpose(1, 2),
        torch.arange(b, dtype=torch.int32, device=dev)[:, None], lens,
        torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev), causal=causal,
        kv_start=attention_mask, max_seqlen_q=s, max_seqlen_k=n, **opts)
    return out.view(b, s, h_q, d), None


def _attention_unpadded(query, key, value, pack: _Unpad, scaling, causal, window, softcap, s_aux, backend):
    """Right padding or holes with transformers' cache: each row's real keys gathered
    left-aligned (one block per row of ``max_k`` keys), the queries of ``pack.q_attend``
    packed, those of ``pack.per_query`` one sequence each (see :func:`_unpad`); a query
    that sees no key gets zeros."""
    b, h_q, s, d = query.shape
    out = query.new_zeros(b, s, h_q, d)
    if pack.max_k == 0:
        return out, None
    rows = torch.arange(b, device=query.device)[:, None]
    k_cache, v_cache = key.transpose(1, 2)[rows, pack.kidx], value.transpose(1, 2)[rows, pack.kidx]
    opts = dict(scale=scaling, causal=causal, softcap=softcap, sink_logits=_sink_logits(s_aux, query.dtype),
                backend=backend, max_seqlen_k=pack.max_k)
    if pack.per_query is not None:  # one sequence per query, its window as kv_start
        q_rows, q_lens, q_start, which = pack.per_query
        q = query.transpose(1, 2)[which]
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=query.device)
        out[which] = paged_attention(q, k_cache, v_cache, q_rows, q_lens, cu, kv_start=q_start, max_seqlen_q=1,
                                     **opts)
    if pack.max_q == 0:
        return out, None
    table = torch.arange(b, dtype=torch.int32, device=query.device)[:, None]
    got = paged_attention(query.transpose(1, 2)[pack.q_attend], k_cache, v_cache, table, pack.lens, pack.cu_q,
                          window_left=None if window is None else window - 1, max_seqlen_q=pack.max_q, **opts)
    out[pack.q_attend] = got
    return out, None
