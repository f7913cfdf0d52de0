"""Hugging Face ``transformers`` (>= 5) on kvarena's attention.

:func:`register` adds the attention implementation ``"kvarena"`` and its mask hook, so any
decoder whose attention goes through ``transformers.AttentionInterface`` runs kvarena's
block-table attention (Triton on CUDA, the PyTorch path on CPU)::

    from kvarena.integrations import hf
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvarena")
    # or: model.set_attn_implementation("kvarena")
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

With transformers' own cache, the dense K/V ``[B, H_kv, L, D]`` a layer hands over is
attended in place as a paged cache with one block per row (a strided view: nothing is
copied); left padding becomes ``kv_start``. Any other 2-D padding mask (right padding,
holes) is unpadded as flash_attention_2 does: each row's real keys gathered, its real
queries packed, or, where that reading would differ from eager (a hole inside a sliding
window, padding queries that eager attends too), one sequence per query (see
:func:`_unpad`). Options map one to one: ``scaling`` -> ``scale``, ``sliding_window=W`` ->
``window_left=W - 1`` (HF's window sees ``kv > q - W``), ``softcap`` -> ``softcap``,
gpt-oss's ``s_aux`` -> ``sink_logits``.

Packed sequences (``position_ids`` restarting inside a row, no padding mask and no cache:
transformers folds them into the mask) are one kvarena sequence each (``kv_start`` its
first token, see :func:`_segments_of`).

What it cannot serve is an error whose message starts with ``kvarena:`` and names it,
never a silent fallback to another implementation: 4-D custom masks, mask functions that
need vmap (``or_mask_function`` / ``and_mask_function``), packed sequences transformers
did not fold into the mask (a cache, a padding mask, or a model such as gpt-oss that does
not pass ``position_ids`` to its mask), ``output_attentions=True``, dropout while
training. A static cache (``StaticCache``) is attended over its slots that hold tokens.
"""

from __future__ import annotations

import numbers
import weakref
from typing import NamedTuple

import torch

from kvarena.attention.dtypes import accumulator_dtype
from kvarena.attention.ops import paged_attention
from kvarena.attention.spec import check_backend

__all__ = ["KVArenaCache", "register", "kvarena_attention", "kvarena_mask"]

NAME = "kvarena"


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"kvarena: {what} is not supported by the kvarena attention implementation")


def _rule_of(mask_function, batch_size: int, q_offset: int, q_length: int, kv_offset: int, kv_length: int,
             device) -> tuple[bool, int | None]:
    """``(causal, window)`` that reproduces a transformers mask function on this call.

    kvarena expresses ``kv <= q`` (causal), optionally ``kv > q - W`` (a sliding window), or
    everything (bidirectional). The function is evaluated (index-based, as transformers'
    non-vmap path does) on up to 64 evenly spaced query rows, the last one included, of the
    first and last batch rows, over the call's keys; the rule is read off those rows and
    must reproduce each of them exactly, else ``kvarena:`` NotImplementedError (chunked
    attention, prefix / block masks, packed sequences). ``window`` None: no key of this
    call is cut by a window.
    """
    n = min(q_length, 64)
    rows_q = torch.unique(torch.linspace(q_offset, q_offset + q_length - 1, n).round().long())
    rows_b = torch.tensor(sorted({0, batch_size - 1}))
    kv = torch.arange(kv_offset, kv_offset + kv_length)
    got = mask_function(rows_b[:, None, None, None], torch.zeros(1, 1, 1, 1, dtype=torch.long),
                        rows_q[None, None, :, None], kv[None, None, None, :])
    got = torch.as_tensor(got).to("cpu").expand(len(rows_b), 1, len(rows_q), len(kv))[:, 0]  # [b, q, kv]
    future = kv[None, None, :] > rows_q[None, :, None]
    causal = not bool((got & future).any())
    want = ~future if causal else torch.ones_like(got)
    window = None
    last = got[:, -1]  # the last query row of each batch row: the one a window cuts most
    if causal and bool(last.any()):
        lo = int(kv[last.any(0).nonzero().min()])
        if lo > kv_offset:
            window = int(rows_q[-1]) - lo + 1
            want = want & (kv[None, None, :] > rows_q[None, :, None] - window)
    if not torch.equal(got, want.expand_as(got)):
        raise _unsupported("a mask other than causal, a causal sliding window or bidirectional (chunked "
                           "attention, a prefix or block mask, packed sequences)")
    return causal, window


