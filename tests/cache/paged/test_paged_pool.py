"""PagedKVCache: seed API, plan/forward against dense attention, fork + copy-on-write,
truncate, all-or-nothing planning, stale/foreign metadata, CUDA-graph buffers, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import DEVICE, GPU, assert_close, device_for, gpu_test, one_torch_thread, run_threads  # noqa: F401
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvarena.attention.spec import AttentionSpec
from kvarena.cache._meta import StaleMetadataError
from kvarena.cache.arena import CacheFullError, KVArena, KVLayout, RegionSpec
from kvarena.cache.keys import CachePolicy
from kvarena.cache.paged import PagedKVCache, PagedMetadata

H_Q = 4


def _layout(dtype=torch.float32, layers=2) -> KVLayout:
    return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=16, dtype=dtype)


def _cache(blocks=32, block_size=4, dtype=torch.float32, **kw) -> PagedKVCache:
    lay = _layout(dtype)
    policy = CachePolicy("paged_kv", lay.block_bytes(block_size) * blocks)
    return PagedKVCache(policy, layout=lay, block_size=block_size, **kw)


def dense_causal(q, k, v, *, window_left=None, softcap=None):
    """fp64 attention of ``q [n, H_q, D]`` at the last n positions over ``k, v [L, H_kv, D]``."""
    n, h_q, d = q.shape
    length, h_kv, _ = k.shape
    g = h_q // h_kv
    qd = q.double()
    kd = k.double().repeat_interleave(g, dim=1)
    vd = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) * d**-0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(length - n, length)[:, None]
    kpos = torch.arange(length)[None, :]
    vis = kpos <= qpos
    if window_left is not None:
        vis &= kpos >= qpos - window_left
    s = s.masked_fill(~vis, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vd)


class History:
    """The test's own copy of every request's K/V per layer."""

    def __init__(self, layers: int) -> None:
        self.k: dict = {}
        self.v: dict = {}
        self.layers = layers

    def append(self, ns, layer, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        key = (ns, layer)
        self.k[key] = torch.cat([self.k.get(key, k[:0]), k])
        self.v[key] = torch.cat([self.v.get(key, v[:0]), v])
        return self.k[key], self.v[key]

    def fork(self, src, dst) -> None:
        for layer in range(self.layers):
            self.k[(dst, layer)] = self.k[(src, layer)].clone()
            self.v[(dst, layer)] = self.v[(src, layer)].clone()

    def truncate(self, ns, n) -> None:
        for layer in range(self.layers):
            self.k[(ns, layer)] = self.k[(ns, layer)][:n]
            self.v[(ns, layer)] = self.v[(ns, layer)][:n]


def run_step(cache: PagedKVCache, hist: History, batch: dict, dtype, what: str, backend="auto", **attn) -> PagedMetadata:
    """plan + forward at every layer, each request's rows checked against dense attention."""
    meta = cache.plan(batch)
    lay = cache.layout
    for layer in range(lay.num_layers):
        n = meta.total_q
        q = torch.randn(n, H_Q, lay.head_dim).to(dtype)
        k = torch.randn(n, lay.num_kv_heads, lay.head_dim).to(dtype)
        v = torch.randn(n, lay.num_kv_heads, lay.head_dim).to(dtype)
        out = cache.forward(q.to(cache.device), k.to(cache.device), v.to(cache.device), meta, layer, backend=backend,
                            **attn)
        start = 0
        for ns, cnt in batch.items():
            rows = slice(start, start + cnt)
            kh, vh = hist.append(ns, layer, k[rows], v[rows])
            ref = dense_causal(q[rows], kh, vh, **attn)
            assert_close(out[rows], ref, dtype, f"{what}: {ns!r} layer {layer} (seq_len {kh.shape[0]})")
            start += cnt
    return meta


