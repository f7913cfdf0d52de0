"""Boundary and regression cases of the KV pools and caches (kvarena/cache).

Regressions: metadata gone stale across fork / free / truncate, and plans that must be
all-or-nothing when another pool on the same arena region allocates (also from threads).
Boundaries the per-pool modules do not cover: a paged pool full mid-batch, slab batches
with a bad namespace, recycled windows, sinks/window combinations at flat memory, training
snapshots, and the dict caches' keys and accounting. The full internal state is compared
around every failing call: a call that raises must change nothing."""

from __future__ import annotations

import pytest
import torch
from _helpers import blob, one_torch_thread, run_threads  # noqa: F401 - autouse fixture

import kvarena.cache.slab.claim as slab_claim
from kvarena.cache._meta import StaleMetadataError
from kvarena.cache.arena import CacheFullError, KVArena, KVLayout, RegionSpec
from kvarena.cache.feature import FeatureCache
from kvarena.cache.handle import CacheHandle
from kvarena.cache.keys import CacheKey, CachePolicy, content_hash
from kvarena.cache.paged import PagedKVCache
from kvarena.cache.paged.table import BlockTable
from kvarena.cache.residual import ResidualCache
from kvarena.cache.slab import Slab, SlabKVCache

LAY = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
ST = 4  # slab tokens


def _paged(blocks=8, bs=2, **kw) -> PagedKVCache:
    return PagedKVCache(CachePolicy("paged_kv", LAY.block_bytes(bs) * blocks), layout=LAY, block_size=bs, **kw)


def _slab(slots=6, window=2, sinks=0, training=False) -> SlabKVCache:
    policy = CachePolicy(
        "slab_kv", LAY.block_bytes(ST) * slots, per_component={"window": window, "sinks": sinks},
        training_mode_disables_recycle=training,
    )
    return SlabKVCache(policy, layout=LAY, slab_tokens=ST)


def _current(p: PagedKVCache, meta) -> bool:
    try:
        p.check_metadata(meta)
    except StaleMetadataError:
        return False
    return True


def _paged_state(p: PagedKVCache, *metas) -> tuple:
    """The pool's public state, and whether each of ``metas`` is still current."""
    a = p.allocator
    groups = range(len(p.layout.layer_groups))
    return (
        {ns: ([p.block_ids(ns, g) for g in groups], p.seq_len(ns), p.table_row(ns)) for ns in p.namespaces()},
        a.state(), p.table.clone(), p.stats(), [_current(p, m) for m in metas],
        p.arena.buffer.clone(),  # bytes: NaN-safe
    )


def _slab_state(c: SlabKVCache) -> tuple:
    a = c.region.allocator
    return (
        {ns: c.rollout_info(ns) for ns in c.namespaces()},  # last chunk, version, each chunk's record
        a.state(), c.arena.buffer.clone(),  # bytes: NaN-safe
    )


def _same(x: tuple, y: tuple) -> bool:
    return all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(x, y, strict=True))


def _commit(c: SlabKVCache, meta) -> None:
    for layer in range(LAY.num_layers):
        shape = (meta.num_seqs, meta.n_tokens, 1, 8)
        c.forward(torch.randn(shape), torch.randn(shape), torch.randn(shape), meta, layer)


def _tok(n=1) -> torch.Tensor:
    return torch.randn(n, 1, 8)


