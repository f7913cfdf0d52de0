"""Layer groups in one paged pool (issue 15): hybrid sliding / full models, per-group shapes.

The reference is each layer's mask on a flat fp64 copy of every token a sequence stored:
a full layer's query at position p sees t <= p, a sliding one t >= p - window_left or
t < sink_tokens. Free blocks (released ones included) are NaN-poisoned in every group's
view before each step: an output that read one would not be finite.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import GPU, assert_close, device_for, one_torch_thread  # noqa: F401 - autouse fixture

from kvarena import AttentionSpec, CacheFullError, CachePolicy, KVLayout, PagedKVCache, SlabKVCache
from kvarena.cache.arena import LayerGroup, group_layers

BS, W, H_Q = 4, 9, 4  # block size, sliding window_left, query heads


# Per pattern: per-layer (window_left or None, sink_tokens), the groups, per-group (H_kv, D).
def _pattern(name: str):
    if name == "gemma3":  # 5 sliding : 1 full, a group per layer (gcd of 5 and 1)
        kinds = [(W, 0)] * 5 + [(None, 0)]
        return kinds, group_layers(kinds), {}
    if name == "gptoss":  # alternating: 2 groups of 2 layers
        kinds = [(W, 0), (None, 0)] * 2
        return kinds, group_layers(kinds), {}
    if name == "shapes":  # a sliding group with 2 sink tokens, other heads and head_dim
        kinds = [(W - 3, 2), (None, 0), (W - 3, 2)]
        return kinds, (LayerGroup((0, 2), num_kv_heads=1, head_dim=24), LayerGroup((1,))), {}
    raise AssertionError(name)


def _pool(name: str, blocks: int = 160, *, dtype=torch.float64, free=True, rollback=0, graph=None, device=None):
    kinds, groups, _ = _pattern(name)
    lay = KVLayout(num_layers=len(kinds), num_kv_heads=2, head_dim=16, dtype=dtype, groups=groups)
    specs = [AttentionSpec(window_left=w, sink_tokens=s) for w, s in kinds]
    pool = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(BS) * blocks), layout=lay, block_size=BS,
                        attention=specs, free_out_of_window=free, rollback_tokens=rollback, graph_capacity=graph,
                        device=device)
    _poison_free(pool)
    return pool, kinds


def _poison_free(pool: PagedKVCache) -> None:
    free = [b for b in range(pool.total_blocks) if pool.allocator.refcount(b) == 0]
    idx = torch.tensor(free, dtype=torch.long)
    for data in pool.region.group_data:
        data[idx] = float("nan")


def _want(q, keys, vals, p0: int, w, sinks: int):
    """fp64 attention of queries at positions p0.. over the flat history by the layer's mask."""
    outs = []
    g = q.shape[1] // keys.shape[1]
    for i in range(q.shape[0]):
        p = p0 + i
        t = torch.arange(p + 1)
        vis = torch.ones(p + 1, dtype=torch.bool) if w is None else (t >= p - w) | (t < sinks)
        k, v = keys[: p + 1][vis].repeat_interleave(g, 1), vals[: p + 1][vis].repeat_interleave(g, 1)
        s = torch.einsum("hd,khd->hk", q[i].double(), k.double()) * q.shape[-1] ** -0.5
        outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), v.double()))
    return torch.stack(outs)


class History:
    def __init__(self, pool: PagedKVCache) -> None:
        shapes = [pool.layout.layer_shape(i) for i in range(pool.layout.num_layers)]
        self.k = [torch.zeros(0, h, d, dtype=torch.float64) for h, d in shapes]
        self.v = [torch.zeros(0, h, d, dtype=torch.float64) for h, d in shapes]

    def copy(self) -> History:
        out = History.__new__(History)
        out.k, out.v = [x.clone() for x in self.k], [x.clone() for x in self.v]
        return out

    def cut(self, n: int) -> None:
        self.k, self.v = [x[:n] for x in self.k], [x[:n] for x in self.v]