# ---------------------------------------------------------------------------------------
# seed API
def test_seed_api_allocate_and_free() -> None:
    cache = PagedKVCache(CachePolicy("paged_kv", max_bytes=1000, block_bytes=100))
    assert cache.total_blocks == 10 and cache.free == 10 and cache.used_bytes == 0
    assert cache.allocate("a", 0) is True and "a" not in cache
    assert cache.allocate("a", 4) is True
    assert cache.allocate("b", 7) is False and "b" not in cache and cache.free == 6
    assert cache.allocate("a", 2) is True
    assert cache.free == 4 and cache.used_bytes == 600 and cache.free_bytes == 400
    with pytest.raises(ValueError, match="n_blocks"):
        cache.allocate("a", -3)
    assert cache.free == 4  # the seed bug: a negative count grew `free`
    cache.free_namespace("nobody")
    cache.free_namespace("a")
    assert cache.free == 10 and cache.hits == 0 and cache.misses == 0


def test_bookkeeping_only_pool_plans_but_cannot_forward() -> None:
    cache = PagedKVCache(CachePolicy("paged_kv", max_bytes=1000, block_bytes=100), block_size=4)
    meta = cache.plan({"a": 6})
    assert meta.seq_lens.tolist() == [6] and cache.free == 8
    with pytest.raises(RuntimeError, match="layout"):
        cache.forward(torch.zeros(6, 2, 8), torch.zeros(6, 1, 8), torch.zeros(6, 1, 8), meta, 0)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        pytest.param(dict(), ValueError, "block_bytes", id="no-layout-no-block-bytes"),
        pytest.param(dict(layout=_layout(), block_bytes=123), ValueError, "block_bytes", id="block-bytes-mismatch"),
        pytest.param(dict(layout="x"), TypeError, "layout", id="layout-type"),
        pytest.param(dict(layout=_layout(), block_size=0), ValueError, "block_size", id="block-size-0"),
        pytest.param(dict(layout=_layout(), region="r"), ValueError, "region", id="region-without-arena"),
        pytest.param(dict(layout=_layout(), graph_capacity=(2,)), TypeError, "graph_capacity", id="graph-capacity"),
    ],
)
def test_constructor_errors(kwargs: dict, exc: type, match: str) -> None:
    bb = kwargs.pop("block_bytes", 0)
    with pytest.raises(exc, match=match):
        PagedKVCache(CachePolicy("paged_kv", 10_000, block_bytes=bb), **kwargs)


def test_block_bytes_derived_or_equal() -> None:
    lay = _layout()
    cache = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(8) * 5 + 1, block_bytes=lay.block_bytes(8)), layout=lay, block_size=8)
    assert cache.total_blocks == 5 and cache.block_bytes == lay.block_bytes(8)


def test_shared_arena_regions() -> None:
    lay, other = _layout(), KVLayout(1, 1, 8, torch.float32)
    arena = KVArena({"slab_kv": RegionSpec(other, 5, 4096), "paged_kv": RegionSpec(lay, 4, lay.block_bytes(4) * 6)})
    cache = PagedKVCache(CachePolicy("paged_kv", 0), arena=arena)
    assert cache.total_blocks == 6 and cache.block_size == 4 and cache.layout == lay
    assert cache.allocator is arena["paged_kv"].allocator
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(CachePolicy("paged_kv", 0), arena=arena, block_size=8)
    with pytest.raises(ValueError, match="layout"):
        PagedKVCache(CachePolicy("paged_kv", 0), arena=arena, layout=other)
    with pytest.raises(KeyError, match="nope"):
        PagedKVCache(CachePolicy("paged_kv", 0), arena=arena, region="nope")
    with pytest.raises(ValueError, match="region"):
        PagedKVCache(CachePolicy("paged_kv", 0), arena=KVArena({"x": RegionSpec(lay, 4, 0), "y": RegionSpec(lay, 4, 0)}))


# ---------------------------------------------------------------------------------------
# plan / forward vs dense attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_chunked_prefill_then_decode_matches_dense(seed, dtype) -> None:
    cache = _cache(dtype=dtype)
    hist = History(2)
    run_step(cache, hist, {"a": 7, "b": 3, "c": 5}, dtype, "prefill 1")
    run_step(cache, hist, {"c": 2, "a": 6}, dtype, "prefill 2")
    for step in range(5):
        meta = run_step(cache, hist, {"b": 1, "a": 1, "c": 1}, dtype, f"decode {step}")
        assert meta.namespaces == ("b", "a", "c")
    assert [cache.seq_len(ns) for ns in "abc"] == [18, 8, 12]
    assert cache.free == cache.total_blocks - sum(math.ceil(n / 4) for n in (18, 8, 12))


