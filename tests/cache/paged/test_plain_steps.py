"""The plain-append path of ``PagedKVCache.plan``: a row whose new tokens end inside the
block it is filling (unshared, nothing leaving a window) only grows, the others are
decided in full. The reference is the same pool with that path switched off (every row
decided in full), driven by the same operations: metadata, block lists, the table and the
allocator must agree at every step.
"""

from __future__ import annotations

import random

import pytest
import torch
from _helpers import one_torch_thread  # noqa: F401 - autouse fixture

from kvarena import AttentionSpec, CacheFullError, CachePolicy, KVLayout, PagedKVCache
from kvarena.cache._meta import StaleMetadataError
from kvarena.cache.arena import group_layers

BS = 4


def _pool(*, groups: bool, blocks: int = 400, rollback: int = 0, graph=None, full: bool = False) -> PagedKVCache:
    windows = (5, None, 9) if groups else (None, None)
    lay = KVLayout(num_layers=3 if groups else 2, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                   groups=group_layers(windows) if groups else None)
    pool = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(BS) * blocks), layout=lay, block_size=BS,
                        attention=[AttentionSpec(window_left=w, sink_tokens=1 if w else 0) for w in windows],
                        free_out_of_window=groups, rollback_tokens=rollback, graph_capacity=graph)
    if full:
        pool._windows.refresh = lambda seq, refs: None  # no row is ever a plain append
        pool._windows.growing = lambda slow, *rows: (frozenset(), slow)  # nor a bulk page crossing
    return pool


def _state(pool: PagedKVCache) -> tuple:
    groups = len(pool.group_used_blocks)
    names = pool.namespaces()
    return (names, [pool.seq_len(ns) for ns in names],
            [[pool.block_ids(ns, g) for g in range(groups)] for ns in names],
            pool.allocator.state(), pool.group_used_blocks)


def _same_meta(a, b) -> None:
    assert a.namespaces == b.namespaces and a.total_q == b.total_q and a.max_seqlen_k == b.max_seqlen_k
    for x, y in zip(a.slot_mappings + a.block_tables, b.slot_mappings + b.block_tables):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert torch.equal(a.seq_lens, b.seq_lens) and torch.equal(a.cu_seqlens_q, b.cu_seqlens_q)


def _table_rows(pool: PagedKVCache) -> list:
    return [pool.table[:, pool.table_row(ns)].tolist() for ns in pool.namespaces()]


@pytest.mark.parametrize("groups", [False, True], ids=["one group", "layer groups, release"])
def test_plain_path_equals_the_full_plan_under_random_operations(groups):
    fast, ref = _pool(groups=groups, rollback=2 if groups else 0), _pool(groups=groups, rollback=2 if groups else 0,
                                                                          full=True)
    rnd = random.Random(7)
    live = [f"s{i}" for i in range(6)]
    for pool in (fast, ref):
        pool.plan({ns: 1 + i for i, ns in enumerate(live)})  # staggered lengths
    made = len(live)
    lens = {ns: 1 + i for i, ns in enumerate(live)}  # an independent model of the lengths
    for step in range(160):
        op = rnd.random()
        if op < 0.06 and len(live) < 10:
            src, dst = rnd.choice(live), f"s{made}"
            made += 1
            for pool in (fast, ref):
                pool.fork(src, dst)
            live.append(dst)
            lens[dst] = lens[src]
        elif op < 0.10:
            ns = rnd.choice(live)
            n = max(0, fast.seq_len(ns) - rnd.randint(0, 3))
            try:
                fast.check_truncate(ns, n)
            except ValueError:
                continue
            for pool in (fast, ref):
                pool.truncate(ns, n)
            lens[ns] = n
        elif op < 0.12 and len(live) > 3:
            ns = live.pop(rnd.randrange(len(live)))
            for pool in (fast, ref):
                pool.free_namespace(ns)
            del lens[ns]
        elif op < 0.14:
            ns = rnd.choice(live)
            assert fast.allocate(ns, 1) == ref.allocate(ns, 1)
        else:
            batch = {ns: (1 if rnd.random() < 0.85 else rnd.randint(1, 6)) for ns in live if rnd.random() < 0.9}
            if not batch:
                continue
            m_fast, m_ref = fast.plan(batch), ref.plan(batch)
            for ns, n in batch.items():
                lens[ns] += n
            assert m_fast.seq_lens.tolist() == [lens[ns] for ns in batch], step
            _same_meta(m_fast, m_ref)
            fast.check_metadata(m_fast)
        assert [fast.seq_len(ns) for ns in live] == [lens[ns] for ns in live], step
        assert _state(fast) == _state(ref), step
        assert _table_rows(fast) == _table_rows(ref), step