def kvarena_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask hook: what the attention function needs, read from transformers' mask inputs.

    Returns int32 ``[B]``: the left padding per row among the layer's keys (the attention
    function's ``kv_start``; zeros for other padding), carrying the mask's pattern as
    ``(causal, window)`` (taken from ``mask_function``, checked to be one kvarena expresses
    exactly), and as attributes the reading of any other padding (:func:`_unpad`), packed
    sequences (:func:`_segments_of`), a static cache's slots holding tokens, and the call's
    sizes (a mask fed back for the same sizes is returned as is). Runs once per forward and
    mask kind (not per layer); reading the mask is its host sync.
    """
    sizes = (batch_size, q_length, kv_length, q_offset, kv_offset)
    if attention_mask is not None and hasattr(attention_mask, "_kvarena"):
        # This hook's own output, fed back: generate builds the masks ahead of the forward
        # for a compileable cache (StaticCache), and the model hands them to the hook again.
        if getattr(attention_mask, "_kvarena_sizes", None) == sizes and (mask_function is None or _rule_of(
                mask_function, batch_size, q_offset, q_length, kv_offset, min(kv_length, q_offset + q_length - kv_offset),
                kwargs.get("device")) == attention_mask._kvarena[1:]):
            return attention_mask
        raise _unsupported(f"a mask built for other sizes ({getattr(attention_mask, '_kvarena_sizes', None)}, "
                           f"this call: {sizes} as (batch, q_length, kv_length, q_offset, kv_offset))")
    if kwargs.get("use_vmap"):
        raise _unsupported("a custom mask function (or_mask_function / and_mask_function, which need vmap)")
    # A static cache (StaticCache) hands over all its slots: the keys that hold tokens are the
    # first `valid`, the rest are empty (in every query's future). The attention function
    # attends the first `valid` only.
    valid = q_offset + q_length - kv_offset
    static = kv_length > valid
    if valid < q_length or (static and kv_offset < 0):
        raise _unsupported(f"a cache of {kv_length} slots from {kv_offset} for {q_offset + q_length} tokens")
    if static:
        kv_length = valid
    segments = None
    try:
        rule = (True, None) if mask_function is None else _rule_of(
            mask_function, batch_size, q_offset, q_length, kv_offset, kv_length, kwargs.get("device"))
    except NotImplementedError:
        # Packed sequences (transformers folds position_ids restarting inside a row into the
        # mask, without a padding mask or a cache): each sequence attends itself.
        found = None
        if attention_mask is None and q_offset == kv_offset == 0 and q_length == kv_length:
            found = _segments_of(mask_function, batch_size, q_length)
        if found is None:
            raise
        rule, segments = found
    padded = attention_mask is not None
    if padded:
        if attention_mask.dim() != 2:
            raise _unsupported(f"a {attention_mask.dim()}-D padding mask in the mask hook")
        if attention_mask.shape[1] < (kv_offset + kv_length if static else kv_length):
            raise _unsupported(f"a padding mask of {attention_mask.shape[1]} columns for {kv_length} keys")
        first = kv_offset if static else attention_mask.shape[1] - kv_length
        keep = attention_mask[:, first : first + kv_length].bool()  # the layer's keys, oldest first
        padded = not bool(keep.all())
    pack = None
    if padded:
        n_real = keep.sum(1)
        # Left padding: each row is zeros then ones, so its ones are exactly its last n_real keys.
        tail = torch.arange(kv_length, device=keep.device)[None, :] >= (kv_length - n_real)[:, None]
        if torch.equal(keep, tail):
            kv_start = (kv_length - n_real).to(torch.int32)
        else:  # right padding or holes: the real keys and queries unpadded, as flash_attention_2 does
            pack = _unpad(keep, q_length, rule[1])
            kv_start = torch.zeros(batch_size, dtype=torch.int32, device=keep.device)
    else:
        device = attention_mask.device if attention_mask is not None else kwargs.get("device")
        kv_start = torch.zeros(batch_size, dtype=torch.int32, device=device)
    kv_start._kvarena = (padded, *rule)
    kv_start._kvarena_keep = None if pack is None else keep
    kv_start._kvarena_pack = pack
    kv_start._kvarena_segments = segments
    kv_start._kvarena_valid = valid if static else None  # a static cache: the slots holding tokens
    kv_start._kvarena_sizes = sizes
    return kv_start


def _segments_of(mask_function, b: int, n: int):
    """``((True, window), segments)`` when ``mask_function`` is causal within sequences packed
    in each row (a query sees no key before its sequence's first token), else None.

    The sequence starts are read off every ``(q, q - 1)`` pair; the rule (causal, the
    sequence, optionally a window) must then reproduce the function on the rows
    :func:`_rule_of` samples. ``segments``: one kvarena sequence per packed sequence, row-
    major: (rows int32 ``[N, 1]``, ends ``[N]`` as ``seq_lens``, starts ``[N]`` as
    ``kv_start``, cu_seqlens_q ``[N + 1]``, the longest)."""
    if n < 2:
        return None
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.arange(1, n)
    prev = torch.as_tensor(mask_function(torch.arange(b)[:, None, None, None], zero, q[None, None, :, None],
                                         (q - 1)[None, None, :, None])).to("cpu").expand(b, 1, n - 1, 1)[:, 0, :, 0]
    new = torch.cat([torch.ones(b, 1, dtype=torch.bool), ~prev.bool()], 1)  # a sequence starts here
    idx = torch.arange(n)
    start = torch.where(new, idx, 0).cummax(1).values  # [b, n]: each token's sequence start
    rows_q = torch.unique(torch.linspace(0, n - 1, min(n, 64)).round().long())
    rows_b = torch.tensor(sorted({0, b - 1}))
    got = torch.as_tensor(mask_function(rows_b[:, None, None, None], zero, rows_q[None, None, :, None],
                                        idx[None, None, None, :])).to("cpu").expand(len(rows_b), 1, len(rows_q), n)[:, 0]
    st = start[rows_b][:, rows_q]  # [b', q']
    want = (idx[None, None, :] <= rows_q[None, :, None]) & (idx[None, None, :] >= st[..., None])
    lo = torch.where(got.any(-1), got.int().argmax(-1), -1)  # the first key each sampled query sees
    cut = (lo > st) & got.any(-1)
    window = None
    if bool(cut.any()):
        window = int((rows_q[None, :].expand_as(lo) - lo)[cut].min()) + 1
        want = want & (idx[None, None, :] > rows_q[None, :, None] - window)
    if not torch.equal(got.bool(), want):
        return None
    ends = torch.cat([new[:, 1:], torch.ones(b, 1, dtype=torch.bool)], 1)  # a sequence ends here
    seg_rows = torch.arange(b)[:, None].expand(b, n)[new]
    seg_start = idx[None, :].expand(b, n)[new]
    seg_end = idx[None, :].expand(b, n)[ends] + 1
    lens_q = seg_end - seg_start
    cu = torch.nn.functional.pad(lens_q.cumsum(0), (1, 0))
    i32 = torch.int32
    return (True, window), (seg_rows.to(i32)[:, None], seg_end.to(i32), seg_start.to(i32), cu.to(i32),
                            int(lens_q.max()))


class _Unpad(NamedTuple):
    """A padding mask other than left padding, read once per forward and mask kind."""

    kidx: torch.Tensor  # [B, max_k]: each row's real keys' indices, left-aligned (padded with 0)
    lens: torch.Tensor  # int32 [B]: real keys per row
    q_real: torch.Tensor  # bool [B, S]: the real queries
    cu_q: torch.Tensor  # int32 [B + 1]: their offsets
    max_q: int
    max_k: int
    per_query: tuple | None  # (rows int32 [N, 1], lens [N], kv_start [N], which bool [B, S]), see _unpad


def _unpad(keep: torch.Tensor, q_length: int, window: int | None) -> _Unpad:
    """Right padding or holes (``keep [B, L]``, any pattern): what the attention function
    needs to attend only the real keys, exactly as eager does.

    A real query is bottom-right aligned among its row's real keys, so causality is exact;
    a window then counts real keys, which equals eager's (which counts positions) unless a
    padding hole lies inside a real query's window. Eager also attends padding queries that
    follow a real key (its mask hides padding keys, not queries). In those two cases
    (``per_query``) each such query is its own sequence: its row, the real keys at or
    before it (``lens``) and ``kv_start`` = the real keys at or before ``p - window`` (0
    without a window). A padding query that sees no key gets zeros (eager: an average over
    a fully masked row, as with left padding)."""
    b, n = keep.shape
    s = q_length
    c = keep.cumsum(1, dtype=torch.int32)  # c[p]: real keys at or before p
    lo = torch.zeros_like(c)
    windowed = window is not None and window < n
    if windowed:
        lo = torch.nn.functional.pad(c, (window, 0))[:, :n]  # real keys at or before p - window
    cq, loq, q_real = c[:, n - s :], lo[:, n - s :], keep[:, n - s :]
    pad_q = ~q_real & (cq > loq)  # padding queries that see a key
    exact = not bool(pad_q.any())
    if exact and windowed:  # HF's window (p - window, p] holds c - lo real keys; kvarena's the last `window`
        exact = bool(((cq - loq == cq.clamp(max=window)) | ~q_real).all())
    per_query = None
    if not exact:
        which = q_real | pad_q
        rows = torch.arange(b, device=keep.device, dtype=torch.int32)[:, None].expand(b, s)[which]
        per_query = (rows[:, None], cq[which], loq[which], which)
    lens = c[:, -1]
    max_k = int(lens.max()) if b else 0
    kidx = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, : max(max_k, 1)]
    n_q = q_real.sum(1, dtype=torch.int32)
    cu_q = torch.nn.functional.pad(n_q.cumsum(0, dtype=torch.int32), (1, 0))
    max_q = int(n_q.max()) if b else 0
    return _Unpad(kidx, lens, q_real, cu_q, max_q, max_k, per_query)


def _check_packed(position_ids: torch.Tensor | None, kv_start: torch.Tensor | None, b: int, s: int, n: int) -> None:
    """Prefill rows whose positions restart inside (packed sequences) would be attended as
    one sequence: refuse them. One check per position_ids tensor (all layers share it)."""
    if position_ids is None or s < 2:
        return
    key = (id(position_ids), position_ids._version, id(kv_start))
    if _checked_positions.get(key) == (position_ids, kv_start):
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
    _checked_positions.clear()
    _checked_positions[key] = (position_ids, kv_start)


_checked_positions: dict = {}


def _sink_logits(s_aux: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """gpt-oss's ``s_aux`` (a parameter in the model's dtype) as kvarena's sink_logits."""
    return None if s_aux is None else s_aux.to(accumulator_dtype(dtype))


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
    attention_mask : None or int32 ``[B]``
        What :func:`kvarena_mask` returned (left padding per row).

    Returns
    -------
    ``(out [B, S, H_q, D], None)``.
    """
    handoff = _HANDOFF.get(id(key))
    cache = handoff[1] if handoff is not None and handoff[0]() is key else None
    if cache is None:
        return _attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                          s_aux, backend, kwargs, None)
    try:
        return _attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                          s_aux, backend, kwargs, handoff)
    except BaseException:  # a refused step leaves a KVArenaCache as it was before the step
        cache._abort_step()
        raise


def _attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, s_aux,
               backend, kwargs, handoff):
    weights = kwargs.get("output_attentions")
    if weights is None:  # not passed to the forward: the config's, as transformers' output capture reads it
        weights = getattr(getattr(module, "config", None), "output_attentions", False)
    if weights:
        raise _unsupported("output_attentions=True (kvarena never forms the attention weights; use "
                           "attn_implementation='eager' for them)")
    if dropout and module.training:
        raise _unsupported("attention dropout while training")
    if attention_mask is not None and not hasattr(attention_mask, "_kvarena"):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise _unsupported(f"an attention mask that did not come from its mask hook (got {shape}; a 4-D custom mask?)")
    mask_in = attention_mask
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
        segments = attention_mask._kvarena_segments if hasattr(attention_mask, "_kvarena_segments") else None
        attention_mask = attention_mask if padded or segments is not None else None
    b, h_q, s, d = query.shape
    valid = getattr(mask_in, "_kvarena_valid", None)
    if valid is not None:  # a static cache: only its first `valid` slots hold tokens
        key, value = key[:, :, :valid], value[:, :, :valid]
    if handoff is not None:
        return handoff[1]._attend(handoff[2], query, key, value, attention_mask, scaling, causal, window, softcap,
                                  s_aux, backend, kwargs.get("position_ids"))
    n = key.shape[2]
    segments = getattr(attention_mask, "_kvarena_segments", None)
    if segments is not None:  # packed sequences: one kvarena sequence each, in its row's block
        rows, ends, starts, cu, max_q = (t.to(query.device) if isinstance(t, torch.Tensor) else t for t in segments)
        out = paged_attention(
            query.transpose(1, 2).reshape(b * s, h_q, d), key.transpose(1, 2), value.transpose(1, 2), rows, ends, cu,
            scale=scaling, causal=True, window_left=None if window is None else window - 1, softcap=softcap,
            kv_start=starts, max_seqlen_q=max_q, max_seqlen_k=n, sink_logits=_sink_logits(s_aux, query.dtype),
            backend=backend)
        return out.view(b, s, h_q, d), None
    _check_packed(kwargs.get("position_ids"), attention_mask, b, s, n)
    pack = getattr(attention_mask, "_kvarena_pack", None)
    if pack is not None:
        return _attention_unpadded(query, key, value, pack, scaling, causal, window, softcap, s_aux, backend)
    q = query.transpose(1, 2).reshape(b * s, h_q, d)
    # One block per row: [B, L, H_kv, D] strided views of the dense cache, no copy.
    k_cache, v_cache = key.transpose(1, 2), value.transpose(1, 2)
    dev = query.device
    table = torch.arange(b, dtype=torch.int32, device=dev)[:, None]
    lens = torch.full((b,), n, dtype=torch.int32, device=dev)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
    sink = _sink_logits(s_aux, query.dtype)
    out = paged_attention(
        q, k_cache, v_cache, table, lens, cu, scale=scaling, causal=causal,
        window_left=None if window is None else window - 1, softcap=softcap,
        kv_start=attention_mask, max_seqlen_q=s, max_seqlen_k=n, sink_logits=sink, backend=backend,
    )
    return out.view(b, s, h_q, d), None


def _attention_unpadded(query, key, value, pack: _Unpad, scaling, causal, window, softcap, s_aux, backend):
    """Right padding or holes with transformers' cache: each row's real keys gathered
    left-aligned (one block per row of ``max_k`` keys), its real queries packed (or one
    sequence per query, see :func:`_unpad`); padding query rows as eager computes them."""
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
        return out, None
    if pack.max_q == 0:
        return out, None
    table = torch.arange(b, dtype=torch.int32, device=query.device)[:, None]
    got = paged_attention(query.transpose(1, 2)[pack.q_real], k_cache, v_cache, table, pack.lens, pack.cu_q,
                          window_left=None if window is None else window - 1, max_seqlen_q=pack.max_q, **opts)
    out[pack.q_real] = got
    return out, None


def register(*, backend: str = "auto") -> None:
    """Register ``"kvarena"`` with transformers' attention and mask interfaces (idempotent).

    ``backend``: kvarena's (``"auto"``: Triton on CUDA, the PyTorch path on CPU; a later
    call with another value replaces the registration).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_backend(backend)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return kvarena_attention(module, query, key, value, attention_mask, backend=backend, **kwargs)

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, kvarena_mask)


