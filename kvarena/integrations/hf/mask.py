"""The mask hook: transformers' mask inputs read into what the attention function needs
(the rule a mask function follows, left padding as ``kv_start``, other padding unpadded,
packed sequences)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvarena.integrations.hf._common import _unsupported

__all__ = ["kvarena_mask"]


def _rule_of(mask_function, batch_size: int, q_offset: int, q_length: int, kv_offset: int, kv_length: int,
             device) -> tuple[bool, int | None]:
    """``(causal, window)`` that reproduces a transformers mask function on this call.

    kvarena expresses ``kv <= q`` (causal), optionally ``kv > q - W`` (a sliding window), or
    everything (bidirectional). transformers' own mask functions are recognised by what they
    are (:func:`_standard_rule`, never evaluated). Any other is evaluated (index-based, as
    transformers' non-vmap path does) on every batch row, query row and key of the call;
    the rule is read off them and must reproduce every one exactly, else ``kvarena:``
    NotImplementedError (chunked attention, prefix / block masks, packed sequences, Gemma
    3's image blocks). ``window`` None: no key of this call is cut by a window.
    """
    rule = _standard_rule(mask_function)
    if rule is not None:
        return rule
    rows_q = torch.arange(q_offset, q_offset + q_length)
    kv = torch.arange(kv_offset, kv_offset + kv_length)
    future = kv[None, None, :] > rows_q[None, :, None]
    step = max(1, (1 << 24) // max(1, q_length * kv_length))  # batch rows per evaluation: <= 16M entries
    causal, window = True, None
    for b0 in range(0, batch_size, step):
        rows_b = torch.arange(b0, min(batch_size, b0 + step))
        got = mask_function(rows_b[:, None, None, None], torch.zeros(1, 1, 1, 1, dtype=torch.long),
                            rows_q[None, None, :, None], kv[None, None, None, :])
        got = torch.as_tensor(got).to("cpu").expand(len(rows_b), 1, q_length, kv_length)[:, 0]  # [b, q, kv]
        if b0 == 0:
            causal = not bool((got & future).any())
            last = got[:, -1]  # the last query row of each batch row: the one a window cuts most
            if causal and bool(last.any()):
                lo = int(kv[last.any(0).nonzero().min()])
                if lo > kv_offset:
                    window = int(rows_q[-1]) - lo + 1
        want = ~future if causal else torch.ones_like(future)
        if window is not None:
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
    mask kind (not per layer); reading the mask is its host sync. Under ``torch.compile``
    nothing is read on the host (see :func:`_mask_compiling`).
    """
    sizes = (batch_size, q_length, kv_length, q_offset, kv_offset)
    if attention_mask is not None and hasattr(attention_mask, "_kvarena"):
        return _fed_back(attention_mask, sizes, mask_function, kwargs.get("device"))
    if kwargs.get("use_vmap"):
        return _custom_mask(sizes, mask_function, attention_mask, kwargs.get("device"), use_vmap=True)
    if torch.compiler.is_compiling():
        return _mask_compiling(sizes, mask_function, attention_mask, kwargs.get("device"))
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
        if found is None:  # any other rule (chunked attention, prefix or block masks): its 4-D mask
            return _custom_mask(sizes, mask_function, attention_mask, kwargs.get("device"), use_vmap=False)
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
            pack = _unpad(keep, q_length, *rule)
            kv_start = torch.zeros(batch_size, dtype=torch.int32, device=keep.device)
    else:
        device = attention_mask.device if attention_mask is not None else kwargs.get("device")
        kv_start = torch.zeros(batch_size, dtype=torch.int32, device=device)
    kv_start._kvarena = (padded, *rule)
    kv_start._kvarena_keep = None if pack is None else keep
    # The real keys over every key slot of the call (position-ordered), a shape that stays
    # for a static cache's compiled decode steps (see masked.rule_mask).
    slotted = static or isinstance(valid, torch.Tensor)
    kv_start._kvarena_slots_keep = None if pack is None else torch.nn.functional.pad(keep, (0, sizes[2] - keep.shape[1]))
    kv_start._kvarena_pack = pack
    kv_start._kvarena_segments = segments
    # a static cache: the slots holding tokens (kept as its tensor when full: one compiled graph)
    kv_start._kvarena_valid = valid if slotted else None
    kv_start._kvarena_sizes = sizes
    return kv_start


def _fed_back(attention_mask: torch.Tensor, sizes: tuple, mask_function, device) -> torch.Tensor:
    """This hook's own output, fed back: generate builds the masks ahead of the forward for
    a compileable cache (StaticCache), and the model hands them to the hook again. Returned
    as is when built for this call's sizes and mask function. Under ``torch.compile`` (the
    compiled decode step) the sizes held in ints are compared and the mask function is
    recognised by :func:`_standard_rule`; the static cache's query offset (a tensor) was
    checked where the mask was built (eager, in generate)."""
    built = getattr(attention_mask, "_kvarena_sizes", None)
    causal, window = attention_mask._kvarena[1:]
    if torch.compiler.is_compiling():
        rule = _standard_rule(mask_function)
        if built is not None and all(built[i] == sizes[i] for i in (0, 1, 2, 4)) and (
                rule is None or (rule[0] == causal and window in (None, rule[1]))):
            return attention_mask
    elif built == sizes:
        b, q_length, kv_length, q_offset, kv_offset = sizes
        if mask_function is None or _rule_of(mask_function, b, q_offset, q_length, kv_offset,
                                              min(kv_length, q_offset + q_length - kv_offset), device) == (causal, window):
            return attention_mask
    raise _unsupported(f"a mask built for other sizes ({built}, this call: {sizes} as (batch, q_length, kv_length, "
                       "q_offset, kv_offset))")


@torch._dynamo.assume_constant_result
def _standard_rule(mask_function) -> tuple[bool, int | None] | None:
    """``(causal, window)`` of transformers' own mask functions, recognised by what they are
    (``causal_mask_function``, ``bidirectional_mask_function``, and the closure
    ``sliding_window_causal_mask_function(W)`` makes), never evaluated; None for any other.
    A constant to ``torch.compile`` (read when the graph is traced, no host sync)."""
    from transformers import masking_utils as mu

    if mask_function is None or mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    parts = _cells(mask_function, mu.and_masks).get("mask_functions")
    if parts is not None and len(parts) == 2 and parts[1] is mu.causal_mask_function:
        window = _cells(parts[0], mu.sliding_window_overlay).get("sliding_window")
        if isinstance(window, int):
            return True, window
    return None


def _cells(fn, maker) -> dict:
    """The closure of ``fn`` by name, when ``fn`` is a closure ``maker`` makes; else {}."""
    code = getattr(fn, "__code__", None)
    if code is None or code is not _maker_code(maker):
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _maker_code(maker):
    return maker(1).__code__ if maker.__name__ == "sliding_window_overlay" else maker().__code__


def _mask_compiling(sizes: tuple, mask_function, attention_mask, device) -> torch.Tensor:
    """The hook under ``torch.compile``: no host read. A mask function :func:`_standard_rule`
    recognises, without a padding mask: kvarena's kernels (a static cache's slots holding
    tokens as a tensor of lengths). Anything else (a padding mask, chunked or packed masks):
    transformers' boolean mask (``sdpa_mask``), attended by the exact masked path
    (:func:`~kvarena.integrations.hf.masked.masked_attention`); compiled calls never see
    padding, holes or a pattern read on the host."""
    batch_size, q_length, kv_length, q_offset, kv_offset = sizes
    rule = _standard_rule(mask_function)
    valid = q_offset + q_length - kv_offset  # an int, or a static cache's 0-dim tensor
    if isinstance(valid, int) and valid < q_length:
        raise _unsupported(f"a cache of {kv_length} slots from {kv_offset} for {q_offset + q_length} tokens")
    if attention_mask is not None:
        device = attention_mask.device
    dense = None
    if rule is None or attention_mask is not None:
        from transformers.masking_utils import causal_mask_function, sdpa_mask

        dense = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                          attention_mask=attention_mask, allow_is_causal_skip=False,
                          allow_is_bidirectional_skip=False, device=device)
    kv_start = torch.zeros(batch_size, dtype=torch.int32, device=device)
    kv_start._kvarena = (False, *(rule or (True, None)))
    kv_start._kvarena_dense = dense
    kv_start._kvarena_keep = kv_start._kvarena_slots_keep = kv_start._kvarena_pack = None
    kv_start._kvarena_segments = None
    kv_start._kvarena_valid = valid if isinstance(valid, torch.Tensor) or kv_length > valid else None
    kv_start._kvarena_sizes = sizes
    return kv_start


def _custom_mask(sizes: tuple, mask_function, attention_mask, device, *, use_vmap: bool) -> torch.Tensor:
    """A mask function that is not one rule kvarena reads (causal, a causal window,
    bidirectional, packed sequences): one transformers composes with ``or_mask_function`` /
    ``and_mask_function`` (Gemma 3's bidirectional image tokens; ``use_vmap``), chunked
    attention, prefix or block masks. Returns transformers' own boolean ``[B, 1, Q, KV]``
    mask (``sdpa_mask``, padding folded in), which the attention function reads as a 4-D
    mask: kvarena's kernels where every query row sees one interval of keys, else the exact
    masked path (:mod:`.masked`)."""
    from transformers.masking_utils import sdpa_mask

    batch_size, q_length, kv_length, q_offset, kv_offset = sizes
    if attention_mask is not None:
        device = attention_mask.device
        attention_mask = attention_mask.bool()  # as transformers hands it to a mask hook
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)