@pytest.mark.parametrize(
    "attn", [dict(window_left=3), dict(softcap=2.0), dict(window_left=0, softcap=5.0)], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items())
)
def test_attention_kwargs_pass_through(seed, attn) -> None:
    cache = _cache()
    hist = History(2)
    run_step(cache, hist, {"a": 9, "b": 2}, torch.float32, "prefill", **attn)
    run_step(cache, hist, {"a": 1, "b": 1}, torch.float32, "decode", **attn)


def test_metadata_contents_and_incremental_table(seed) -> None:
    cache = _cache(blocks=16, block_size=4)
    meta = cache.plan({"a": 5, "b": 2})
    a, b = cache.block_ids("a"), cache.block_ids("b")
    assert meta.slot_mapping.tolist() == [a[0] * 4 + i for i in range(4)] + [a[1] * 4, b[0] * 4, b[0] * 4 + 1]
    assert meta.block_table[0].tolist() == a and meta.block_table[1, 0].item() == b[0]
    assert meta.seq_lens.tolist() == [5, 2] and meta.cu_seqlens_q.tolist() == [0, 5, 7]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.total_q, meta.num_seqs) == (5, 5, 7, 2)
    assert meta.block_table.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int32
    table_ptr = cache.table.data_ptr()
    for _ in range(6):
        cache.plan({"a": 1, "b": 1})
        for ns in ("a", "b"):  # changed entries flushed at plan
            assert cache.table[0, cache.table_row(ns), : len(cache.block_ids(ns))].tolist() == cache.block_ids(ns)
    assert cache.table.data_ptr() == table_ptr, "the persistent block table was re-allocated"


def test_table_grows_by_doubling(seed) -> None:
    cache = _cache(blocks=40, max_seqs=1, max_blocks_per_seq=1)
    hist = History(2)
    run_step(cache, hist, {"a": 9, "b": 5, "c": 1}, torch.float32, "grown")
    assert cache.table.shape[1] >= 3 and cache.table.shape[2] >= 3
    run_step(cache, hist, {"c": 1, "b": 1, "a": 1}, torch.float32, "after growth")


# ---------------------------------------------------------------------------------------
# fork / copy-on-write / truncate
def test_fork_shares_blocks_and_copy_on_write_keeps_source(seed) -> None:
    cache = _cache(block_size=4)
    hist = History(2)
    run_step(cache, hist, {"a": 6}, torch.float32, "prefill")
    cache.fork("a", "b")
    hist.fork("a", "b")
    shared = cache.block_ids("a")
    assert cache.block_ids("b") == shared and cache.seq_len("b") == 6
    assert all(cache.allocator.refcount(x) == 2 for x in shared)
    src_bytes = cache.region.data[shared].clone()
    run_step(cache, hist, {"b": 1}, torch.float32, "fork appends")
    b_blocks = cache.block_ids("b")
    assert b_blocks[0] == shared[0] and b_blocks[1] != shared[1], "partial shared block not copied"
    assert cache.allocator.refcount(shared[1]) == 1 and cache.allocator.refcount(shared[0]) == 2
    assert torch.equal(cache.region.data[shared].view(-1).nan_to_num(7.0), src_bytes.view(-1).nan_to_num(7.0)), "CoW changed the source's data"
    run_step(cache, hist, {"a": 3, "b": 2}, torch.float32, "both append")
    assert cache.block_ids("a")[1] == shared[1]  # a owned it alone by then: written in place
    with pytest.raises(KeyError, match="zz"):
        cache.fork("zz", "c")
    with pytest.raises(ValueError, match="dst"):
        cache.fork("a", "b")


