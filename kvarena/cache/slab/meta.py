"""A step's plan as the kernels read it: :class:`SlabMetadata`, built once per step.

The build turns the applied runs (:class:`~kvarena.cache.slab.claim.Reservation`) into one
kernel *sequence* per planned chunk, lists each sequence's visible keys as pages, uploads
every table in one host-to-device copy, and makes the seam objects
(:class:`~kvarena.attention.batch.QueryRows`, :class:`~kvarena.attention.batch.KeySet`)
that every layer's forward hands to :func:`kvarena.attention.dispatch.attend` as they are.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from kvarena.argcheck import INT_LIMIT
from kvarena.attention.batch import KeySet, QueryRows
from kvarena.cache._meta import upload
from kvarena.cache.slab.claim import PlannedRun, Reservation
from kvarena.cache.slab.visibility import PageTable, clip, page_shifts

__all__ = ["RopeKeys", "SlabKeys", "SlabMetadata", "build_meta"]


@dataclass(frozen=True, eq=False)
class SlabKeys:
    """What one layer's forward hands to the attention seam, for one RoPE position mode.

    Attributes
    ----------
    rows : QueryRows
        The chunks' query rows (with RoPE: each sequence's first query position).
    keys : KeySet
        Every key the chunks' queries see, in the arena (``commit=True``).
    history : KeySet
        The keys before the run, in the arena (``commit=False``).
    own : KeySet
        The run's own keys, in the given k/v viewed as pages (``commit=False``).
    top_position : int
        The largest RoPE position the step reaches (-1 without RoPE).
    """

    rows: QueryRows
    keys: KeySet
    history: KeySet
    own: KeySet
    top_position: int = -1


@dataclass(frozen=True, eq=False)
class RopeKeys:
    """:class:`SlabKeys` per RoPE-on-read position mode the pool's layers use (None: unused)."""

    absolute: SlabKeys | None = None
    virtual: SlabKeys | None = None

    def of(self, mode: str) -> SlabKeys:
        return getattr(self, mode)


_NO_ROPE = RopeKeys()


@dataclass(frozen=True, eq=False)
class SlabMetadata:
    """One step of a batch of rollouts, from :meth:`SlabKVCache.plan`. Reused by every layer.

    ``B`` rollouts, each planning a run of consecutive chunks (usually one) of ``T``
    tokens in all (``n_tokens``). The kernels see one *sequence* per planned chunk
    (``N = num_chunks`` of them, rollout-major): its queries are the chunk's tokens, its
    keys the visible tokens, listed through a table of *pages* (``page_tokens`` rows of a
    slab; a whole slab unless token sinks/windows or a short chunk 0 need a junction
    inside one).

    Attributes
    ----------
    namespaces : tuple
        Per rollout, in the order of the mapping given to ``plan``.
    chunk_indices : tuple of int
        Per rollout, the run's last (newest) chunk.
    chunk_ranges : tuple of range
        Per rollout, the planned chunks.
    n_tokens, num_seqs, num_chunks : int
        ``T``, ``B`` and ``N``.
    page_tokens : int
        Rows per page of the arena tables (divides ``slab_tokens``).
    block_table, seq_lens, kv_start : Tensor, int32 ``[N, W]``, ``[N]``, ``[N]``
        The visible keys of each chunk's queries (sinks part, then window part ending at
        the chunk itself): exactly ``[kv_start, seq_len)`` of the listed pages.
    hist_block_table, hist_seq_lens, hist_kv_start : Tensor, int32
        The same restricted to tokens before the run (``hist_seq_lens`` 0: none).
    cu_seqlens_q : Tensor, int32 ``[N + 1]``
        Query rows of each sequence (chunk lengths, cumulated).
    slot_mapping : Tensor, int32 (int64 past 2**31 slots) ``[B * T]``
        Where ``commit=True`` writes the run's tokens (chunk 0 right-aligned in its slab).
    own_page_tokens : int
        Rows per page of the given k/v viewed as pages (``T`` for a one-chunk plan).
    dense_block_table, dense_seq_lens, dense_kv_start : Tensor, int32
        The run's tokens each chunk sees, in the given k/v ``[B, T, H_kv, D]`` viewed as
        ``[B * T / own_page_tokens, own_page_tokens, H_kv, D]`` pages.
    max_seqlen_q, max_seqlen_k, hist_max_seqlen_k, dense_max_seqlen_k : int
        Host maxima.
    has_kv_start, hist_has_kv_start, dense_has_kv_start : bool
        Whether any sequence needs its ``kv_start``.
    seam : SlabKeys
        The tables above as the attention seam's typed objects (no RoPE).
    rope : RopeKeys
        The same with RoPE-on-read positions, per position mode the pool's layers use.
    q_tokens : int
        Context parallel, tokens mode: query rows per rollout (the whole chunk; ``n_tokens``
        is then this rank's rows of it). 0: ``n_tokens``.
    """

    namespaces: tuple
    chunk_indices: tuple
    chunk_ranges: tuple
    n_tokens: int
    num_seqs: int
    num_chunks: int
    page_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    kv_start: torch.Tensor
    hist_block_table: torch.Tensor
    hist_seq_lens: torch.Tensor
    hist_kv_start: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    own_page_tokens: int
    dense_block_table: torch.Tensor
    dense_seq_lens: torch.Tensor
    dense_kv_start: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    hist_max_seqlen_k: int
    dense_max_seqlen_k: int
    has_kv_start: bool
    hist_has_kv_start: bool
    dense_has_kv_start: bool
    seam: SlabKeys = field(repr=False)
    _owner: int = field(repr=False)
    _versions: tuple = field(repr=False)
    _epoch: int = field(repr=False)
    _current: tuple = field(repr=False)  # _Chunk of every planned chunk
    _history: dict = field(repr=False)  # (namespace, index) -> _Chunk of every chunk seen before the run
    # The layers at which every history chunk was seen committed: a chunk, once committed
    # at a layer, stays so (a recycled slab is a new record, under a new epoch), so each
    # layer's check runs once per step, not per call (it walks every history chunk).
    _committed_at: set = field(default_factory=set, repr=False)
    rope: RopeKeys = field(default=_NO_ROPE, repr=False)
    q_tokens: int = 0

    def __deepcopy__(self, memo) -> SlabMetadata:
        # The chunk records are the pool's own bookkeeping, not data of the plan: a copy
        # must mark commits on the pool's records, or a commit through it would write the
        # slab and leave the chunk uncommitted.
        fields = {k: copy.deepcopy(v, memo) for k, v in vars(self).items() if k not in ("_current", "_history")}
        return SlabMetadata(**fields, _current=self._current, _history=self._history)