def _segments_of(mask_function, b: int, n: int):
    """``((True, window), segments)`` when ``mask_function`` is causal within sequences packed
    in each row (a query sees no key before its sequence's first token), else None.

    The sequence starts are read off every ``(q, q - 1)`` pair; the rule (causal, the
    sequence, optionally a window) must then reproduce the function on every row. ``segments``: one kvarena sequence per packed sequence, row-
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
    rows_q = idx
    rows_b = torch.arange(b)
    got = torch.as_tensor(mask_function(rows_b[:, None, None, None], zero, rows_q[None, None, :, None],
                                        idx[None, None, None, :])).to("cpu").expand(b, 1, n, n)[:, 0]
    st = start  # [b, n]
    want = (idx[None, None, :] <= rows_q[None, :, None]) & (idx[None, None, :] >= st[..., None])
    lo = torch.where(got.any(-1), got.int().argmax(-1), -1)  # the first key each query sees
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
    q_attend: torch.Tensor  # bool [B, S]: the queries the packed reading serves (per_query the rest, see _unpad)
    cu_q: torch.Tensor  # int32 [B + 1]: their offsets
    max_q: int
    max_k: int
    per_query: tuple | None  # (rows int32 [N, 1], lens [N], kv_start [N], which bool [B, S]), see _unpad


def _unpad(keep: torch.Tensor, q_length: int, causal: bool = True, window: int | None = None) -> _Unpad:
    """Right padding or holes (``keep [B, L]``, any pattern): what the attention function
    needs to attend only the real keys, exactly as eager does.

    Causal: a real query is bottom-right aligned among its row's real keys, so causality is
    exact; a window then counts real keys, which equals eager's (which counts positions)
    unless a padding hole lies inside a real query's window. Eager also attends padding
    queries that follow a real key (its mask hides padding keys, not queries). In those two
    cases (``per_query``) each such query is its own sequence: its row, the real keys at or
    before it (``lens``) and ``kv_start`` = the real keys at or before ``p - window`` (0
    without a window). A padding query that sees no key gets zeros (eager: an average over
    a fully masked row, as with left padding).

    Bidirectional (``causal`` False, no window): every query of a row, padding queries
    included (eager's mask hides padding keys, not queries), sees every real key of its
    row, wherever it sits: the real queries packed, the padding queries of a row that holds
    a real key one sequence each (``per_query``, ``lens`` the row's real keys, ``kv_start``
    0: a row's queries may outnumber its real keys); a row of padding only sees no key
    (zeros).

    ``q_attend`` is what the packed reading serves (none when ``per_query`` holds every
    query that sees a key, as in the causal cases above); ``per_query`` serves the rest."""
    b, n = keep.shape
    s = q_length
    c = keep.cumsum(1, dtype=torch.int32)  # c[p]: real keys at or before p
    lens = c[:, -1]
    q_real = keep[:, n - s :]
    q_attend, per_query = q_real, None
    rows = torch.arange(b, device=keep.device, dtype=torch.int32)[:, None].expand(b, s)
    if not causal:
        which = ~q_real & (lens > 0)[:, None]  # padding queries of a row with a real key
        if bool(which.any()):
            per_query = (rows[which][:, None], lens[:, None].expand(b, s)[which], torch.zeros_like(c[:, :s])[which],
                         which)
    else:
        lo = torch.zeros_like(c)
        windowed = window is not None and window < n
        if windowed:
            lo = torch.nn.functional.pad(c, (window, 0))[:, :n]  # real keys at or before p - window
        cq, loq = c[:, n - s :], lo[:, n - s :]
        pad_q = ~q_real & (cq > loq)  # padding queries that see a key
        exact = not bool(pad_q.any())
        if exact and windowed:  # HF's window (p - window, p] holds c - lo real keys; kvarena's the last `window`
            exact = bool(((cq - loq == cq.clamp(max=window)) | ~q_real).all())
        if not exact:
            which = q_real | pad_q
            per_query = (rows[which][:, None], cq[which], loq[which], which)
            q_attend = torch.zeros_like(q_real)
    max_k = int(lens.max()) if b else 0
    kidx = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, : max(max_k, 1)]
    n_q = q_attend.sum(1, dtype=torch.int32)
    cu_q = torch.nn.functional.pad(n_q.cumsum(0, dtype=torch.int32), (1, 0))
    max_q = int(n_q.max()) if b else 0
    return _Unpad(kidx, lens, q_real, q_attend, cu_q, max_q, max_k, per_query)