def test_truncate_rolls_back_and_frees(seed) -> None:
    cache = _cache(block_size=4)
    hist = History(2)
    run_step(cache, hist, {"a": 10}, torch.float32, "prefill")
    free_before = cache.free
    cache.truncate("a", 5)
    hist.truncate("a", 5)
    assert cache.seq_len("a") == 5 and len(cache.block_ids("a")) == 2 and cache.free == free_before + 1
    run_step(cache, hist, {"a": 2}, torch.float32, "after truncate")
    cache.truncate("a", 0)
    assert cache.block_ids("a") == [] and cache.free == cache.total_blocks
    with pytest.raises(ValueError, match="n_tokens"):
        cache.truncate("a", 1)
    with pytest.raises(KeyError):
        cache.truncate("nobody", 0)
    with pytest.raises(KeyError):
        cache.seq_len("nobody")


def test_truncate_into_a_shared_full_block_copies_on_write(seed) -> None:
    cache = _cache(block_size=4)
    hist = History(2)
    run_step(cache, hist, {"a": 8}, torch.float32, "prefill")
    cache.fork("a", "b")
    hist.fork("a", "b")
    cache.truncate("a", 6)
    hist.truncate("a", 6)
    run_step(cache, hist, {"a": 1}, torch.float32, "rewrite after truncate")
    assert cache.block_ids("a")[1] != cache.block_ids("b")[1]
    run_step(cache, hist, {"b": 1}, torch.float32, "fork intact")


def test_reserved_blocks_are_used_first(seed) -> None:
    cache = _cache(blocks=8, block_size=4)
    assert cache.allocate("a", 3)
    reserved = cache.block_ids("a")
    hist = History(2)
    run_step(cache, hist, {"a": 9}, torch.float32, "into reserved blocks")
    assert cache.block_ids("a") == reserved and cache.free == 5


# ---------------------------------------------------------------------------------------
# all-or-nothing / metadata identity / staleness
def _state(cache: PagedKVCache):
    return (
        {ns: (cache.block_ids(ns), cache.seq_len(ns)) for ns in cache.namespaces()},
        cache.free,
        [cache.allocator.refcount(b) for b in range(cache.total_blocks)],
        cache.table.clone(),
    )


def _same(s1, s2) -> bool:
    return s1[:3] == s2[:3] and torch.equal(s1[3], s2[3])


def test_plan_is_all_or_nothing(seed) -> None:
    cache = _cache(blocks=6, block_size=4)
    cache.plan({"a": 6})
    cache.fork("a", "f")
    before = _state(cache)
    with pytest.raises(CacheFullError, match="needs 5 blocks"):
        # a: CoW of the shared partial block + 1 new; f: its copy then needs nothing; b: 3 new
        cache.plan({"a": 3, "f": 1, "b": 9})
    assert _same(before, _state(cache)) and "b" not in cache
    for bad in ({"a": 0}, {"a": -1}, {"a": 1.0}, {}, {"a": True}):
        with pytest.raises((ValueError, TypeError)):
            cache.plan(bad)
        assert _same(before, _state(cache))
    cache.plan({"a": 3, "f": 1, "b": 5})  # exactly fits: 1 CoW + 1 new, 0, 2 new
    assert cache.free == 0


def test_graph_capacity_buffers_stay_put(seed) -> None:
    cache = _cache(graph_capacity=(4, 6))
    hist = History(2)
    run_step(cache, hist, {"a": 5, "b": 3}, torch.float32, "prefill (eager)")
    m1 = cache.plan({"a": 1, "b": 1}, graph=True)
    ptrs = [t.data_ptr() for t in (m1.slot_mapping, m1.block_table, m1.seq_lens, m1.cu_seqlens_q)]
    assert (m1.total_q, m1.num_seqs, m1.max_seqlen_q, m1.max_seqlen_k, m1.num_tokens) == (4, 4, 1, 24, 2)
    assert m1.seq_lens.tolist() == [6, 4, 0, 0] and m1.slot_mapping[2:].tolist() == [-1, -1]
    lay = cache.layout
    for layer in range(2):
        q = torch.randn(4, H_Q, 16)
        k, v = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
        out = cache.forward(q, k, v, m1, layer)
        for i, ns in enumerate("ab"):
            kh, vh = hist.append(ns, layer, k[i : i + 1], v[i : i + 1])
            assert_close(out[i : i + 1], dense_causal(q[i : i + 1], kh, vh), torch.float32, f"graph row {ns}")
        assert torch.all(out[2:] == 0), "padding rows must give 0"
    m2 = cache.plan({"b": 1, "c": 1, "a": 1}, graph=True)
    assert [t.data_ptr() for t in (m2.slot_mapping, m2.block_table, m2.seq_lens, m2.cu_seqlens_q)] == ptrs
    assert m2.seq_lens.tolist() == [5, 1, 7, 0] and lay.num_layers == 2
    with pytest.raises(ValueError, match="max_batch"):
        cache.plan({x: 1 for x in "abcde"}, graph=True)
    with pytest.raises(ValueError, match="q_per_seq"):
        cache.plan({"a": 2}, graph=True)
    cache.plan({"z": 30})
    with pytest.raises(ValueError, match="max_blocks"):
        cache.plan({"z": 1}, graph=True)
    with pytest.raises(ValueError, match="graph_capacity"):
        _cache().plan({"a": 1}, graph=True)