@dataclass(frozen=True, slots=True)
class _Seq:
    """One kernel sequence (a planned chunk): its queries' visible token intervals, all of
    them (``full``), before the run (``hist``) and in the run relative to its start (``own``)."""

    row: int
    run: PlannedRun
    pad: int
    run_start: int
    n_tokens: int
    full: list
    hist: list
    own: list


def _sequences(res: Reservation, st: int, history: dict) -> list[_Seq]:
    """The kernel sequences of a plan; ``history`` gets every chunk they see before their run."""
    seqs = []
    for row, pr in enumerate(res.runs):
        plan, ns, records = pr.plan, pr.namespace, pr.records
        pad, c0 = st - plan.rule.n0, plan.c0
        r0 = plan.rule.start(c0)
        for ch, full, seen in zip(pr.run, plan.seen.intervals, plan.seen.chunks):
            hist = clip(full, 0, r0)
            own = [(a - r0, e - r0) for a, e in clip(full, r0, INT_LIMIT)]
            seqs.append(_Seq(row, pr, pad, r0, ch.n_tokens, full, hist, own))
            for i in seen:
                if i < c0:
                    history[(ns, i)] = records[i]
    return seqs


def _page_sizes(seqs: list[_Seq], st: int, t: int) -> tuple[int, int]:
    """``(arena page, own page)`` rows: the largest divisors of the slab (of the run) at which
    every junction between the sink part and the window part falls on a page edge."""
    g, g_own = st, t
    for s in seqs:
        for ivs in (s.full, s.hist):
            if len(ivs) > 1:
                g = math.gcd(g, ivs[0][1] + s.pad, ivs[1][0] + s.pad)
        if len(s.own) > 1:
            g_own = math.gcd(g_own, s.own[0][1], s.own[1][0])
    return g, g_own