def _step(pool, kinds, hist: dict, batch: dict, backend="torch", dtype=torch.float64, graph=False, pad_to=None):
    meta = pool.plan(batch, graph=graph, pad_to=pad_to)
    _poison_free(pool)
    rows = meta.total_q
    for layer, (w, sinks) in enumerate(kinds):
        h_kv, d = pool.layout.layer_shape(layer)
        q = torch.randn(rows, H_Q, d, dtype=torch.float64)
        k, v = torch.randn(rows, h_kv, d, dtype=torch.float64), torch.randn(rows, h_kv, d, dtype=torch.float64)
        dev = pool.device
        out = pool.forward(q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype), meta, layer, backend=backend)
        at = 0
        for ns, cnt in batch.items():
            if pad_to is not None:  # a padded row's new tokens are its last cnt rows
                at += pad_to - cnt
            h = hist[ns]
            p0 = h.k[layer].shape[0]
            h.k[layer] = torch.cat([h.k[layer], k[at : at + cnt].to(dtype).double()])
            h.v[layer] = torch.cat([h.v[layer], v[at : at + cnt].to(dtype).double()])
            want = _want(q[at : at + cnt].to(dtype), h.k[layer], h.v[layer], p0, w, sinks)
            assert_close(out[at : at + cnt], want, dtype, f"{ns} layer {layer} at {p0}")
            at += cnt
    return meta


def _live(pool, ns, group) -> int:
    return sum(b != -1 for b in pool.block_ids(ns, group))