def test_stale_metadata_raises_under_debug(monkeypatch, seed) -> None:
    monkeypatch.setenv("KVARENA_DEBUG", "1")
    cache = _cache(graph_capacity=(2, 4))
    q, k, v = torch.randn(2, H_Q, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    m = cache.plan({"a": 1, "b": 1})
    cache.forward(q, k, v, m, 0)
    cache.forward(q, k, v, m, 1)  # reuse by every layer is fine
    cache.plan({"a": 1})
    with pytest.raises(StaleMetadataError, match="'a'.*planned again"):
        cache.forward(q, k, v, m, 0)
    m = cache.plan({"a": 1, "b": 1})
    cache.truncate("b", 1)
    with pytest.raises(StaleMetadataError, match="'b'"):
        cache.forward(q, k, v, m, 0)
    m = cache.plan({"a": 1, "b": 1})
    cache.free_namespace("a")
    with pytest.raises(StaleMetadataError, match="'a'.*freed"):
        cache.forward(q, k, v, m, 0)
    g1 = cache.plan({"b": 1}, graph=True)
    cache.plan({"b": 1}, graph=True)
    with pytest.raises(StaleMetadataError, match="graph"):
        cache.forward(q, k, v, g1, 0)


def test_foreign_metadata_rejected(seed) -> None:
    a, b = _cache(), _cache()
    meta = a.plan({"x": 2})
    b.plan({"x": 2})
    q, k = torch.randn(2, H_Q, 16), torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="another PagedKVCache"):
        b.forward(q, k, k, meta, 0)
    with pytest.raises(TypeError, match="meta"):
        b.forward(q, k, k, {"x": 2}, 0)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        pytest.param(dict(layer=2), ValueError, "layer", id="layer-out-of-range"),
        pytest.param(dict(layer=-1), ValueError, "layer", id="layer-negative"),
        pytest.param(dict(q=torch.randn(3, H_Q, 16, dtype=torch.float64)), TypeError, "q", id="q-dtype"),
        pytest.param(dict(q=torch.randn(4, H_Q, 16)), ValueError, "q", id="q-rows"),
        pytest.param(dict(q=torch.randn(3, 3, 16)), ValueError, "H_q", id="q-heads"),
        pytest.param(dict(q=torch.randn(3, H_Q, 8)), ValueError, "q", id="q-head-dim"),
        pytest.param(dict(q=torch.randn(3, H_Q)), ValueError, "q", id="q-ndim"),
        pytest.param(dict(k=torch.randn(3, 1, 16)), ValueError, "k", id="k-heads"),
        pytest.param(dict(v=torch.randn(3, 2, 16, device="meta")), ValueError, "v.*device", id="v-device"),
        pytest.param(dict(causal=False), TypeError, "causal", id="reserved-kwarg"),
    ],
)
def test_forward_bad_input(seed, change: dict, exc: type, match: str) -> None:
    cache = _cache()
    meta = cache.plan({"a": 3})
    args = dict(q=torch.randn(3, H_Q, 16), k=torch.randn(3, 2, 16), v=torch.randn(3, 2, 16), layer=0)
    extra = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    before = cache.region.data.clone()
    with pytest.raises(exc, match=match):
        cache.forward(args["q"], args["k"], args["v"], meta, args["layer"], **extra)
    assert torch.equal(before.nan_to_num(3.0), cache.region.data.nan_to_num(3.0)), "a failed forward wrote the cache"


