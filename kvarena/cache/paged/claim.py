"""The paged pool's claim: what a planned step takes and gives back, all or nothing over the
batch (:func:`reserve`), and a truncate's release (:func:`truncate_blocks`). Call under the
pool's lock.

A shared block that a namespace is about to write into (the partial last block after a
fork, or a full one after a ``truncate``) is copied first (copy-on-write at plan time: a
new block gets the whole ``[num_layers, 2, block_size, H_kv, D]`` contents and the old
one is dereferenced).
"""

from __future__ import annotations

from itertools import compress, count
from operator import add, gt

import torch

from kvarena.argcheck import is_int
from kvarena.cache._meta import upload
from kvarena.cache.arena import CacheFullError
from kvarena.cache.paged.build import StepRows
from kvarena.cache.paged.planner import StepNeeds
from kvarena.cache.paged.table import FREED, SeqRecord, cdiv

__all__ = ["fork_blocks", "reserve", "truncate_blocks", "truncate_checked"]


def reserve(pool, names: tuple, news: tuple, graph: bool = False) -> StepRows:
    """Take the blocks of ``news[i]`` new tokens of each namespace ``names[i]`` (all or
    nothing; call under the lock) and flush the table: the step's rows, not yet gathered.

    A sequence whose new tokens end within its record's ``limit`` (most rows of a decode
    step) is a plain append: only its length and version change, written into the
    table's row arrays. The others are counted, released and taken in full
    (:meth:`WindowRules.count`)."""
    table = pool._table
    batch = table.rows_of(names, pool._seqs)
    recs = batch.records
    if batch.generation < 0 or 0 in news:
        olds = [0 if r is None else r.seq_len for r in recs]
        ends = list(map(add, olds, news))
        slow = [i for i, (r, e, n) in enumerate(zip(recs, ends, news)) if r is None or not n or e > r.limit]
    else:
        st = table.state
        olds = batch.take(st.lens)
        ends = list(map(add, olds, news))
        slow = list(compress(count(), map(gt, ends, batch.take(st.limit))))
    longest = max(ends)
    max_blocks = cdiv(longest, pool.block_size)
    grow, others = pool._windows.growing(slow, recs, olds, news)
    rest = [(names[i], news[i]) for i in others]  # what count() and the general path of _take see
    needs = pool._windows.count(rest, pool._seqs, pool.allocator) if rest else None
    g_cap = pool._graph
    if graph and max_blocks > g_cap.max_blocks:
        raise ValueError(
            f"batch: a sequence needs {max_blocks} blocks, over graph_capacity max_blocks {g_cap.max_blocks}"
        )
    need = len(grow) * pool._ngroups + (needs.need if needs is not None else 0)
    available = needs.available if needs is not None else pool.allocator.num_free
    if need > available:
        raise CacheFullError(
            f"plan needs {need} blocks, only {available} of {pool.total_blocks} are free "
            f"(block_size {pool.block_size} tokens, {pool.block_bytes} bytes a block, "
            f"budget {pool.policy.max_bytes} bytes)"
        )
    version = pool._stamp()  # one stamp for the step: every row's metadata is new
    if rest:
        _release(pool, needs, version)
    if slow:
        _take(pool, [(names[i], news[i], recs[i] if i in grow else None) for i in slow], needs, need, max_blocks)
    if batch.generation < 0:  # records and rows made just now
        batch = table.rows_of(names, pool._seqs)
        recs = batch.records
    st = table.state
    batch.put(st.lens, ends)
    batch.put(st.version, (version,) * len(ends))
    if others:
        refs, refresh = pool.allocator._ref, pool._windows.refresh
        for i in others:
            refresh(recs[i], refs)
    table.flush()
    return StepRows(batch, news, olds, ends, longest, max_blocks, version, slow)

def _release(pool, needs: StepNeeds, version: int) -> None:
    """The step's out-of-window blocks back to the allocator (even if a shared allocator
    refuses the step's blocks below: their rows are stamped ``version`` here)."""
    for (ns, g), dead in needs.dead.items():
        seq = pool._seqs[ns]
        if dead.indices:
            blocks = seq.blocks[g]
            pool._drop(g, [blocks[j] for j in dead.indices])
            for j in dead.indices:
                blocks[j] = FREED
                pool._table.set_entry(g, seq.row, j, 0)
            seq.version = version
        seq.released[g] = dead.end