# ---------------------------------------------------------------------------------------
# Regressions
def test_fork_between_plan_and_forward_makes_the_source_metadata_stale(monkeypatch) -> None:
    """Bug: plan(a) -> fork(a, f) -> plan(f) copied a's shared partial block (CoW) before
    forward(meta of a) stored a's planned token, so f attended to garbage at that position,
    silently (a's metadata stayed current). fork now makes src's metadata stale."""
    monkeypatch.setenv("KVARENA_DEBUG", "1")
    p = _paged()
    p.plan({"a": 2})
    m = p.plan({"a": 1})  # position 2 -> block 1, row 0 (partial)
    p.fork("a", "f")
    p.plan({"f": 1})  # CoW of block 1 at plan time
    with pytest.raises(StaleMetadataError, match="'a'.*forked"):
        p.forward(_tok(), _tok(), _tok(), m, 0)
    # The supported order: forward src's step first, then fork: the copy holds the token.
    p = _paged()
    p.plan({"a": 2})
    m = p.plan({"a": 1})
    k = _tok()
    for layer in range(2):
        p.forward(_tok(), k, k, m, layer)
    p.fork("a", "f")
    p.plan({"f": 1})
    fb, ab = p.block_ids("f")[1], p.block_ids("a")[1]
    assert fb != ab and torch.equal(p.region.k(0)[fb, 0], k[0])


def test_paged_plan_is_all_or_nothing_when_a_pool_on_the_same_region_allocates(monkeypatch) -> None:
    """Bug: plan checked the free count, then allocated block by block; another pool on the
    same arena region (its allocator is shared, its lock is not) could take blocks in
    between, and the per-block alloc raised CacheFullError half-way: 'x' was left created
    with no blocks. Blocks are now taken in one allocator call before any change."""
    arena = KVArena({"paged_kv": RegionSpec(LAY, 2, LAY.block_bytes(2) * 4)})
    a = PagedKVCache(CachePolicy("paged_kv", 0), arena=arena)
    b = PagedKVCache(CachePolicy("paged_kv", 0), arena=arena)
    a.plan({"y": 1})
    a.fork("y", "z")  # the next plan of z copies a shared partial block
    orig = BlockTable.ensure_cols

    def thief(self, n):  # the other pool allocating between the check and the apply
        if not b.namespaces():
            b.allocate("thief", 2)
        return orig(self, n)

    monkeypatch.setattr(BlockTable, "ensure_cols", thief)
    before = _paged_state(a)
    try:
        a.plan({"z": 1, "x": 3})  # 1 CoW + 2 new = 3 = every free block
    except CacheFullError:
        assert _same(before, _paged_state(a)) and "x" not in a
    else:  # the thief ran after the pool took its blocks: then IT must have failed
        assert a.seq_len("x") == 3 and b.namespaces() == []
    refs = [0] * 4
    for pool in (a, b):
        for ns in pool.namespaces():
            for blk in pool.block_ids(ns):
                refs[blk] += 1
    assert refs == [a.allocator.refcount(i) for i in range(4)]


def test_slab_plan_is_all_or_nothing_when_a_pool_on_the_same_region_allocates(monkeypatch) -> None:
    """Same race for SlabKVCache: 'p' got its slab, 'q' was left as an empty rollout."""
    c = SlabKVCache(CachePolicy("slab_kv", 0), arena=KVArena({"s": RegionSpec(LAY, ST, LAY.block_bytes(ST) * 2)}))
    thief = PagedKVCache(CachePolicy("paged_kv", 0), arena=c.arena)
    orig = slab_claim._Rollout

    class Racing(orig):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            if not thief.namespaces():
                thief.allocate("t", 1)

    monkeypatch.setattr(slab_claim, "_Rollout", Racing)
    before = _slab_state(c)
    try:
        c.plan({"p": 0, "q": 0})
    except CacheFullError:
        assert _same(before, _slab_state(c))
    else:
        assert c.chunk_indices("p") == c.chunk_indices("q") == [0] and thief.namespaces() == []
    for ns in c.namespaces():
        assert c.rollout_info(ns).chunks, "a rollout without chunks was left behind"