def test_a_decode_step_where_only_some_rows_cross_a_block():
    pool = _pool(groups=False)
    names = [f"s{i}" for i in range(8)]
    pool.plan({ns: 1 + i for i, ns in enumerate(names)})  # lengths 1..8
    pool.plan(dict.fromkeys(names, 1))  # every row's limit is known now
    for _ in range(9):
        olds = [pool.seq_len(ns) for ns in names]
        used = pool.allocator.num_used
        meta = pool.plan(dict.fromkeys(names, 1))
        crossing = sum(1 for o in olds if o % BS == 0)
        assert crossing and pool.allocator.num_used == used + crossing  # one block a crossing row
        want = [pool.block_ids(ns)[o // BS] * BS + o % BS for ns, o in zip(names, olds)]
        assert meta.slot_mapping.tolist() == want
        assert meta.seq_lens.tolist() == [o + 1 for o in olds]
        for b, ns in enumerate(names):
            ids = pool.block_ids(ns)
            assert meta.block_table[b, : len(ids)].tolist() == ids


@pytest.mark.parametrize("step_tokens", [1, 3, BS], ids=["decode", "3 tokens", "a whole block"])
def test_page_crossings_in_every_layer_group(step_tokens):
    """Layer groups that release nothing: rows crossing a block boundary take one new block
    per group in bulk. Their blocks, slots, table rows and the per-group counts read as an
    independent model says; a step that fills its new block leaves the next one to take
    another."""
    lay = KVLayout(num_layers=3, num_kv_heads=1, head_dim=8, dtype=torch.float32, groups=group_layers((5, None, 9)))
    pool = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(BS) * 200), layout=lay, block_size=BS)
    groups = len(pool.group_used_blocks)
    names = [f"s{i}" for i in range(5)]
    pool.plan({ns: 1 + i for i, ns in enumerate(names)})  # lengths 1..5: rows cross at different steps
    model = {ns: [[] for _ in range(groups)] for ns in names}  # the block ids seen so far per group
    for ns in names:
        for g in range(groups):
            model[ns][g] = pool.block_ids(ns, g)
    for _ in range(7):
        olds = [pool.seq_len(ns) for ns in names]
        used = pool.allocator.num_used
        meta = pool.plan(dict.fromkeys(names, step_tokens))
        opened = 0
        for b, (ns, o) in enumerate(zip(names, olds)):
            n_new = -(-(o + step_tokens) // BS) - -(-o // BS)
            opened += n_new
            for g in range(groups):
                ids = pool.block_ids(ns, g)
                assert ids[: len(model[ns][g])] == model[ns][g] and len(ids) == len(model[ns][g]) + n_new, (ns, g)
                model[ns][g] = ids
                assert meta.block_tables[g][b, : len(ids)].tolist() == ids
        assert pool.allocator.num_used == used + opened * groups
        assert pool.group_used_blocks == tuple(sum(len(model[ns][g]) for ns in names) for g in range(groups))
        for g in range(groups):
            want = [model[ns][g][p // BS] * BS + p % BS for ns, o in zip(names, olds) for p in range(o, o + step_tokens)]
            assert meta.slot_mappings[g].tolist() == want, g
        assert meta.seq_lens.tolist() == [o + step_tokens for o in olds]
        pool.check_metadata(meta)


@pytest.mark.parametrize("order", ["creation order", "reversed", "a subset out of order"])
def test_a_decode_step_in_any_row_order_reads_each_namespaces_blocks(order):
    """Rows planned in the order they were made take the fast table view; any other order
    gathers the table. Both must give row b its namespace's blocks, length and slot."""
    names = [f"s{i}" for i in range(7)]
    pick = {"creation order": names, "reversed": names[::-1], "a subset out of order": names[5:1:-2] + names[:1]}
    pool = _pool(groups=True)
    pool.plan({ns: 2 + 3 * i for i, ns in enumerate(names)})
    for _ in range(2 * BS + 1):  # across block ends and window releases
        batch = dict.fromkeys(pick[order], 1)
        olds = [pool.seq_len(ns) for ns in batch]
        meta = pool.plan(batch)
        assert meta.seq_lens.tolist() == [o + 1 for o in olds]
        for g in range(3):
            for b, (ns, old) in enumerate(zip(batch, olds)):
                ids = pool.block_ids(ns, g)
                assert meta.block_tables[g][b, : len(ids)].tolist() == [max(i, 0) for i in ids], (ns, g)
                assert meta.slot_mappings[g][b].item() == ids[old // BS] * BS + old % BS, (ns, g)


def test_metadata_of_other_namespaces_outlives_later_plans():
    """A plan's block table may be a view of the pool's table: later plans of OTHER
    namespaces (new blocks, window releases, new rows and columns, frees) must not change
    what it reads."""
    pool = _pool(groups=True, blocks=2000)
    first = [f"a{i}" for i in range(3)]
    pool.plan({ns: 5 + i for i, ns in enumerate(first)})
    meta = pool.plan(dict.fromkeys(first, 1))
    tables, lens = [t.clone() for t in meta.block_tables], meta.seq_lens.clone()
    for step in range(40):  # others grow past the table's rows and columns, release, are freed
        batch = {f"b{i}": 1 + 3 * (step % 4) for i in range(step % 7 + 1)}
        pool.plan(batch)
        if step % 9 == 8:
            pool.free_namespace(f"b{step % 5}")
    assert pool.table.shape[1] > 3 and pool.table.shape[2] > tables[0].shape[1]
    pool.check_metadata(meta)  # still current
    assert all(torch.equal(t, c) for t, c in zip(meta.block_tables, tables)) and torch.equal(meta.seq_lens, lens)


def test_fork_makes_the_next_append_copy_the_shared_last_block():
    pool = _pool(groups=False)
    pool.plan({"a": 5})
    pool.plan({"a": 1})  # "a" appends plainly now: its block 1 is its own
    pool.region.data[pool.block_ids("a")[1]] = 3.0
    pool.fork("a", "b")
    shared = pool.block_ids("a")[1]
    assert pool.allocator.refcount(shared) == 2
    meta = pool.plan({"a": 1})  # looks plain (tokens fit block 1) but the block is shared
    own = pool.block_ids("a")[1]
    assert own != shared and pool.block_ids("b")[1] == shared
    assert pool.allocator.refcount(shared) == 1 and pool.allocator.refcount(own) == 1
    assert torch.equal(pool.region.data[own], pool.region.data[shared])  # copied before the write
    assert meta.slot_mapping.tolist() == [own * BS + 2]
    meta = pool.plan({"b": 1})  # the source's block is b's alone now: no copy
    assert pool.block_ids("b")[1] == shared and meta.slot_mapping.tolist() == [shared * BS + 2]


def test_truncate_into_a_shared_block_copies_at_the_next_append():
    pool = _pool(groups=False)
    pool.plan({"a": 8})
    pool.plan({"a": 1})
    pool.fork("a", "b")
    pool.truncate("a", 6)  # back into block 1, shared with "b"
    shared = pool.block_ids("b")[1]
    pool.plan({"a": 1})
    assert pool.block_ids("a")[1] != shared and pool.allocator.refcount(shared) == 1


def test_allocated_blocks_serve_the_next_appends():
    pool = _pool(groups=False)
    pool.plan({"a": 3})
    pool.plan({"a": 1})
    assert pool.allocate("a", 2)
    ids, used = pool.block_ids("a"), pool.allocator.num_used
    for _ in range(3 * BS - 4):  # up to the end of the reserved blocks
        pool.plan({"a": 1})
    assert pool.block_ids("a") == ids and pool.allocator.num_used == used


def test_a_plan_that_fails_changes_nothing():
    pool = _pool(groups=False, blocks=12, graph=(8, 4))
    names = [f"s{i}" for i in range(4)]
    pool.plan({ns: 2 + i for i, ns in enumerate(names)})
    pool.plan({names[3]: 10})
    meta = pool.plan(dict.fromkeys(names, 1))  # lengths 3, 4, 5, 16: 8 blocks, 4 free
    before, table = _state(pool), pool.table.clone()
    # A batch whose last row needs more blocks than are free: the plain rows before it
    # must not grow.
    with pytest.raises(CacheFullError):
        pool.plan({**dict.fromkeys(names, 1), "big": 5 * BS})
    with pytest.raises(ValueError, match="graph_capacity max_blocks"):
        pool.plan(dict.fromkeys(names, 1), graph=True)  # the last row would need 5 blocks
    with pytest.raises(TypeError):
        pool.plan({**dict.fromkeys(names, 1), "bad": 1.0})
    assert _state(pool) == before and torch.equal(pool.table, table)
    pool.check_metadata(meta)  # still current: nothing was planned
    again = pool.plan(dict.fromkeys(names, 1))
    assert again.seq_lens.tolist() == [p + 1 for p in meta.seq_lens.tolist()]


def test_plain_steps_keep_metadata_staleness():
    pool = _pool(groups=False)
    pool.plan({"a": 2, "b": 2})
    pool.plan({"a": 1, "b": 1})
    m_a = pool.plan({"a": 1})
    m_b = pool.plan({"b": 1})  # a plain step of another namespace: m_a stays current
    pool.check_metadata(m_a)
    pool.check_metadata(m_b)
    pool.plan({"a": 1})
    with pytest.raises(StaleMetadataError, match="'a'"):
        pool.check_metadata(m_a)
    pool.check_metadata(m_b)
    m_b2 = pool.plan({"b": 1})
    pool.fork("b", "c")
    with pytest.raises(StaleMetadataError):
        pool.check_metadata(m_b2)


@pytest.mark.parametrize("graph", [False, True])
def test_graph_and_padded_plans_on_plain_rows_equal_the_full_plan(graph):
    kw = dict(groups=True, graph=(4, 8))
    fast, ref = _pool(**kw), _pool(**kw, full=True)
    names = ["a", "b", "c"]
    for pool in (fast, ref):
        pool.plan({"a": 3, "b": 6, "c": 9})
    for step in range(14):
        batch = dict.fromkeys(names, 1)
        if graph:
            m_fast, m_ref = fast.plan(batch, graph=True), ref.plan(batch, graph=True)
        else:
            m_fast, m_ref = fast.plan(batch, pad_to=2), ref.plan(batch, pad_to=2)
        _same_meta(m_fast, m_ref)
        assert _state(fast) == _state(ref), step