# ---------------------------------------------------------------------------------------
# stateful model check
NAMES = ("a", "b", "c", "d", "e")


class PagedMachine(RuleBasedStateMachine):
    """Random plan/fork/allocate/truncate/free against a model of every namespace's tokens.

    Each new token stores a distinctive value (its serial number) as K at layer 0, so the
    cache's contents read back through ``block_ids`` must equal the model's tokens:
    copy-on-write may never change another namespace's data.
    """

    BS = 3
    BLOCKS = 14

    def __init__(self) -> None:
        super().__init__()
        lay = KVLayout(1, 1, 8, torch.float32)
        self.cache = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(self.BS) * self.BLOCKS), layout=lay, block_size=self.BS, max_seqs=2, max_blocks_per_seq=2)
        self.tokens: dict[str, list[float]] = {}
        self.group: dict[str, int] = {}  # namespaces may share blocks only inside a fork group
        self.serial = 0.0
        self.next_group = 0

    def _new(self, ns: str) -> None:
        if ns not in self.tokens:
            self.tokens[ns] = []
            self.group[ns] = self.next_group
            self.next_group += 1

    @rule(batch=st.dictionaries(st.sampled_from(NAMES), st.integers(1, 5), min_size=1, max_size=3))
    def plan(self, batch: dict) -> None:
        c = self.cache
        before = _state(c)
        try:
            meta = c.plan(batch)
        except CacheFullError:
            assert _same(before, _state(c)), "CacheFullError changed the pool"
            fresh = cow = 0
            for ns, n in batch.items():
                have = c.block_ids(ns) if ns in c else []
                length = c.seq_len(ns) if ns in c else 0
                fresh += max(0, math.ceil((length + n) / self.BS) - len(have))
                j = length // self.BS
                cow += j < len(have) and c.allocator.refcount(have[j]) > 1
            assert fresh + cow > c.free, f"spurious CacheFullError: {fresh}+{cow} <= {c.free}"
            return
        vals = []
        for ns, n in batch.items():
            self._new(ns)
            for _ in range(n):
                self.serial += 1
                vals.append(self.serial)
                self.tokens[ns].append(self.serial)
        k = torch.tensor(vals)[:, None, None].expand(-1, 1, 8).contiguous()
        c.forward(torch.zeros(len(vals), 1, 8), k, -k, meta, 0)

    @precondition(lambda self: self.tokens and len(self.tokens) < len(NAMES))
    @rule(data=st.data(), n=st.integers(0, 2))
    def fork(self, data, n: int) -> None:
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        dst = data.draw(st.sampled_from([x for x in NAMES if x not in self.tokens]))
        with pytest.raises(ValueError):
            self.cache.fork(dst if dst in self.cache else src, src)
        self.cache.fork(src, dst)
        self.tokens[dst] = list(self.tokens[src])
        self.group[dst] = self.group[src]
        if n:  # append right away: the usual way a shared partial block gets copied
            self.plan({data.draw(st.sampled_from([src, dst])): n})

    @rule(ns=st.sampled_from(NAMES), n=st.integers(-1, 4))
    def allocate(self, ns: str, n: int) -> None:
        if n < 0:
            with pytest.raises(ValueError):
                self.cache.allocate(ns, n)
            return
        free = self.cache.free
        ok = self.cache.allocate(ns, n)
        assert ok == (n <= free)
        if ok and n:
            self._new(ns)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        ns = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(0, len(self.tokens[ns])))
        self.cache.truncate(ns, n)
        del self.tokens[ns][n:]

    @rule(ns=st.sampled_from(NAMES))
    def free(self, ns: str) -> None:
        self.cache.free_namespace(ns)
        self.tokens.pop(ns, None)

    @invariant()
    def accounting(self) -> None:
        c = self.cache
        assert c.free + c.allocator.num_used == c.total_blocks
        counts: dict[int, int] = {}
        owners: dict[int, set] = {}
        for ns in c.namespaces():
            for b in c.block_ids(ns):
                counts[b] = counts.get(b, 0) + 1
                owners.setdefault(b, set()).add(ns)
        for b in range(c.total_blocks):
            assert c.allocator.refcount(b) == counts.get(b, 0), f"block {b}: refcount {c.allocator.refcount(b)} != {counts.get(b, 0)} holders"
        for b, nss in owners.items():
            assert len({self.group[n] for n in nss}) == 1, f"block {b} shared by unrelated {nss}"

    @invariant()
    def contents(self) -> None:
        c = self.cache
        assert sorted(c.namespaces()) == sorted(self.tokens)
        kc = c.region.k(0)
        for ns, toks in self.tokens.items():
            assert c.seq_len(ns) == len(toks)
            blocks = c.block_ids(ns)
            assert len(blocks) >= math.ceil(len(toks) / self.BS)
            if toks:
                got = kc[torch.tensor(blocks)].reshape(-1, 8)[: len(toks), 0].tolist()
                assert got == toks, f"{ns!r}: cache holds {got}, model {toks}"

    def teardown(self) -> None:
        for ns in list(self.tokens):
            self.cache.free_namespace(ns)
        assert self.cache.free == self.cache.total_blocks


PagedMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPagedMachine = PagedMachine.TestCase


def test_plan_and_forward_never_read_device_data() -> None:
    """On the meta device every .item()/.tolist()/bool() of a tensor raises: plan and forward
    running there proves they never synchronize with the device."""
    cache = _cache(device="meta", graph_capacity=(2, 4))
    cache.plan({"a": 5, "b": 3})
    cache.fork("a", "c")
    for graph in (False, True):
        meta = cache.plan({"a": 1, "c": 1}, graph=graph)
        n = meta.total_q
        for layer in range(2):
            out = cache.forward(torch.empty(n, H_Q, 16, device="meta"), torch.empty(n, 2, 16, device="meta"), torch.empty(n, 2, 16, device="meta"), meta, layer)
            assert out.device.type == "meta" and out.shape == (n, H_Q, 16)


def test_concurrent_namespaces_from_threads(seed) -> None:
    cache = _cache(blocks=64, block_size=4)

    def worker(i: int) -> None:
        for step in range(40):
            ns = f"t{i}-{step % 3}"
            cache.plan({ns: 1 + step % 5})
            if step % 4 == 3:
                cache.fork(ns, ns + "f")
                cache.truncate(ns, 1)
                cache.free_namespace(ns + "f")
            if step % 7 == 6:
                cache.free_namespace(ns)

    errors = run_threads(worker, 4)
    assert not errors, errors
    held = sum(len(cache.block_ids(ns)) for ns in cache.namespaces())
    assert cache.allocator.num_used == held and cache.free + held == cache.total_blocks
    for ns in cache.namespaces():
        cache.free_namespace(ns)
    assert cache.free == cache.total_blocks


@gpu_test
def test_pool_metadata_drives_the_triton_kernels(seed) -> None:
    """The Triton path (interpreted on CPU) on the pool's metadata: prefill, fork + CoW,
    and CUDA-graph padding rows (seq_len 0 with a query) give the dense result / 0."""
    cache = _cache(graph_capacity=(3, 4), device=DEVICE)
    hist = History(2)
    run_step(cache, hist, {"a": 5, "b": 3}, torch.float32, "triton prefill", backend="triton", window_left=4)
    cache.fork("a", "c")
    hist.fork("a", "c")
    run_step(cache, hist, {"c": 2, "a": 1}, torch.float32, "triton fork", backend="triton")
    meta = cache.plan({"b": 1, "c": 1}, graph=True)
    q, k, v = torch.randn(3, H_Q, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    out = cache.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), meta, 0, backend="triton")
    for i, ns in enumerate("bc"):
        kh, vh = hist.append(ns, 0, k[i : i + 1], v[i : i + 1])
        assert_close(out[i : i + 1], dense_causal(q[i : i + 1], kh, vh), torch.float32, f"triton graph row {ns}")
    assert torch.all(out[2] == 0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=GPU)])