def test_two_pools_on_one_region_from_threads_keep_the_allocator_consistent() -> None:
    arena = KVArena({"paged_kv": RegionSpec(LAY, 2, LAY.block_bytes(2) * 24)})
    pools = [PagedKVCache(CachePolicy("paged_kv", 0), arena=arena) for _ in range(2)]

    def work(i: int) -> None:
        p = pools[i % 2]
        for step in range(60):
            ns = (i, step % 3)
            try:
                p.plan({ns: 1 + step % 3})
                if step % 5 == 0:
                    p.fork(ns, (i, "f", step))
            except CacheFullError:
                p.free_namespace(ns)
            if step % 7 == 0:
                for other in [x for x in p.namespaces() if x[0] == i and len(x) == 3]:
                    p.free_namespace(other)

    assert run_threads(work, 4) == []
    refs = [0] * arena["paged_kv"].num_blocks
    for p in pools:
        for ns in p.namespaces():
            for blk in p.block_ids(ns):
                refs[blk] += 1
    assert refs == [arena["paged_kv"].allocator.refcount(i) for i in range(len(refs))]


# ---------------------------------------------------------------------------------------
# Paged boundaries
def test_paged_cache_full_mid_batch_with_forks_changes_nothing() -> None:
    p = _paged(blocks=6)
    p.plan({"a": 3})
    p.fork("a", "f")
    p.fork("a", "g")  # block 1 (partial) has refcount 3
    before = _paged_state(p)
    with pytest.raises(CacheFullError):
        # f, g: one CoW each (a then writes in place), new: 4 blocks -> 6 > 4 free
        p.plan({"f": 1, "g": 1, "a": 1, "new": 7})
    assert _same(before, _paged_state(p)) and "new" not in p
    p.plan({"f": 1, "g": 1, "a": 1, "new": 3})  # 2 CoW + 2 new = 4: fits exactly
    assert p.free == 0 and p.block_ids("a")[1] not in (p.block_ids("f")[1], p.block_ids("g")[1])


def test_paged_free_forked_source_keeps_the_fork_and_accounting_exact() -> None:
    p = _paged()
    p.plan({"s": 3})
    p.fork("s", "f")
    blocks = p.block_ids("f")
    assert p.used_bytes == 2 * p.block_bytes  # shared blocks count once
    p.free_namespace("s")
    assert [p.allocator.refcount(b) for b in blocks] == [1, 1] and p.free == 6
    p.plan({"f": 1})  # sole owner now: writes in place, no copy
    assert p.block_ids("f") == blocks
    assert p.used_bytes + p.free_bytes == p.total_blocks * p.block_bytes
    p.free_namespace("f")
    p.free_namespace("f")  # unknown: no-op
    assert p.free == p.total_blocks and p.used_bytes == 0