def _expected_live(pool, kinds, group: int, old: int, new: int, rollback: int = 0) -> int:
    """Blocks a sequence holds in ``group`` after a plan from ``old`` to ``new`` tokens
    (``rollback``: the pool's ``rollback_tokens``)."""
    layers = pool.layout.layer_groups[group].layers
    ws = [kinds[i][0] for i in layers]
    total = -(-new // BS)
    if any(w is None for w in ws):
        return total  # a full-attention group keeps every block
    w, sinks = max(ws) + rollback, max(kinds[i][1] for i in layers)
    sink_blocks = -(-sinks // BS)
    return total - max(0, max(0, old - w) // BS - sink_blocks)


@pytest.mark.parametrize(
    "name,backend",
    [("gemma3", "torch"), ("gptoss", "torch"), ("shapes", "torch"),
     # The kernels see a group only as its table and strided views: one interpreter case
     # (two groups of other shapes, sinks, a full group) covers them (CI time).
     pytest.param("shapes", "triton", marks=GPU)],
)
def test_hybrid_generation_equals_dense_masks_and_holds_the_formula(name, backend) -> None:
    """Prefill, then decode to 10x the window: every layer equal to
    its dense mask every step (the interpreter: W + 3 steps, past the window); a full group holds ceil(N / bs) blocks per sequence, a
    sliding group exactly what its window keeps (<= ceil(sinks / bs) + ceil((window + 1) /
    bs) + 1)."""
    torch.manual_seed(0)
    dtype = torch.float64 if backend == "torch" else torch.float32
    pool, kinds = _pool(name, dtype=dtype, device=device_for(backend))
    hist = {"a": History(pool), "b": History(pool)}
    lens = {"a": 0, "b": 0}

    def step(batch):
        _step(pool, kinds, hist, batch, backend, dtype)
        for g in range(len(pool.layout.layer_groups)):
            for ns, n in batch.items():
                want = _expected_live(pool, kinds, g, lens[ns], lens[ns] + n)
                assert _live(pool, ns, g) == want, (name, g, ns, lens[ns], pool.block_ids(ns, g))
            assert pool.group_used_blocks[g] == sum(_live(pool, ns, g) for ns in lens)
        for ns, n in batch.items():
            lens[ns] += n
        assert pool.used_bytes == sum(pool.group_used_bytes) == pool.allocator.num_used * pool.block_bytes

    step({"a": 7, "b": 13})
    for _ in range(10 * W if backend == "torch" else W + 3):  # interpreter: just past the window
        step({"a": 1, "b": 1})
    for g, grp in enumerate(pool.layout.layer_groups):
        ws = [kinds[i] for i in grp.layers]
        if all(w is not None for w, _s in ws):
            sinks = max(s for _w, s in ws)
            bound = -(-sinks // BS) + -(-(max(w for w, _s in ws) + 1) // BS) + 1
            assert _live(pool, "a", g) <= bound and -1 in pool.block_ids("a", g)
        else:
            assert _live(pool, "a", g) == -(-lens["a"] // BS)
    step({"a": 2 * W})  # a chunked-prefill step longer than the window
    step({"a": 1, "b": 1})


def test_arena_use_grows_with_the_full_layers_only() -> None:
    """Gemma-3-like: 6 groups of one layer; past the window, each step's new blocks are the
    full group's (the sliding groups' release as many as they take)."""
    torch.manual_seed(1)
    pool, kinds = _pool("gemma3", blocks=200)
    keep, _ = _pool("gemma3", blocks=200, free=False)
    hist = {"a": History(pool)}
    for p in (pool, keep):
        p.plan({"a": 40})
    used = []
    for _ in range(48):
        for p in (pool, keep):
            p.plan({"a": 1})
        used.append(pool.group_used_blocks)
    n = pool.seq_len("a")
    full = -(-n // BS)
    assert pool.group_used_blocks[5] == full == keep.group_used_blocks[5]
    for g in range(5):
        assert pool.group_used_blocks[g] <= -(-(W + 1) // BS) + 1 < keep.group_used_blocks[g] == full
    sliding_growth = {tuple(u[:5]) for u in used[8:]}
    assert len(sliding_growth) <= 4, sliding_growth  # the sliding groups cycle, they do not grow
    assert pool.stats()["groups"][5]["window_left"] is None and pool.stats()["groups"][0]["window_left"] == W
    del hist


def test_grouped_layouts_equal_the_ungrouped_pool() -> None:
    """Without releases, a grouped layout (every group its own blocks, one block = the
    largest group's bytes) gives the same outputs as the one-group layout, float and fp8."""
    torch.manual_seed(2)
    for dtype, inp in ((torch.float32, torch.float32), (torch.float8_e4m3fn, torch.float32)):
        outs = []
        for groups in (None, ((0, 2), (1,))):
            lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype, input_dtype=inp, groups=groups)
            pool = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(BS) * 64), layout=lay, block_size=BS,
                                attention={1: AttentionSpec(window_left=5)})
            if groups is not None:
                assert pool.block_bytes == lay.group_block_bytes(0, BS) == 2 * lay.group_block_bytes(1, BS)
            g = torch.Generator().manual_seed(3)
            got = []
            for batch in ({"a": 9, "b": 3}, {"a": 1, "b": 5}, {"a": 1, "b": 1}):
                meta = pool.plan(batch)
                for layer in range(3):
                    q, k, v = (torch.randn(meta.total_q, h, 16, generator=g) for h in (4, 2, 2))
                    got.append(pool.forward(q, k, v, meta, layer, backend="torch"))
            outs.append(torch.cat(got))
        assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1]), dtype


def test_fork_across_the_window_edge_and_truncate_per_group() -> None:
    torch.manual_seed(3)
    pool, kinds = _pool("gptoss", rollback=3)
    hist = {"a": History(pool)}
    _step(pool, kinds, hist, {"a": 11})
    for _ in range(6):
        _step(pool, kinds, hist, {"a": 1})
    pool.fork("a", "b")  # shares both groups' live blocks, some about to leave the window
    hist["b"] = hist["a"].copy()
    for _ in range(2 * W):
        _step(pool, kinds, hist, {"a": 1, "b": 1})
    held = {b for ns in ("a", "b") for g in range(2) for b in pool.block_ids(ns, g) if b != -1}
    assert pool.allocator.num_used == len(held) == sum(pool.group_used_blocks)
    assert -1 not in pool.block_ids("a", 1) and -1 in pool.block_ids("a", 0)
    n = pool.seq_len("b")
    pool.truncate("b", n - 3)  # within the rollback margin
    hist["b"].cut(n - 3)
    _step(pool, kinds, hist, {"b": 1})
    before = ([pool.block_ids("a", g) for g in range(2)], pool.seq_len("a"), pool.allocator.num_free)
    with pytest.raises(ValueError, match="n_tokens: rolling back to 5 tokens needs block .* of layer group 0"):
        pool.truncate("a", 5)
    assert ([pool.block_ids("a", g) for g in range(2)], pool.seq_len("a"), pool.allocator.num_free) == before
    for ns in ("a", "b"):
        pool.free_namespace(ns)
    assert pool.allocator.num_used == 0 and pool.group_used_blocks == (0, 0)


def test_graph_and_padded_plans_with_groups() -> None:
    """A 48-block arena serves a 60-token Gemma-3-like generation through CUDA-graph
    buffers (each group's table a view of one persistent tensor), then a padded plan."""
    torch.manual_seed(4)
    pool, kinds = _pool("gemma3", blocks=48, graph=(2, 20))
    hist = {"a": History(pool)}
    ptrs = None
    for _ in range(60):
        meta = _step(pool, kinds, hist, {"a": 1}, graph=True)
        now = [t.data_ptr() for t in (*meta.block_tables, *meta.slot_mappings)]
        assert ptrs in (None, now)
        ptrs = now
    hist["b"] = History(pool)
    _step(pool, kinds, hist, {"a": 2, "b": 5}, pad_to=5)
    keep, _ = _pool("gemma3", blocks=48, free=False)
    keep.plan({"a": 28})
    with pytest.raises(CacheFullError):
        keep.plan({"a": 8})


def test_group_errors() -> None:
    with pytest.raises(ValueError, match=r"groups: must cover layers 0..2 once each"):
        KVLayout(num_layers=3, num_kv_heads=1, head_dim=8, dtype=torch.float32, groups=[(0, 1)])
    with pytest.raises(ValueError, match=r"groups: must cover"):
        KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, groups=[(0, 1), (1,)])
    with pytest.raises(ValueError, match=r"groups\[1\]: layers: expected at least one layer"):
        KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, groups=[(0, 1), ()])
    with pytest.raises(ValueError, match="head_dim: expected an int >= 1"):
        LayerGroup((0,), head_dim=0)
    with pytest.raises(TypeError, match="groups: expected a sequence"):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, groups=LayerGroup((0,)))
    with pytest.raises(ValueError, match="head_dim: an fp8 layout needs a multiple of 4"):
        KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float8_e4m3fn,
                 groups=[LayerGroup((0,), head_dim=10), (1,)])
    assert group_layers(["s"] * 5 + ["f"]) == tuple((i,) for i in range(6))
    assert group_layers(["s", "f"] * 3) == ((0, 2, 4), (1, 3, 5))
    assert group_layers(["s"] * 4 + ["f"] * 2, group_size=3) == ((0, 1, 2), (3,), (4, 5))
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, groups=[(0,), (1,)])
    with pytest.raises(ValueError, match="layout.groups: a slab holds every layer"):
        SlabKVCache(CachePolicy("slab_kv", 1 << 16), layout=lay, slab_tokens=4)
    full = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, groups=[(0, 1)])
    with pytest.raises(ValueError, match="free_out_of_window: layer 1 sees the whole history .*no group"):
        PagedKVCache(CachePolicy("paged_kv", 1 << 16), layout=full, block_size=4,
                     attention={0: AttentionSpec(window_left=3)}, free_out_of_window=True)
    pool, kinds = _pool("shapes")
    meta = pool.plan({"a": 3})
    q, k = torch.randn(3, H_Q, 16, dtype=torch.float64), torch.randn(3, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"k: expected shape \(3, 1, 24\)"):
        pool.forward(torch.randn(3, H_Q, 24, dtype=torch.float64), k, k, meta, 0)
    pool.forward(q, k, k, meta, 1, window_left=50)  # the full group releases nothing: any window
    with pytest.raises(ValueError, match="this pool releases layer 2's blocks outside window_left=6"):
        q2, k2 = torch.randn(3, H_Q, 24, dtype=torch.float64), torch.randn(3, 1, 24, dtype=torch.float64)
        pool.forward(q2, k2, k2, meta, 2, window_left=7)
    with pytest.raises(ValueError, match=r"group: expected an int in \[0, 2\)"):
        pool.block_ids("a", 2)
    assert pool.allocate("c", 2) and [len(pool.block_ids("c", g)) for g in range(2)] == [2, 2]
    for call, exc, needle in (
        (lambda: lay.group_of(-1), ValueError, "layer: expected 0 <= layer < 2"),
        (lambda: lay.layer_shape(2), ValueError, "layer: expected 0 <= layer < 2"),
        (lambda: lay.group_of(1.0), TypeError, "layer: expected an int"),
        (lambda: lay.group_block_bytes(True, 4), TypeError, "group: expected an int"),
        (lambda: group_layers(None), TypeError, "kinds: expected a sequence"),
        (lambda: group_layers([[1], [2]]), TypeError, r"kinds\[0\]: expected a hashable kind"),
        (lambda: LayerGroup({0: "x"}), TypeError, "layers: expected a sequence"),
        (lambda: KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, groups={(0,): 1}),
         TypeError, "groups: expected a sequence"),
    ):
        with pytest.raises(exc, match=needle):
            call()


def test_a_padded_plan_of_padding_only() -> None:
    """A padded plan whose rows hold no token yet (new, or truncated to 0): valid metadata,
    every slot -1, outputs finite (no key to see)."""
    pool, kinds = _pool("gptoss")
    pool.plan({"b": 3})
    pool.truncate("b", 0)
    meta = pool.plan({"a": 0, "b": 0}, pad_to=2)
    assert all(bool((s == -1).all()) for s in meta.slot_mappings)
    x = torch.randn(4, 2, 16, dtype=torch.float64)
    out = pool.forward(torch.randn(4, H_Q, 16, dtype=torch.float64), x, x, meta, 0, backend="torch")
    assert torch.isfinite(out).all()