def test_padded_plan_equals_the_packed_one(seed, backend) -> None:
    """plan(pad_to=S): q/k/v/out stay [B * S] (new tokens last in each row, left padding);
    padding is never stored and the real rows equal a packed plan of the same tokens."""
    dev = device_for(backend)
    dtype = torch.float64 if backend == "torch" else torch.float32
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype=dtype)

    def pool():
        return PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(4) * 32), layout=lay, block_size=4,
                            attention=AttentionSpec(backend=backend), device=dev)

    padded, packed = pool(), pool()
    s = 7
    for news in ([7, 3, 5], [1, 1, 0], [2, 0, 1]):  # prefill, decode with an idle row, a ragged step
        q = torch.randn(3, s, 4, 16, dtype=dtype)
        k, v = torch.randn(3, s, 2, 16, dtype=dtype), torch.randn(3, s, 2, 16, dtype=dtype)
        q, k, v = q.to(dev), k.to(dev), v.to(dev)
        meta = padded.plan({f"r{i}": n for i, n in enumerate(news)}, pad_to=s)
        assert meta.total_q == 3 * s and meta.num_tokens == sum(news) and meta.pad_to == s
        out = padded.forward(q.reshape(-1, 4, 16), k.reshape(-1, 2, 16), v.reshape(-1, 2, 16), meta, 0)
        out = out.view(3, s, 4, 16)
        rows = [i for i, n in enumerate(news) if n]

        def real(x, rows=rows, news=news):
            return torch.cat([x[i, s - news[i] :] for i in rows])

        m2 = packed.plan({f"r{i}": news[i] for i in rows})
        want = packed.forward(real(q), real(k), real(v), m2, 0)
        assert_close(real(out), want, dtype, f"news {news}")
        assert not out.isnan().any()
        assert [padded.seq_len(f"r{i}") for i in rows] == [packed.seq_len(f"r{i}") for i in rows]
    assert padded.used_bytes == packed.used_bytes
    with pytest.raises(ValueError, match="do not fit pad_to"):
        padded.plan({"r0": 8}, pad_to=s)
    meta = padded.plan({"r0": 1}, pad_to=2)
    kg = torch.randn(2, 2, 16, dtype=dtype).to(dev).requires_grad_()
    with pytest.raises(ValueError, match="padded plan"):
        padded.forward(torch.randn(2, 4, 16, dtype=dtype).to(dev), kg, kg, meta, 0)


_ONE_BLOCK_LAYOUTS = {
    "one group": dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32),
    "two groups": dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                       groups=((0,), (1,))),
}


@pytest.mark.parametrize("name", list(_ONE_BLOCK_LAYOUTS), ids=list(_ONE_BLOCK_LAYOUTS))
def test_budget_below_one_block_is_a_value_error_at_construction(name) -> None:
    """A budget that cannot hold one block (per layer group) fails when the pool is made,
    naming max_bytes, the block size and the bytes needed, not at the first plan."""
    layout = KVLayout(**_ONE_BLOCK_LAYOUTS[name])
    groups = len(layout.layer_groups)
    need = layout.block_bytes(8) * groups
    with pytest.raises(ValueError) as exc:
        PagedKVCache(CachePolicy("paged_kv", max_bytes=need - 1), layout=layout, block_size=8)
    msg = str(exc.value)
    for part in ("max_bytes", f"{need - 1} bytes", "block_size 8", f"max_bytes >= {need}"):
        assert part in msg, f"{part!r} missing from: {msg}"
    cache = PagedKVCache(CachePolicy("paged_kv", max_bytes=need), layout=layout, block_size=8)
    assert cache.total_blocks == groups


def test_cache_full_error_states_block_size_and_budget() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    budget = 3 * layout.block_bytes(4)
    cache = PagedKVCache(CachePolicy("paged_kv", max_bytes=budget), layout=layout, block_size=4)
    with pytest.raises(CacheFullError) as exc:
        cache.plan({"a": 13})
    msg = str(exc.value)
    for part in ("needs 4 blocks", "block_size 4", f"{layout.block_bytes(4)} bytes a block", f"budget {budget} bytes"):
        assert part in msg, f"{part!r} missing from: {msg}"