def test_paged_truncate_to_zero_then_plan_and_forward(monkeypatch) -> None:
    monkeypatch.setenv("KVARENA_DEBUG", "1")
    p = _paged()
    m = p.plan({"a": 5})
    p.fork("a", "f")
    p.truncate("a", 0)
    assert p.seq_len("a") == 0 and p.block_ids("a") == [] and p.free == 5  # f keeps 3 blocks
    with pytest.raises(StaleMetadataError):
        p.forward(_tok(5), _tok(5), _tok(5), m, 0)
    m = p.plan({"a": 2})
    q, k, v = _tok(2), _tok(2), _tok(2)
    out = p.forward(q, k, v, m, 0)
    s = (q[:, 0] @ k[:, 0].T) * 8**-0.5
    s = s.masked_fill(torch.ones(2, 2).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(out[:, 0], torch.softmax(s, -1) @ v[:, 0])
    with pytest.raises(ValueError, match="n_tokens"):
        p.truncate("a", 3)
    with pytest.raises(KeyError):
        p.truncate("nope", 0)


def test_paged_plan_after_free_starts_fresh_and_old_metadata_is_stale(monkeypatch) -> None:
    monkeypatch.setenv("KVARENA_DEBUG", "1")
    p = _paged()
    m = p.plan({"a": 3})
    p.free_namespace("a")
    m2 = p.plan({"a": 1})
    assert m2.seq_lens.tolist() == [1] and p.seq_len("a") == 1
    with pytest.raises(StaleMetadataError, match="'a'"):
        p.forward(_tok(3), _tok(3), _tok(3), m, 0)


def test_paged_graph_metadata_goes_stale_on_every_rule(monkeypatch) -> None:
    monkeypatch.setenv("KVARENA_DEBUG", "1")
    p = _paged(graph_capacity=(2, 4))
    p.plan({"a": 2, "b": 2})
    m1 = p.plan({"a": 1, "b": 1}, graph=True)
    m2 = p.plan({"a": 1, "b": 1}, graph=True)
    with pytest.raises(StaleMetadataError, match="graph"):
        p.forward(_tok(2), _tok(2), _tok(2), m1, 0)
    p.forward(_tok(2), _tok(2), _tok(2), m2, 0)
    p.truncate("b", 3)
    with pytest.raises(StaleMetadataError, match="'b'"):
        p.forward(_tok(2), _tok(2), _tok(2), m2, 0)
    m3 = p.plan({"a": 1, "b": 1}, graph=True)
    before = _paged_state(p, m3)
    with pytest.raises(ValueError, match="max_batch"):
        p.plan({"a": 1, "b": 1, "c": 1}, graph=True)
    assert _same(before, _paged_state(p, m3)) and before[4] == [True]
    m4 = p.plan({"a": 8 - p.seq_len("a")})  # 4 full blocks: the graph capacity
    before = _paged_state(p, m4)
    with pytest.raises(ValueError, match="max_blocks"):
        p.plan({"a": 1}, graph=True)
    assert _same(before, _paged_state(p, m4)) and before[4] == [True]


# ---------------------------------------------------------------------------------------
# Slab boundaries
@pytest.mark.parametrize(
    "bad",
    [{"a": 2, "b": 5}, {"a": 2, "b": (2, 3)}, {"a": 2, "c": (0, 2)}, {"a": 2, "b": (2, 5)},
     {"a": 2, "b": (1, 3)}, {"a": 2, "b": "x"}, {"a": 2, "b": (2,)}, {"a": 2, "b": -1}],
    ids=["gap", "short-not-0", "mixed-T", "too-long", "replan-other-len", "type", "tuple-len", "neg"],
)
def test_slab_batch_with_one_bad_namespace_changes_nothing(bad) -> None:
    c = _slab()
    _commit(c, c.plan({"a": 0, "b": 0}))
    _commit(c, c.plan({"a": 1, "b": 1}))
    before = _slab_state(c)
    with pytest.raises((ValueError, TypeError), match=r"batch\['[bc]'\]"):
        c.plan(bad)
    assert _same(before, _slab_state(c))


def test_slab_replanning_a_chunk_whose_window_was_recycled_raises() -> None:
    c = _slab(window=2)
    for i in range(3):
        _commit(c, c.plan({"a": i}))  # chunk 2 recycled chunk 0's slab
    before = _slab_state(c)
    for old in (0, 1):
        with pytest.raises(ValueError, match="recycled"):
            c.plan({"a": old})
    assert _same(before, _slab_state(c))
    c.plan({"a": 2})  # still complete: allowed, nothing moves
    assert _same(before, _slab_state(c))


def test_slab_short_chunk_zero_with_a_full_one_raises_and_creates_nothing() -> None:
    c = _slab()
    with pytest.raises(ValueError, match="one T"):
        c.plan({"x": (0, 2), "y": 0})
    with pytest.raises(ValueError, match="one T"):
        c.plan({"y": 0, "x": (0, 2)})
    assert c.used_bytes == 0 and "x" not in c and "y" not in c


@pytest.mark.parametrize("sinks,window", [(0, 1), (1, 1), (2, 1), (3, 2), (2, 2)])
def test_slab_sinks_and_window_combinations_hold_flat_memory(sinks, window) -> None:
    c = _slab(slots=8, window=window, sinks=sinks)
    for i in range(8):
        m = c.plan({"a": i})
        held = {ch.index: ch for ch in c.rollout_info("a").chunks}
        vis = c.visible_chunks(i)
        assert vis == sorted(set(range(min(sinks, i + 1))) | set(range(max(0, i - window + 1), i + 1)))
        assert m.block_table[0].tolist() == [held[j].slot for j in vis]
        assert list(held) == list(range(min(sinks, i + 1))) + list(range(max(sinks, i - window + 1), i + 1))
        _commit(c, m)
    assert c.used_bytes == (sinks + window) * c.slab_bytes


def test_slab_training_mode_full_snapshot_restore() -> None:
    c = _slab(slots=3, window=1, training=True)
    _commit(c, c.plan({"a": 0}))
    snap = c.snapshot("a")
    _commit(c, c.plan({"a": 1}))
    _commit(c, c.plan({"a": 2}))
    before = _slab_state(c)
    with pytest.raises(CacheFullError):
        c.plan({"a": 3})  # never recycles in training mode
    assert _same(before, _slab_state(c))
    m = c.plan({"a": 2})  # re-plan (recompute): no new slab, window-1 visibility
    assert m.block_table.shape == (1, 1)
    c.restore("a", snap)
    assert c.chunk_indices("a") == [0] and c.used_bytes == c.slab_bytes
    with pytest.raises(StaleMetadataError):
        _commit(c, m)
    _commit(c, c.plan({"a": 1}))
    c.restore("a", snap)  # the same snapshot twice
    assert c.chunk_indices("a") == [0]


def test_slab_inference_restore_after_recycling_raises_and_changes_nothing() -> None:
    c = _slab(window=1)
    _commit(c, c.plan({"a": 0}))
    snap = c.snapshot("a")
    _commit(c, c.plan({"a": 1}))  # recycles chunk 0's slab
    before = _slab_state(c)
    with pytest.raises(ValueError, match="recycled"):
        c.restore("a", snap)
    assert _same(before, _slab_state(c))


def test_slab_cfg_namespaces_share_nothing_and_clear_during_live_metadata() -> None:
    c = _slab()
    m = c.plan({"v/cond": 0, "v/uncond": 0})
    _commit(c, m)
    slots = {ns: c.rollout_info(ns).chunks[0].slot for ns in ("v/cond", "v/uncond")}
    assert len(set(slots.values())) == 2
    m = c.plan({"v/cond": 1, "v/uncond": 1})
    c.clear_namespace("v/uncond")
    assert c.chunk_indices("v/cond") == [0, 1] and c.used_bytes == 2 * c.slab_bytes
    with pytest.raises(StaleMetadataError, match="v/uncond"):
        _commit(c, m)
    c.plan({"v/uncond": 0})  # re-created: a new rollout, the old metadata stays stale
    with pytest.raises(StaleMetadataError):
        _commit(c, m)
    c.clear_namespace("never")


def test_slab_seed_append_get_mixed_with_plan_forward() -> None:
    c = _slab(slots=6, window=2, sinks=1)
    ks = {}
    for i in range(4):
        ks[i] = torch.randn(2, ST, 1, 8)
        c.append("a", Slab(i, ks[i], -ks[i]))
    m = c.plan({"a": 4})
    kk = torch.randn(1, ST, 1, 8)
    for layer in range(2):
        c.forward(torch.randn(1, ST, 1, 8), kk, kk, m, layer)
    got = c.get("a")
    assert [s.chunk_index for s in got] == [0, 3, 4]  # sinks, then oldest -> newest
    base = c.arena.buffer.untyped_storage().data_ptr()
    for s in got:
        assert s.k.untyped_storage().data_ptr() == base and s.v.untyped_storage().data_ptr() == base
    assert torch.equal(got[0].k, ks[0]) and torch.equal(got[1].v, -ks[3])
    assert torch.equal(got[2].k[0], kk[0]) and torch.equal(got[2].k[1], kk[0])
    m = c.plan({"a": 5})  # planned, committed at no layer: not returned by get
    assert [s.chunk_index for s in c.get("a")] == [0, 4]
    assert c.get("unknown") == []


def test_slab_short_first_chunk_through_append_is_right_aligned() -> None:
    c = SlabKVCache(CachePolicy("slab_kv", LAY.block_bytes(ST) * 3, per_component={"slab_tokens": ST, "window": 2}))
    k0 = torch.randn(2, 2, 1, 8)
    c.append("a", Slab(0, k0, k0))
    (s,) = c.get("a")
    assert s.k.shape == (2, 2, 1, 8) and torch.equal(s.k, k0)
    with pytest.raises(ValueError, match="only chunk 0"):
        c.append("a", Slab(1, k0, k0))
    m = c.plan({"a": 1})
    assert m.kv_start.tolist() == [ST - 2] and m.has_kv_start


# ---------------------------------------------------------------------------------------
# Dict caches and keys
def test_content_hash_tensor_edge_cases() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert content_hash(x.t()) == content_hash(x.t().contiguous()) != content_hash(x)
    assert content_hash(x[:, ::2].bfloat16()) == content_hash(x[:, ::2].contiguous().bfloat16())
    assert content_hash(x.bfloat16()) != content_hash(x.half())
    assert content_hash(torch.tensor(1.0)) != content_hash(torch.tensor([1.0]))
    empties = [torch.empty(0, 3), torch.empty(3, 0), torch.empty(0, 3, dtype=torch.bfloat16), torch.empty(0)]
    assert len({content_hash(t) for t in empties}) == 4
    assert content_hash(torch.ones(1, 3).expand(4, 3)) == content_hash(torch.ones(4, 3))
    y = torch.tensor([1 + 2j, 3 - 1j])
    assert content_hash(y.conj()) == content_hash(y.conj().resolve_conj())
    assert content_hash(torch.ones(2, requires_grad=True)) == content_hash(torch.ones(2))
    for bad in (object(), {1, 2}, torch.nn.Linear(1, 1)):
        with pytest.raises(TypeError):
            content_hash(bad)


def test_feature_cache_lru_and_invalidation_accounting_are_exact() -> None:
    def key(i, comp="te", w="1"):
        return CacheKey(comp, f"h{i}", w)

    f = FeatureCache(CachePolicy("feature", 30))
    for i in range(3):
        f.put(key(i), blob(10))
    f.get(key(0))
    f.put(key(3), blob(10))
    assert [k.content_hash for k in f.keys()] == ["h2", "h0", "h3"] and f.evictions == 1  # noqa: SIM118
    f.put(key(4), blob(25))
    assert [k.content_hash for k in f.keys()] == ["h4"] and f.used_bytes == 25 and f.evictions == 4  # noqa: SIM118
    assert f.put(key(5), blob(31)) is False and f.used_bytes == 25 and f.rejected == 1
    f.put(key(4), blob(5))
    assert f.used_bytes == 5 and f.evictions == 4  # a replacement is not an eviction
    f.put(key(6, "vae", "2"), blob(5))
    f.put(key(7, "te", "2"), blob(5))
    assert f.invalidate_weights("2") == 1 and f.used_bytes == 10
    assert f.invalidate_components({"vae"}) == 1 and f.used_bytes == 5 and len(f) == 1
    before = f.stats()

    def boom():
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        f.get_or_compute(key(9), boom)
    assert f.stats() == {**before, "misses": before["misses"] + 1} and key(9) not in f


def test_residual_cfg_branches_and_handle_end_request() -> None:
    h = CacheHandle([CachePolicy("residual", 24), CachePolicy("feature", 100)])
    r = h.residual
    assert isinstance(r, ResidualCache)
    a, b = blob(8), blob(8)
    r.put("req", "cond", "x", a)
    r.put("req", "uncond", "x", b)
    assert r.get("req", "cond", "x") is a and r.get("req", "uncond", "x") is b
    r.put("other", "cond", "x", blob(8))
    h.end_request("req")
    assert r.keys() == [("other", "cond", "x")] and r.used_bytes == 8
    h.end_request("req")  # unknown now: no-op