def _take(pool, items: list, needs: StepNeeds | None, need: int, max_blocks: int) -> None:
    """New namespaces, copy-on-write copies and new blocks (the lengths stay), row by row
    in the batch's order: ``items`` are ``(namespace, new tokens, grows)``, where
    ``grows`` is the record of a row :meth:`WindowRules.growing` found (one new block
    per group) and None for a row ``needs`` counted.

    Every block is taken in ONE allocator call before anything changes: the allocator
    may be shared with another pool on the same arena region (its own lock, not ours),
    so blocks counted free can be gone by now; a per-block alloc could then raise
    half-way through and leave the batch half applied."""
    alloc, bs, table = pool.allocator, pool.block_size, pool._table
    refs = alloc._ref
    fresh = iter(alloc.alloc(need))
    table.ensure_cols(max_blocks)
    copies_src: list[int] = []
    copies_dst: list[int] = []
    groups = range(pool._ngroups)
    pending, opened = table.pending, pool._windows.opened
    grown = 0
    for ns, n, grows in items:
        if grows is not None:
            col = len(grows.blocks[0])
            new = [next(fresh) for _ in groups]
            for g, b in zip(groups, new):
                grows.blocks[g].append(b)
                pending[(g, grows.row, col)] = b
            opened(grows, n, new)
            grown += 1
            continue
        seq = pool._seqs.get(ns)
        if seq is None:
            seq = pool._seqs[ns] = table.new_seq()
        old = seq.seq_len
        n_blocks = cdiv(old + n, bs)
        for g in groups if ns in needs.touched else ():
            blocks = seq.blocks[g]
            for j in range(old // bs, min(len(blocks), n_blocks)):
                b = blocks[j]
                if refs.get(b, 0) > 1:
                    nb = next(fresh)
                    pool._group_used[g] += 1
                    alloc.decref([b])  # shared: never frees
                    copies_src.append(b)
                    copies_dst.append(nb)
                    blocks[j] = nb
                    table.set_entry(g, seq.row, j, nb)
            start = len(blocks)
            if n_blocks > start:
                blocks.extend(next(fresh) for _ in range(n_blocks - start))
                pool._group_used[g] += n_blocks - start
                table.set_entries(seq, g, start)
    for g in groups if grown else ():
        pool._group_used[g] += grown
    if copies_src and pool._region is not None:
        src = upload(copies_src, torch.int64, pool.device)
        dst = upload(copies_dst, torch.int64, pool.device)
        pool._region.copy_blocks(src, dst)


def truncate_checked(pool, namespace, n_tokens) -> SeqRecord:
    """``namespace``'s record, after the checks of a truncate to ``n_tokens`` tokens."""
    seq = pool._get(namespace)
    if not is_int(n_tokens):
        raise TypeError(f"n_tokens: expected an int, got {n_tokens!r}")
    if not 0 <= n_tokens <= seq.seq_len:
        raise ValueError(f"n_tokens: expected 0 <= n_tokens <= seq_len ({seq.seq_len}), got {n_tokens}")
    pool._windows.check_truncate(seq, n_tokens)
    return seq


def truncate_blocks(pool, namespace, n_tokens: int) -> None:
    """Truncate the blocks ``pool`` holds of ``namespace`` to ``n_tokens`` tokens."""
    seq = truncate_checked(pool, namespace, n_tokens)
    keep = cdiv(n_tokens, pool.block_size)
    for g, blocks in enumerate(seq.blocks):
        if len(blocks) > keep:
            pool._drop(g, [b for b in blocks[keep:] if b != FREED])
            del blocks[keep:]
            seq.released[g] = min(seq.released[g], keep)
    seq.seq_len = n_tokens
    seq.version, seq.limit = pool._stamp(), 0


def fork_blocks(pool, src, dst) -> None:
    """``dst`` a new namespace sharing ``src``'s blocks of its tokens (by reference count)."""
    s = pool._get(src)
    if dst in pool._seqs:
        raise ValueError(f"dst: namespace {dst!r} already exists")
    n = cdiv(s.seq_len, pool.block_size)
    pool.allocator.incref([b for blocks in s.blocks for b in blocks[:n] if b != FREED])
    d = pool._table.new_seq()
    d.blocks = [list(blocks[:n]) for blocks in s.blocks]
    d.seq_len = s.seq_len
    d.released = [min(r, len(b)) for r, b in zip(s.released, d.blocks)]
    pool._seqs[dst] = d
    for g in range(pool._ngroups):
        pool._table.set_entries(d, g, 0)
    # src's outstanding metadata goes stale: its tokens not stored yet sit in blocks
    # now shared with dst, and dst's next plan may copy such a block (CoW) before
    # that forward writes them, leaving dst with garbage where src's last planned
    # tokens should be. Forward src's metadata first, then fork.
    s.version, s.limit = pool._stamp(), 0  # its blocks are shared now