# --------------------------------------------------------------------------- KVArenaCache

# The hand-off from KVArenaCache.update to the attention function: the new key tensor the
# cache returned -> (weakref to it, the cache, layer). transformers has no official way for
# an attention function to find a custom cache's storage; an id alone could be reused once
# the tensor is gone, hence the weakref identity check.
_HANDOFF: dict[int, tuple] = {}

#: Tokens per row the arena holds when neither ``max_tokens`` nor ``max_bytes`` is given:
#: ``batch x min(max_position_embeddings, DEFAULT_MAX_TOKENS_PER_ROW)``.
DEFAULT_MAX_TOKENS_PER_ROW = 1 << 15


def _cache_base():
    from transformers.cache_utils import Cache

    return Cache


class KVArenaCache:  # the transformers Cache base is mixed in at first use (see __new__)
    """A transformers ``Cache`` whose K/V live in a kvarena ``PagedKVCache`` arena.

    Pass it as ``generate(past_key_values=KVArenaCache(model.config))`` on a model using
    ``attn_implementation="kvarena"`` (another implementation is a ``ValueError`` naming
    it, at the first layer: it would attend only the new tokens). Per step: one
    ``plan`` (at the step's first attention call, not per layer), padding tokens never
    stored, every layer's new K/V stored into the arena and attended through the block
    tables; beam search / ``num_return_sequences`` reorder rows with ``fork`` (blocks
    shared by reference count), assisted decoding's ``crop`` is ``truncate``, ``reset()``
    frees every block. A full arena raises ``CacheFullError`` with the cache unchanged, and
    any other refused step (an unsupported input, another implementation's attention, a
    call the pool refuses) leaves it as it was before the step: length, rows and blocks.

    transformers' ``Cache`` API: ``layers[i]`` (``keys`` / ``values``: gathered copies of
    the arena in transformers' layout ``[B, H_kv, get_seq_length(), D]`` and the model's
    dtype, each row's stored tokens right-aligned, 0 where nothing is stored: padding,
    released blocks; see ``_ArenaLayer``), ``batch_size`` (rows; -1 before the first step),
    ``get_max_length()`` (-1: no per-row maximum), ``has_previous_state`` (no linear
    attention layer: the ValueError ``DynamicCache`` raises), ``is_croppable``.

    Parameters
    ----------
    config : PretrainedConfig
        The model's (its ``num_hidden_layers``, ``max_position_embeddings`` and
        ``_attn_implementation`` are read).
    max_tokens, max_bytes : int, optional
        Arena size in tokens (all rows together) or bytes. Neither: sized at the first
        update for ``batch x min(max_position_embeddings, DEFAULT_MAX_TOKENS_PER_ROW)``
        tokens; it does not grow (a later, bigger batch may hit ``CacheFullError``).
    block_size : int, default 16
    dtype, device : optional
        Default: the first update's K/V dtype and device (the model's).
        ``dtype=torch.float8_e4m3fn`` stores fp8 K/V with per-(token, kv head) scales
        (52% of bf16's bytes); the model's own dtype stays the input dtype (inference).
    free_out_of_window : bool, optional
        Release blocks older than the sliding window (``PagedKVCache(free_out_of_window=
        True)``). None: on when the model slides (``config.sliding_window`` set and some
        ``config.layer_types`` entry, or every layer when absent, ``"sliding_attention"``).
        Mistral-style models (every layer slides) then hold about a window per row; models
        that mix sliding and full layers (Gemma 2/3, gpt-oss) get layer groups
        (:func:`kvarena.group_layers` of ``config.layer_types``): the sliding groups hold
        about a window per row, the full ones the whole history.
    rollback_tokens : int, default 64
        With the release on: how far ``crop`` (assisted decoding) can always go back from
        the longest length a step started from (a crop does not renew the margin).
    """

    def __new__(cls, *args, **kwargs):
        base = _cache_base()
        if not issubclass(cls, base):
            cls = _cache_class(cls, base)
        return object.__new__(cls)

    def __init__(self, config, *, max_tokens: int | None = None, max_bytes: int | None = None,
                 block_size: int = 16, dtype=None, device=None, free_out_of_window: bool | None = None,
                 rollback_tokens: int = 64) -> None:
        from kvarena.attention.spec import check_bool
        from kvarena.cache.arena import _check_int

        self.num_layers = _check_int("config.num_hidden_layers", config.num_hidden_layers, 1)
        layer_cls = _cache_class(_ArenaLayer, _layer_base())
        _cache_base().__init__(self, layers=[layer_cls(self, i) for i in range(self.num_layers)])
        self.config = config
        self._max_tokens = None if max_tokens is None else _check_int("max_tokens", max_tokens, 1)
        self._max_bytes = None if max_bytes is None else _check_int("max_bytes", max_bytes, 1)
        self.block_size = _check_int("block_size", block_size, 1)
        self._dtype, self._device = dtype, device
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is not None and len(types) != self.num_layers:
            types = None  # not one entry per layer: not a layout transformers would use either
        sliding = [window is not None and (types is None or t == "sliding_attention") for t in types or
                   [None] * self.num_layers]
        if free_out_of_window is None:
            free_out_of_window = any(sliding)
        check_bool("free_out_of_window", free_out_of_window)
        if free_out_of_window and not any(sliding):
            raise ValueError("free_out_of_window: the model has no sliding layer (config.sliding_window unset or "
                             "no 'sliding_attention' in config.layer_types); nothing leaves a window")
        self._sliding = sliding
        self._release = (int(window) - 1, _check_int("rollback_tokens", rollback_tokens, 0)) if free_out_of_window else None
        self.pool = None
        self._names: list = []  # namespace of each batch row
        self._next_name = 0
        self._len = 0  # padded length (what transformers counts: pads included)
        self._meta = None
        self._step_rows = None
        self._packed = False
        self._pending: set[int] = set()  # hand-offs not attended yet
        # The step in progress, to undo if it is refused: (length, rows, each row's pool
        # length, whether the pool was made for it); None between steps.
        self._undo = None

    # --- what transformers asks ------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._settle()
        return self._len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        self._settle()
        return self._len + query_length, 0

    def _settle(self) -> None:
        """A hand-off still pending when transformers asks for the length (a forward starts)
        was attended by another implementation, which may have failed outside kvarena (sdpa
        given this cache): the step it belongs to is undone before anyone reads the length."""
        if self._pending:
            self._abort_step()

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.pool is not None

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:  # the base class's all([]) would call it recurrent
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    def __len__(self) -> int:
        return self.num_layers

    @property
    def batch_size(self) -> int:
        """Rows held (after the first step; ``-1`` before it and after ``reset()``)."""
        return len(self._names) if self._names else -1

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """``-1``, as transformers' ``DynamicCache``: no per-row maximum (the arena's tokens are
        shared by the rows; a step past them raises ``CacheFullError``)."""
        if layer_idx is not None:
            self._layer_index(layer_idx)
        return -1

    def _layer_index(self, layer_idx) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, numbers.Integral) or not (
                0 <= layer_idx < self.num_layers):
            raise ValueError(f"layer_idx: expected an int in [0, {self.num_layers}), got {layer_idx!r}")
        return int(layer_idx)

    def _read(self, layer: int, j: int):
        """Layer ``layer``'s K (``j == 0``) or V as ``[B, H_kv, get_seq_length(), D]`` in the
        model's dtype: a gathered copy, each row's stored tokens right-aligned (oldest first);
        what the arena does not hold (left padding, blocks released out of the window) is 0."""
        pool = self.pool
        if pool is None or not self._names:
            return None
        from kvarena.attention.fp8 import dequantize_fp8

        region, lay, bs = pool.region, pool.layout, pool.block_size
        g, _slot = lay.group_of(layer)
        h, d = lay.layer_shape(layer)
        data = region.k(layer) if j == 0 else region.v(layer)  # [blocks, bs, H, D]
        scales = region.kv_scales(layer)
        out = torch.zeros(len(self._names), self._len, h, d, dtype=lay.input_dtype, device=pool.device)
        for i, name in enumerate(self._names):
            n = min(pool.seq_len(name), self._len) if name in pool else 0
            if n == 0:
                continue
            blocks = pool.block_ids(name, g)[: -(-n // bs)]
            ids = torch.tensor([max(b, 0) for b in blocks], dtype=torch.long, device=pool.device)
            x = data[ids].reshape(-1, h, d)[:n]
            if lay.is_fp8:
                sc = scales[j]
                sc = sc[ids].reshape(-1, h)[:n] if sc.dim() else sc
                x = dequantize_fp8(x, sc, torch.float32)
            held = torch.tensor([b >= 0 for b in blocks], device=pool.device).repeat_interleave(bs)[:n]
            out[i, self._len - n :] = torch.where(held[:, None, None], x.to(lay.input_dtype), 0)
        return out.transpose(1, 2)

    # --- the arena ---------------------------------------------------------------------
    def _make_pool(self, key: torch.Tensor, batch: int) -> None:
        from kvarena.cache.arena import KVLayout, group_layers
        from kvarena.cache.keys import CachePolicy
        from kvarena.cache.paged import PagedKVCache

        dtype = self._dtype or key.dtype
        device = torch.device(self._device) if self._device is not None else key.device
        inp = None
        if dtype == torch.float8_e4m3fn:  # fp8 storage; the model's dtype in and out
            inp = key.dtype if key.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
        # Mixed sliding / full layers with the release on: a block list per group, so the
        # sliding groups return their old blocks (equal-size groups: no byte is wasted).
        groups = group_layers(self._sliding) if self._release is not None and not all(self._sliding) else None
        layout = KVLayout(num_layers=self.num_layers, num_kv_heads=key.shape[1], head_dim=key.shape[3], dtype=dtype,
                          input_dtype=inp, groups=groups)
        if self._max_bytes is not None:
            max_bytes = self._max_bytes
        else:
            tokens = self._max_tokens
            if tokens is None:
                per_row = min(int(getattr(self.config, "max_position_embeddings", 0) or DEFAULT_MAX_TOKENS_PER_ROW),
                              DEFAULT_MAX_TOKENS_PER_ROW)
                tokens = batch * per_row
            blocks = -(-tokens // self.block_size) + batch  # a partly filled block per row
            max_bytes = blocks * len(layout.layer_groups) * layout.block_bytes(self.block_size)
        release = {}
        if self._release is not None:  # sliding layers keep a window (+ rollback) per row
            from kvarena.attention.spec import AttentionSpec

            specs = [AttentionSpec(window_left=self._release[0] if s else None) for s in self._sliding]
            release = dict(attention=specs, free_out_of_window=True, rollback_tokens=self._release[1])
        self.pool = PagedKVCache(CachePolicy("paged_kv", max_bytes), layout=layout, block_size=self.block_size,
                                 device=device, **release)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Hand the new K/V to the attention function (stored there, where the padding is known).

        A refusal here (or in the attention function, or in the pool) undoes the step in
        progress: the cache is as it was before the step's first layer.
        """
        try:
            return self._update(key_states, value_states, layer_idx)
        except BaseException:
            self._abort_step()
            raise

    def _update(self, key_states, value_states, layer_idx):
        impl = getattr(self.config, "_attn_implementation", None)
        if layer_idx == 0 and not self._pending:
            self._undo = None  # the last step ran through: nothing of it waits for kvarena's attention
        if impl != NAME or self._pending:
            # The config it was made with says so, or the last hand-off was never attended by
            # kvarena (a model other than the config's, on another implementation): the step
            # that hand-off belongs to is undone (by update's caller).
            raise ValueError(f"kvarena: KVArenaCache needs attn_implementation='kvarena', the model uses "
                             f"{impl if impl != NAME else 'another implementation'!r}; its attention would see "
                             "only the new tokens")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"kvarena: layer_idx {layer_idx!r} is not a layer of this {self.num_layers}-layer cache")
        if self.pool is not None and (key_states.shape[1], key_states.shape[3]) != self.pool.layout.layer_shape(
                layer_idx):
            h, d = self.pool.layout.layer_shape(layer_idx)
            raise _unsupported(f"an arena made for other heads (this KVArenaCache holds {h} kv heads of dim {d} at "
                               f"layer {layer_idx}, the model gives {key_states.shape[1]} of dim "
                               f"{key_states.shape[3]}; another model? make a new KVArenaCache)")
        if layer_idx == 0:  # a new step
            b = key_states.shape[0]
            if self._names and len(self._names) != b:
                raise ValueError(f"kvarena: the cache holds {len(self._names)} rows, this step has {b}; "
                                 "call reset() before a generate with another batch size")
            lens = {} if self.pool is None else {n: self.pool.seq_len(n) for n in self._names if n in self.pool}
            self._undo = (self._len, list(self._names), lens, self.pool is None)
            if self.pool is None:
                self._make_pool(key_states, b)
            if not self._names:
                self._names = [self._fresh() for _ in range(b)]
            self._len += key_states.shape[2]
            self._meta = None
            _HANDOFF.clear()
        _HANDOFF[id(key_states)] = (weakref.ref(key_states), self, layer_idx)
        self._pending.add(id(key_states))
        return key_states, value_states

    def _abort_step(self) -> None:
        """Undo the step in progress (a refused or failed call): the length, the rows, the
        pool's lengths and the hand-offs as they were before its first layer."""
        undo, self._undo = self._undo, None
        self._pending.clear()
        for key in [key for key, h in _HANDOFF.items() if h[1] is self]:
            del _HANDOFF[key]
        if undo is None:
            return
        length, names, lens, new_pool = undo
        if new_pool:
            self.pool = None  # made for this step: forgotten with it
        elif self._meta is not None:  # planned: each row back to its length (the step's blocks freed)
            for name in self._names:
                if name not in self.pool:
                    continue
                if name not in lens:
                    self.pool.free_namespace(name)
                elif self.pool.seq_len(name) != lens[name]:
                    self.pool.truncate(name, lens[name])
        self._len, self._names, self._meta, self._step_rows, self._packed = length, names, None, None, False

    def _fresh(self):
        self._next_name += 1
        return self._next_name

    def _rows(self, query, key, value, rows):
        """q/k/v as the pool takes them, in its input dtype: transformers' ``[B, S]`` rows
        flattened (a padded plan), or the real rows ``rows [B, S]`` packed in row order."""
        b, h_q, s, d = query.shape
        if rows is None:
            qf = query.transpose(1, 2).reshape(b * s, h_q, d)
            kf = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
            vf = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
        else:  # one gather per tensor and layer
            qf, kf, vf = query.transpose(1, 2)[rows], key.transpose(1, 2)[rows], value.transpose(1, 2)[rows]
        dtype = self.pool.layout.input_dtype
        return qf.to(dtype), kf.to(dtype), vf.to(dtype)

    def _attend(self, layer: int, query, key, value, kv_start, scaling, causal, window, softcap, s_aux, backend,
                position_ids):
        self._pending.discard(id(key))
        if getattr(kv_start, "_kvarena_segments", None) is not None:
            raise _unsupported("packed sequences with KVArenaCache")
        b, h_q, s, d = query.shape
        opts = dict(scale=scaling, window_left=None if window is None else window - 1,
                    softcap=softcap, backend=backend)
        if s_aux is not None:
            opts["sink_logits"] = _sink_logits(s_aux, query.dtype)
        if self._meta is None:
            # The step's plan: each row's real new tokens (its left padding among them is
            # never stored). One plan for all layers.
            past = self._len - s  # padded
            pack = getattr(kv_start, "_kvarena_pack", None)
            if pack is not None:  # right padding or holes: each row's real new tokens, wherever they are
                new = pack.q_real.sum(1).tolist()
            else:
                pads = kv_start.tolist() if kv_start is not None else [0] * b
                new = [s - min(s, max(0, p - past)) for p in pads]
            if not causal:
                raise _unsupported("a bidirectional layer with KVArenaCache")
            _check_packed(position_ids, kv_start, b, s, self._len)
            # Inference: a padded plan, so q/k/v/out keep transformers' [B, S] rows (no
            # gather or scatter per layer). Under autograd, or with padding other than left
            # padding, the real rows are packed: the differentiable paths read each row's own
            # k/v at its position, and the padded plan takes each row's new tokens last.
            grad = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
            packed = pack is not None or grad
            rows = None
            if pack is not None:
                rows = pack.q_real.to(query.device)
            elif packed:  # [B, S]: the real rows, gathered on every layer
                rows = ((past + torch.arange(s)[None, :]) >= torch.tensor(pads)[:, None]).to(query.device)
            qf, kf, vf = self._rows(query, key, value, rows)
            # What the pool's forward checks without a plan, before the plan: a step it would
            # refuse (fp8 under autograd, a backend that cannot run) plans nothing.
            self.pool._check_call(qf, kf, vf, layer, opts, padded=not packed)
            batch = {self._names[i]: new[i] for i in range(b) if new[i] > 0} if packed else dict(zip(self._names, new))
            self._meta = self.pool.plan(batch, pad_to=None if packed else s)
            self._packed, self._step_rows = packed, rows
        else:
            qf, kf, vf = self._rows(query, key, value, self._step_rows)
        # This layer's mask kind (full or sliding): padding queries, or a hole in its window,
        # are read per query after the store (see _unpad), differentiable only through q.
        pack = getattr(kv_start, "_kvarena_pack", None)
        per_query = None if pack is None else pack.per_query
        if per_query is not None and torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            raise _unsupported("under autograd with KVArenaCache, padding queries that follow a real token or a "
                               "padding hole inside a sliding window (transformers' cache serves them)")
        out = self.pool.forward(qf, kf, vf, self._meta, layer, **opts).to(query.dtype)
        if not self._packed:
            return out.view(b, s, h_q, d), None
        full = query.new_zeros(b, s, h_q, d)
        if per_query is not None:  # padding queries, or a hole in a window: as eager (see _unpad)
            full[per_query[3]] = self._attend_per_query(layer, query, per_query, opts).to(query.dtype)
        else:
            full[self._step_rows] = out
        return full, None

    def _attend_per_query(self, layer: int, query, per_query, opts):
        """Each query of ``per_query`` (see :func:`_unpad`) as its own sequence over its row's
        blocks, after the step's K/V were stored: ``kv_start`` is its window (positions in the
        pool are the real tokens' ranks, padding never stored)."""
        rows, lens, starts, which = per_query
        pool = self.pool
        region, group = pool.region, pool.layout.group_of(layer)[0]
        tables = [pool.block_ids(name, group) for name in self._names]
        width = max(1, max(map(len, tables)))
        table = torch.tensor([[max(x, 0) for x in t] + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                             device=pool.device)[rows[:, 0].long()]
        scales = region.kv_scales(layer)
        kw = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
        q = query.transpose(1, 2)[which].to(pool.layout.input_dtype)
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        opts = {k: v for k, v in opts.items() if k != "window_left"}
        return paged_attention(q, region.k(layer), region.v(layer), table, lens, cu, kv_start=starts, causal=True,
                               max_seqlen_q=1, max_seqlen_k=int(lens.max()), **opts, **kw)

    # --- beams, assisted decoding, reset -----------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i becomes a copy of row ``beam_idx[i]`` (shared blocks, no K/V copied)."""
        self._undo = None  # between steps: the last one ran through
        src = [self._names[i] for i in beam_idx.tolist()]
        new = [self._fresh() for _ in src]
        for s_name, d_name in zip(src, new):
            self.pool.fork(s_name, d_name)
        for name in self._names:
            self.pool.free_namespace(name)
        self._names = new
        self._meta = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.reorder_cache(torch.arange(len(self._names)).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(torch.as_tensor(indices).reshape(-1))

    def crop(self, n: int) -> None:
        """Assisted decoding's rollback: ``n < 0`` drops the newest ``-n`` tokens (transformers
        >= 5.2x), ``n > 0`` keeps the first ``n`` (the older meaning), ``0`` does nothing."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"n: expected an int, got {n!r}")
        n = int(n)
        if -n > self._len:
            raise ValueError(f"n: crop({n}) drops {-n} tokens, the cache holds {self._len}")
        self._undo = None  # between steps: the last one ran through
        keep = self._len + n if n <= 0 else min(n, self._len)
        drop = self._len - keep
        if drop <= 0:
            return
        targets = [(name, max(0, self.pool.seq_len(name) - drop)) for name in self._names]
        for name, n_tokens in targets:  # all rows or none: a refused row leaves the others as they were
            self.pool.check_truncate(name, n_tokens)
        for name, n_tokens in targets:
            self.pool.truncate(name, n_tokens)
        self._len = keep
        self._meta = None

    def reset(self) -> None:
        """Free every block and forget the rows: the object serves a new generate."""
        if self.pool is not None:
            for name in self.pool.namespaces():
                self.pool.free_namespace(name)
        self._names, self._len, self._meta, self._undo = [], 0, None, None
        self._pending.clear()

    @property
    def used_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.used_bytes


def _layer_base():
    from transformers.cache_utils import CacheLayerMixin

    return CacheLayerMixin


class _ArenaLayer:  # transformers' CacheLayerMixin is mixed in (see KVArenaCache.__init__)
    """``KVArenaCache.layers[i]``: layer ``i`` of the arena as transformers' cache layer.

    ``keys`` / ``values`` are gathered copies (the arena's blocks are not contiguous per
    row), ``[B, H_kv, get_seq_length(), D]`` in the model's dtype (fp8 storage dequantized),
    each row's stored tokens right-aligned as transformers' cache holds them; slots the
    arena does not hold (left padding, blocks released out of the window) are zeros; None
    before the first step. Rows belong to the whole cache: reorder / crop / reset it, not a
    layer (a layer's own call is a ``kvarena:`` NotImplementedError).
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache, layer_idx: int) -> None:  # the mixin's __init__ would set keys / values
        self._cache, self.layer_idx = cache, layer_idx

    def __repr__(self) -> str:
        return f"KVArenaLayer({self.layer_idx})"

    @property
    def keys(self):
        return self._cache._read(self.layer_idx, 0)

    @property
    def values(self):
        return self._cache._read(self.layer_idx, 1)

    @property
    def is_initialized(self) -> bool:
        return self._cache.is_initialized

    @property
    def device(self):
        return None if self._cache.pool is None else self._cache.pool.device

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def lazy_initialization(self, key_states, value_states) -> None:
        return None  # the arena is made at the first update, for every layer

    def _whole_cache(self, what: str):
        raise NotImplementedError(f"kvarena: {what} on one layer of a KVArenaCache is not supported (its rows are "
                                  f"shared by every layer): call it on the cache")

    def reset(self) -> None:
        self._whole_cache("reset()")

    def reorder_cache(self, beam_idx) -> None:
        self._whole_cache("reorder_cache")

    def crop(self, tokens_to_remove: int) -> None:
        self._whole_cache("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole_cache("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        self._whole_cache("batch_select_indices")

    def offload(self) -> None:
        self._whole_cache("offload")

    def prefetch(self) -> None:
        self._whole_cache("prefetch")


def _cache_class(cls, base):
    """``cls`` with transformers' Cache mixed in (made once)."""
    made = _MIXED.get(cls)
    if made is None:
        made = _MIXED[cls] = type(cls.__name__, (cls, base), {"__module__": cls.__module__})
    return made


_MIXED: dict = {}