def _tables(seqs: list[_Seq], g: int, g_own: int, st: int, t: int, num_layers: int) -> list[PageTable]:
    """Page tables of the full, history and own keys of every sequence."""
    per_slab = 2 * num_layers * st // g  # pages between two slabs' starts
    tabs = [PageTable(g), PageTable(g), PageTable(g_own)]

    for s in seqs:
        pad, records = s.pad, s.run.records
        if g == st:  # whole slabs: page id = slot
            def arena_page(p, rec=records):
                return rec[p].slot
        else:
            def arena_page(p, rec=records):
                return rec[p * g // st].slot * per_slab + (p * g % st) // g
        tabs[0].add([(a + pad, e + pad) for a, e in s.full], arena_page)
        tabs[1].add([(a + pad, e + pad) for a, e in s.hist], arena_page)
        tabs[2].add(s.own, lambda p, row=s.row: row * (t // g_own) + p)
    return tabs


@dataclass(frozen=True, eq=False)
class _Uploaded:
    """The plan's device tensors (one upload)."""

    tables: list
    lens: list
    starts: list
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor


def _upload(tabs: list[PageTable], seqs: list[_Seq], chunks: list, st: int, t: int, b: int, device,
            slot_dtype) -> _Uploaded:
    n_seq = len(seqs)
    flat: list[int] = []
    widths = [tab.width() for tab in tabs]
    for tab, w in zip(tabs, widths):
        for ids in tab.ids:
            flat += ids + [0] * (w - len(ids))
    if flat and max(flat) >= 2**31:
        raise ValueError(
            f"batch: page ids pass int32 (page size {tabs[0].g} tokens of {st}-token slabs); "
            "use chunk lengths and sink/window sizes with a larger common divisor"
        )
    for tab in tabs:
        flat += tab.lengths + tab.starts
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + s.n_tokens)
    flat += cu
    # slot_mapping: chunk i's tokens go to rows st - n_i .. st - 1 of its slab; built on
    # the device from one first slot per chunk (a host list of B * T ints costs ~1 ms).
    flat += [ch.slot for ch in chunks] + [st - ch.n_tokens for ch in chunks]
    packed = upload(flat, torch.int32, device)
    parts = packed.split([n_seq * w for w in widths] + [n_seq] * (2 * len(tabs)) + [n_seq + 1, n_seq, n_seq])
    tables = [x.view(n_seq, w) for x, w in zip(parts, widths)]
    lens, starts = list(parts[3:9:2]), list(parts[4:9:2])
    cu_t = parts[9]
    first = parts[10].to(torch.int64) * st  # int64: slot * slab_tokens may pass 2**31
    first = first + parts[11]
    return _Uploaded(tables, lens, starts, cu_t, _slot_mapping(first, chunks, t, b * t, device).to(slot_dtype))


def _slot_mapping(first: torch.Tensor, chunks: list, t: int, b_t: int, device) -> torch.Tensor:
    if all(ch.n_tokens == t for ch in chunks):  # one chunk per rollout, all of one length
        offsets = torch.arange(t, device=device, dtype=torch.int64)
        return (first[:, None] + offsets[None, :]).reshape(-1)
    lens = torch.tensor([ch.n_tokens for ch in chunks], dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    idx = torch.arange(b_t, dtype=torch.int64)
    rel = (idx - torch.repeat_interleave(starts, lens, output_size=b_t)).to(device)
    return torch.repeat_interleave(first, lens.to(device), output_size=b_t) + rel


def _rope_shifts(mode: str, seqs: list[_Seq], tabs: list[PageTable], g: int, g_own: int) -> tuple[list, list, int]:
    """Per sequence, the first query's RoPE position and each table's per-page key shifts;
    and the largest position the step reaches.

    Absolute: a key's logical token index; the queries are the chunk's tokens. Virtual:
    the key's index in the concatenation of the keys the chunk sees (its sinks, its
    window, then its own tokens), which is the kernel's key space minus ``kv_start``;
    the own keys of a denoising step continue after the history.
    """
    full_t, hist_t, own_t = tabs
    q_pos, shifts, top = [], ([], [], []), 0
    for j, s in enumerate(seqs):
        if mode == "absolute":
            pad = s.pad
            q0 = s.full[-1][1] - s.n_tokens
            fs = page_shifts([(a + pad, e + pad) for a, e in s.full], g, pad)
            hs = page_shifts([(a + pad, e + pad) for a, e in s.hist], g, pad)
            os_ = page_shifts(s.own, g_own, -s.run_start)
            top = max(top, s.full[-1][1] - 1)
        else:
            f_start, f_len, h_start = full_t.starts[j], full_t.lengths[j], hist_t.starts[j]
            q0 = f_len - f_start - s.n_tokens
            fs, hs = [-f_start] * len(full_t.ids[j]), [-h_start] * len(hist_t.ids[j])
            os_ = [(hist_t.lengths[j] - h_start) - own_t.starts[j]] * len(own_t.ids[j])
            top = max(top, f_len - f_start - 1)
        q_pos.append(q0)
        for tab, sh in zip(shifts, (fs, hs, os_)):
            tab.append(sh)
    return q_pos, list(shifts), top


def _rope_keys(modes: tuple, plain: SlabKeys, seqs: list[_Seq], tabs: list[PageTable], g: int, g_own: int,
               device) -> RopeKeys:
    """:class:`RopeKeys` of a plan: host math and one upload per position mode."""
    out = {}
    n = len(seqs)
    for mode in modes:
        q_pos, shifts, top = _rope_shifts(mode, seqs, tabs, g, g_own)
        flat = list(q_pos)
        widths = []
        for tab in shifts:
            w = max(1, max(len(x) for x in tab))
            widths.append(w)
            for x in tab:
                flat += x + [0] * (w - len(x))
        packed = upload(flat, torch.int32, device)
        o, parts = n, []
        for w in widths:
            parts.append(packed[o : o + n * w].view(n, w))
            o += n * w
        out[mode] = _with_rope(plain, packed[:n], *parts, top)
    return RopeKeys(**out)


def _with_rope(plain: SlabKeys, q_pos, full_sh, hist_sh, own_sh, top: int) -> SlabKeys:
    def shifted(keys: KeySet, sh) -> KeySet:
        return KeySet(keys.block_table, keys.seq_lens, keys.max_seqlen_k, keys.kv_start, sh)

    rows = plain.rows
    return SlabKeys(QueryRows(rows.cu_seqlens_q, rows.max_seqlen_q, q_pos), shifted(plain.keys, full_sh),
                    shifted(plain.history, hist_sh), shifted(plain.own, own_sh), top)


def _seam(up: _Uploaded, tabs: list[PageTable], cu_q, max_q: int, multi: bool, t: int) -> SlabKeys:
    """The plan's seam objects without RoPE."""
    full_t, hist_t, own_t = tabs

    def keys(i: int, max_k: int, starts: bool) -> KeySet:
        return KeySet(up.tables[i], up.lens[i], max_k, up.starts[i] if starts else None)

    return SlabKeys(
        QueryRows(cu_q, max_q),
        keys(0, max(full_t.lengths), any(full_t.starts)),
        keys(1, max(hist_t.lengths), any(hist_t.starts)),
        keys(2, max(own_t.lengths) if multi else t, multi and any(own_t.starts)),
    )


def build_meta(pool, res: Reservation, q_tokens: int = 0) -> SlabMetadata:
    """The metadata of an applied reservation (``q_tokens``: context parallel tokens mode's
    query rows per rollout, 0: the run's own)."""
    st, t, b = pool.slab_tokens, res.n_tokens, len(res.runs)
    history: dict = {}
    seqs = _sequences(res, st, history)
    g, g_own = _page_sizes(seqs, st, t)
    tabs = _tables(seqs, g, g_own, st, t, pool.layout.num_layers)
    chunks = [ch for pr in res.runs for ch in pr.run]
    up = _upload(tabs, seqs, chunks, st, t, b, pool.device, pool._slot_dtype)
    max_q = max(s.n_tokens for s in seqs)
    cu_q = up.cu_seqlens_q
    if q_tokens:
        cu_q = torch.arange(0, (b + 1) * q_tokens, q_tokens, dtype=torch.int32, device=pool.device)
        max_q = q_tokens
    seam = _seam(up, tabs, cu_q, max_q, len(seqs) != b, t)
    full_t, hist_t, own_t = tabs
    return SlabMetadata(
        namespaces=tuple(pr.namespace for pr in res.runs),
        chunk_indices=tuple(pr.run[-1].index for pr in res.runs),
        chunk_ranges=tuple(range(pr.run[0].index, pr.run[-1].index + 1) for pr in res.runs),
        n_tokens=t, num_seqs=b, num_chunks=len(seqs), page_tokens=g,
        block_table=up.tables[0], seq_lens=up.lens[0], kv_start=up.starts[0],
        hist_block_table=up.tables[1], hist_seq_lens=up.lens[1], hist_kv_start=up.starts[1],
        cu_seqlens_q=cu_q, slot_mapping=up.slot_mapping, own_page_tokens=g_own,
        dense_block_table=up.tables[2], dense_seq_lens=up.lens[2], dense_kv_start=up.starts[2],
        max_seqlen_q=max_q, max_seqlen_k=max(full_t.lengths), hist_max_seqlen_k=max(hist_t.lengths),
        dense_max_seqlen_k=max(own_t.lengths), has_kv_start=any(full_t.starts),
        hist_has_kv_start=any(hist_t.starts), dense_has_kv_start=any(own_t.starts),
        seam=seam,
        rope=_rope_keys(pool._rope_modes, seam, seqs, tabs, g, g_own, pool.device) if pool._rope_modes else _NO_ROPE,
        q_tokens=q_tokens,
        _owner=pool._cache_id,
        _versions=tuple(pr.rollout.version for pr in res.runs),
        _epoch=pool._epoch,
        _current=tuple(chunks),
        _history=history,
    )
