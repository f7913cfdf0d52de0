"""4-D attention masks: read into kvarena sequences where each query row sees one interval
of keys (:func:`read_4d`), else the exact masked path (:func:`masked_attention`).

transformers hands a user's 4-D mask (``[B or 1, H_q or 1, Q or 1, >= KV]``) to the
attention function as is: boolean (True = attend, as sdpa and flex read it) or additive
float (eager adds it to the scores). The same mask reaches every layer, sliding ones
included: as in eager and sdpa, the mask alone says what each query sees (the layer's
``sliding_window`` is not applied on top of it).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kvarena.integrations.hf._common import _unsupported, version_key

__all__ = ["Blocks", "Sequences", "attend_4d", "masked_attention", "read_4d", "rule_mask"]


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """The mask as eager adds it, in fp32: a boolean's False is ``finfo(float32).min``
    (transformers' own eager masks), a float mask as it is."""
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    return mask.float()


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scaling: float | None, softcap: float | None, s_aux: torch.Tensor | None) -> torch.Tensor:
    """Eager's arithmetic in fp32, for any mask: scores ``q k^T * scaling``, then the
    softcap, then the mask added (see :func:`_additive`; any bias, per head, holes), then
    the softmax (with gpt-oss's sink logit as an extra column, dropped after), times V.

    ``query [B, H_q, S, D]``, ``key / value [B, H_kv, L, D]``, ``mask`` broadcastable to
    ``[B, H_q, S, L]``. Returns ``[B, S, H_q, D]`` in the query's dtype. A query row whose
    mask hides every key gets what eager gives: with a finite "masked" value (transformers'
    ``finfo.min``) every score rounds to that value and the row averages all the values
    (with a sink: 0, the sink takes all the weight); with ``-inf``, NaN.
    """
    b, h, s, d = query.shape
    hk, n = key.shape[1], key.shape[2]
    g = h // hk
    scale = d ** -0.5 if scaling is None else scaling
    q = query.float().reshape(b, hk, g, s, d)
    scores = torch.einsum("bkgsd,bkld->bkgsl", q, key.float()).reshape(b, h, s, n) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + _additive(mask)
    if s_aux is not None:
        sink = s_aux.float().reshape(1, h, 1, 1).expand(b, h, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    out = torch.einsum("bkgsl,bkld->bkgsd", probs.reshape(b, hk, g, s, n), value.float())
    return out.reshape(b, h, s, d).transpose(1, 2).to(query.dtype)


def rule_mask(keep: torch.Tensor, valid, s: int, causal: bool, window: int | None) -> torch.Tensor:
    """bool ``[B, 1, S, L]``: what the last ``s`` of ``valid`` tokens see among ``L`` slots
    (slot = position): the slots holding tokens, ``keep [B, L]`` (a padding mask over the
    slots), at or before the query (``causal``) and inside ``(q - window, q]``. ``valid``
    may be a tensor (a static cache's length): no host read."""
    n = keep.shape[1]
    k = torch.arange(n, device=keep.device)
    q = (valid - s + torch.arange(s, device=keep.device))[:, None]
    vis = (k[None, :] < valid).expand(s, n)
    if causal:
        vis = vis & (k[None, :] <= q)
    if window is not None:
        vis = vis & (k[None, :] > q - window)
    return (vis[None] & keep[:, None, :].bool())[:, None]


@dataclass(frozen=True)
class Sequences:
    """kvarena sequences over one block per batch row (its keys, a strided view), each a run
    of consecutive query rows of one batch row: keys ``[kv_start, seq_len)``, and for a
    causal run with a ``window`` each row's last ``window`` of them."""

    which: torch.Tensor  # bool [B, S]: the query rows they serve (row-major = the sequences' order)
    rows: torch.Tensor  # int32 [N, 1]: each sequence's batch row (its block)
    seq_lens: torch.Tensor  # int32 [N]: one past its last key
    kv_start: torch.Tensor  # int32 [N]: its first key
    cu_q: torch.Tensor  # int32 [N + 1]: its query rows' offsets
    max_q: int
    window: int | None = None


@dataclass(frozen=True)
class Blocks:
    """A 4-D mask whose query rows each see one interval of keys, read as kvarena sequences:
    ``full``, each maximal run (two rows or more) of consecutive rows of a batch row that see
    the same keys (a prefix-LM's prefix, a bidirectional block), attended without the causal
    rule; ``causal`` (one entry per window width), every other row: each maximal run of rows
    that see one more key per row, from the same first key (a causal block: packed
    sequences, a causal prefill) then, optionally, sliding by one (a causal window of that
    width), is one causal sequence; any other row a sequence of its own."""

    causal: tuple[Sequences, ...]
    full: tuple[Sequences, ...]
    real: torch.Tensor  # bool [B, S]: the query rows that see a key
    any_empty: bool  # some query row sees no key (served by masked_attention)


def _runs(which: torch.Tensor, join: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
          slide: torch.Tensor | None = None) -> tuple[Sequences, ...]:
    """The maximal runs of ``which`` rows that ``join [B, S - 1]`` joins (row q to q - 1) as
    :class:`Sequences`, one per window width (a run's first key is its first row's, its
    end its last row's; a run holding a ``slide`` join has its last row's width as window)."""
    b, s = which.shape
    if not bool(which.any()):
        return ()
    join = join & which[:, 1:] & which[:, :-1]
    first = which & ~torch.nn.functional.pad(join, (1, 0))
    last = which & ~torch.nn.functional.pad(join, (0, 1))
    n_seg = int(first.sum())
    seg = torch.where(which, torch.cumsum(first.reshape(-1), 0).reshape(b, s) - 1, -1)  # each row's run
    width = torch.full((n_seg,), -1, dtype=torch.int32, device=which.device)  # -1: no window
    if slide is not None and bool((slide & join).any()):
        windowed = torch.zeros(n_seg, dtype=torch.bool, device=which.device)
        windowed[seg[:, 1:][slide & join]] = True
        width = torch.where(windowed, hi[last] - lo[last], width)
    i32 = torch.int32
    rows = torch.arange(b, dtype=i32, device=which.device)[:, None].expand(b, s)[first]
    lens_q = torch.bincount(seg[which], minlength=n_seg)
    out = []
    for w in torch.unique(width).tolist():
        pick = width == w
        lq = lens_q[pick]
        cu = torch.nn.functional.pad(lq.cumsum(0), (1, 0)).to(i32)
        out.append(Sequences(which & pick[seg.clamp(min=0)], rows[pick][:, None], hi[last][pick], lo[first][pick], cu,
                             int(lq.max()), None if w < 0 else w))
    return tuple(out)


def _check_shape(mask: torch.Tensor, b: int, h_q: int, s: int, n: int) -> None:
    mb, mh, ms, mk = mask.shape
    if mb not in (1, b) or mh not in (1, h_q) or ms not in (1, s) or mk < n:
        raise _unsupported(f"a 4-D attention mask of shape {tuple(mask.shape)} for {b} rows, {h_q} heads, {s} "
                           f"queries and {n} keys (expected [{b} or 1, {h_q} or 1, {s} or 1, >= {n}])")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise _unsupported(f"a 4-D attention mask of dtype {mask.dtype} (expected bool, True = attend, or an "
                           "additive float mask)")


def read_4d(mask: torch.Tensor, b: int, h_q: int, s: int, n: int) -> Blocks | str:
    """``mask`` (checked, cut to the ``n`` keys) as :class:`Blocks`, or why the masked
    path serves it: ``"bias"`` (a float value other than 0 and the dtype's minimum or
    ``-inf``, NaN, or a mask that requires grad), ``"per-head"`` (heads see different
    keys), ``"holes"`` (a row's keys are not one interval). Reads the mask on the host."""
    if mask.dtype == torch.bool:
        vis = mask
    else:
        if mask.requires_grad:
            return "bias"
        vis = mask == 0
        if not bool((vis | (mask <= torch.finfo(mask.dtype).min)).all()):
            return "bias"
    if vis.shape[1] > 1 and not bool((vis == vis[:, :1]).all()):
        return "per-head"
    vis = vis[:, 0].expand(b, s, n)
    count = vis.sum(-1, dtype=torch.int32)
    lo = vis.to(torch.int8).argmax(-1).to(torch.int32)  # the first key each row sees
    hi = n - vis.flip(-1).to(torch.int8).argmax(-1).to(torch.int32)  # one past its last
    real = count > 0
    if not bool(((hi - lo == count) | ~real).all()):
        return "holes"
    pair = real[:, 1:] & real[:, :-1]
    d_lo, d_hi = lo[:, 1:] - lo[:, :-1], hi[:, 1:] - hi[:, :-1]
    same = pair & (d_lo == 0) & (d_hi == 0)  # two rows that see the same keys
    in_full = torch.nn.functional.pad(same, (1, 0)) | torch.nn.functional.pad(same, (0, 1))
    grow = pair & (d_lo == 0) & (d_hi == 1)  # one more key, from the same first key
    slide = pair & (d_lo == 1) & (d_hi == 1)  # the same number of keys, one later
    # A causal run grows, then slides: a growing step after a slide starts a new run.
    join = slide | (grow & ~torch.nn.functional.pad(slide, (1, 0))[:, :-1])
    return Blocks(_runs(real & ~in_full, join, lo, hi, slide), _runs(in_full, same, lo, hi), real,
                  not bool(real.all()))


_last_read: dict = {}


def _read_once(mask: torch.Tensor, b: int, h_q: int, s: int, n: int) -> Blocks | str:
    """:func:`read_4d`, once per mask, version and shape (every layer is handed the same
    mask). An inference tensor has no version counter (see ``version_key``): read at every
    layer."""
    version = version_key(mask)
    if version is None:
        return read_4d(mask[..., :n], b, h_q, s, n)
    key = (*version, b, h_q, s, n)
    if _last_read.get("key") == key and _last_read["mask"]() is mask:
        return _last_read["read"]
    got = read_4d(mask[..., :n], b, h_q, s, n)
    _last_read.clear()
    _last_read.update(key=key, mask=weakref.ref(mask), read=got)  # weakly: the mask may be large
    return got


def attend_4d(query, key, value, mask: torch.Tensor, scaling, softcap, s_aux, paged):
    """A 4-D mask over transformers' dense K/V: :class:`Blocks` through kvarena's kernels
    (``paged``: :func:`~kvarena.paged_attention` with the layer's options; one block per
    batch row, a strided view), the rows that see no key and every other mask through
    :func:`masked_attention`. Under ``torch.compile`` (no host read) the masked path."""
    b, h_q, s, d = query.shape
    n = key.shape[2]
    _check_shape(mask, b, h_q, s, n)
    if torch.compiler.is_compiling():
        return masked_attention(query, key, value, mask[..., :n], scaling, softcap, s_aux)
    got = _read_once(mask, b, h_q, s, n)
    if not isinstance(got, Blocks):
        return masked_attention(query, key, value, mask[..., :n], scaling, softcap, s_aux)
    out = query.new_zeros(b, s, h_q, d)
    for seqs, causal in [(x, True) for x in got.causal] + [(x, False) for x in got.full]:
        out[seqs.which] = paged(query.transpose(1, 2)[seqs.which], key.transpose(1, 2), value.transpose(1, 2),
                                seqs.rows, seqs.seq_lens, seqs.cu_q, causal=causal, kv_start=seqs.kv_start,
                                window_left=None if seqs.window is None else seqs.window - 1,
                                max_seqlen_q=seqs.max_q, max_seqlen_k=n)
    if got.any_empty:  # rows that see no key: eager's answer for them
        for i in (~got.real).any(1).nonzero()[:, 0].tolist():
            sel = ~got.real[i]
            m = mask[min(i, mask.shape[0] - 1) : i + 1, :, :, :n]
            m = m[:, :, sel] if m.shape[2] > 1 else m
            out[i, sel] = masked_attention(query[i : i + 1, :, sel], key[i : i + 1], value[i : i + 1], m, scaling,
                                           softcap, s_aux)[0]
    return out
