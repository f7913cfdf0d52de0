"""Out-of-window blocks released at plan time (issue 15, part 1: every layer slides).

The reference is the window rule on a flat fp64 copy of every token a sequence stored: a
query at position p sees t <= p with t >= p - window_left or t < sink_tokens. Released
blocks are NaN-poisoned in the arena (they are free, so anything may be written there):
an output that read one would not be finite.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import TRITON, assert_close, device_for, one_torch_thread  # noqa: F401 - autouse fixture

from kvarena import AttentionSpec, CacheFullError, CachePolicy, KVLayout, PagedKVCache

BS, W, S = 4, 9, 2  # block size, window_left, sink tokens
H_Q, H_KV, D = 4, 2, 16


def _pool(blocks: int = 64, *, dtype=torch.float64, graph=None, free=True, rollback=0, **kw) -> PagedKVCache:
    lay = KVLayout(num_layers=2, num_kv_heads=H_KV, head_dim=D, dtype=dtype)
    spec = AttentionSpec(window_left=W, sink_tokens=S)
    pool = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(BS) * blocks), layout=lay, block_size=BS,
                        attention={0: spec, 1: spec.replace(window_left=W - 3)}, free_out_of_window=free,
                        graph_capacity=graph, rollback_tokens=rollback, **kw)
    pool.region.data.fill_(float("nan"))
    return pool


def _want(q, keys, vals, p0: int, layer_w: int):
    """fp64 attention of queries at positions p0.. over the flat history by the window rule."""
    outs = []
    g = q.shape[1] // keys.shape[1]
    for i in range(q.shape[0]):
        p = p0 + i
        t = torch.arange(p + 1)
        vis = (t >= p - layer_w) | (t < S)
        k, v = keys[: p + 1][vis].repeat_interleave(g, 1), vals[: p + 1][vis].repeat_interleave(g, 1)
        s = torch.einsum("hd,khd->hk", q[i].double(), k.double()) * D**-0.5
        outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), v.double()))
    return torch.stack(outs)


def _poison_free(pool: PagedKVCache) -> None:
    """NaN into every block nobody holds (released ones included)."""
    alloc = pool.allocator
    free = [b for b in range(pool.total_blocks) if alloc.refcount(b) == 0]
    pool.region.data[torch.tensor(free, dtype=torch.long)] = float("nan")


class History:
    def __init__(self) -> None:
        self.k = [torch.zeros(0, H_KV, D, dtype=torch.float64) for _ in range(2)]
        self.v = [torch.zeros(0, H_KV, D, dtype=torch.float64) for _ in range(2)]


def _step(pool, hist: dict, batch: dict, backend: str = "torch", graph: bool = False, dtype=torch.float64):
    meta = pool.plan(batch, graph=graph)
    _poison_free(pool)
    n = sum(batch.values())
    rows = meta.total_q
    for layer, lw in ((0, W), (1, W - 3)):
        q = torch.randn(rows, H_Q, D, dtype=torch.float64)
        k, v = torch.randn(rows, H_KV, D, dtype=torch.float64), torch.randn(rows, H_KV, D, dtype=torch.float64)
        dev = pool.device
        out = pool.forward(q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype), meta, layer, backend=backend)
        at = 0
        for ns, cnt in batch.items():
            h = hist[ns]
            p0 = h.k[layer].shape[0]
            h.k[layer] = torch.cat([h.k[layer], k[at : at + cnt].to(dtype).double()])
            h.v[layer] = torch.cat([h.v[layer], v[at : at + cnt].to(dtype).double()])
            want = _want(q[at : at + cnt].to(dtype), h.k[layer], h.v[layer], p0, lw)
            assert_close(out[at : at + cnt], want, dtype, f"{ns} layer {layer} at {p0}")
            at += cnt
    return n


def _held(pool, ns) -> int:
    return sum(b != -1 for b in pool.block_ids(ns))


@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_long_generation_holds_a_bounded_window(backend) -> None:
    """Prefill then decode to 10x the window: every step equal to the window rule, with
    released (NaN-poisoned) blocks never read; blocks held <= sinks + window + 1 block."""
    torch.manual_seed(0)
    dtype = torch.float64 if backend == "torch" else torch.float32
    pool = _pool(dtype=dtype, device=device_for(backend))
    hist = {"a": History(), "b": History()}
    bound = -(-S // BS) + -(-(W + 1) // BS) + 1
    _step(pool, hist, {"a": 7, "b": 13}, backend, dtype=dtype)
    steps = 10 * W if backend == "torch" else 2 * W
    for _ in range(steps):
        _step(pool, hist, {"a": 1, "b": 1}, backend, dtype=dtype)
        for ns in ("a", "b"):
            assert _held(pool, ns) <= bound, (ns, pool.block_ids(ns))
    assert pool.used_bytes == pool.block_bytes * sum(_held(pool, ns) for ns in ("a", "b"))
    assert -1 in pool.block_ids("a")
    # A chunked-prefill step longer than the window, then decode again.
    _step(pool, hist, {"a": 2 * W}, backend, dtype=dtype)
    _step(pool, hist, {"a": 1, "b": 1}, backend, dtype=dtype)


def test_fork_across_the_window_edge_and_truncate() -> None:
    torch.manual_seed(1)
    pool = _pool(rollback=3)  # speculative rollback of up to 3 tokens
    hist = {"a": History()}
    _step(pool, hist, {"a": 11})
    for _ in range(6):
        _step(pool, hist, {"a": 1})
    pool.fork("a", "b")  # shares live blocks, some about to leave the window
    hist["b"] = History()
    for layer in range(2):
        hist["b"].k[layer], hist["b"].v[layer] = hist["a"].k[layer].clone(), hist["a"].v[layer].clone()
    for _ in range(2 * W):
        _step(pool, hist, {"a": 1, "b": 1})
    # Each branch releases its own references; a block dies when both have released it.
    held = set(b for ns in ("a", "b") for b in pool.block_ids(ns) if b != -1)
    assert pool.allocator.num_used == len(held)
    # Truncate within the window (speculative rollback): allowed, and decoding goes on.
    n = pool.seq_len("b")
    pool.truncate("b", n - 3)
    for layer in range(2):
        hist["b"].k[layer], hist["b"].v[layer] = hist["b"].k[layer][: n - 3], hist["b"].v[layer][: n - 3]
    _step(pool, hist, {"b": 1})
    # Past a released block: a ValueError naming n_tokens, nothing changed.
    before = (pool.block_ids("a"), pool.seq_len("a"), pool.allocator.num_free)
    with pytest.raises(ValueError, match="n_tokens: rolling back to 5 tokens needs block .* reachable lengths: ") as err:
        pool.truncate("a", 5)
    assert (pool.block_ids("a"), pool.seq_len("a"), pool.allocator.num_free) == before
    # The boundary it names is exact by the rule: one token earlier, the next query's window
    # (t >= p - W) would reach into the last released block; at it, decoding reads only held
    # blocks (the released ones are NaN-poisoned).
    m = int(str(err.value).split("reachable lengths: ")[1].split(" ")[0])
    last = max(j for j, b in enumerate(pool.block_ids("a")) if b == -1)
    assert (m - 1) - W <= (last + 1) * BS - 1 < m - W
    with pytest.raises(ValueError, match="n_tokens"):
        pool.truncate("a", m - 1)
    pool.truncate("a", m)
    for layer in range(2):
        hist["a"].k[layer], hist["a"].v[layer] = hist["a"].k[layer][:m], hist["a"].v[layer][:m]
    _step(pool, hist, {"a": 1})


def test_released_blocks_make_room_and_graph_plans_work() -> None:
    """A pool of 8 blocks serves a 60-token generation (released blocks are reused), also
    through CUDA-graph persistent buffers."""
    torch.manual_seed(2)
    pool = _pool(blocks=8, graph=(2, 20))
    hist = {"a": History()}
    _step(pool, hist, {"a": 1}, graph=True)
    for _ in range(59):
        _step(pool, hist, {"a": 1}, graph=True)
    assert pool.seq_len("a") == 60
    keep = _pool(blocks=8, free=False)
    keep.plan({"a": 30})
    with pytest.raises(CacheFullError):
        keep.plan({"a": 3})


def test_errors() -> None:
    lay = KVLayout(num_layers=2, num_kv_heads=H_KV, head_dim=D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"free_out_of_window: layer 1 sees the whole history .*group_layers"):
        PagedKVCache(CachePolicy("paged_kv", 1 << 16), layout=lay, block_size=BS,
                     attention={0: AttentionSpec(window_left=3)}, free_out_of_window=True)
    with pytest.raises(TypeError, match="free_out_of_window"):
        PagedKVCache(CachePolicy("paged_kv", 1 << 16), layout=lay, block_size=BS, free_out_of_window=1)
    pool = _pool()
    meta = pool.plan({"a": 3})
    q, k = torch.randn(3, H_Q, D, dtype=torch.float64), torch.randn(3, H_KV, D, dtype=torch.float64)
    for bad in (dict(window_left=None), dict(window_left=W + 1), dict(sink_tokens=S + 1)):
        with pytest.raises(ValueError, match="window_left/sink_tokens: this pool releases layer 0's blocks"):
            pool.forward(q, k, k, meta, 0, **bad)
    pool.forward(q, k, k, meta, 1, window_left=W - 5)  # a narrower window is fine


def test_releases_shared_by_forks_are_counted_before_the_step() -> None:
    """Forks hold the same dead blocks: the plan that releases every reference counts them
    as returning (a 3-block arena serves the step), and a copy-on-write whose other
    reference this plan releases is not counted (no block leaks)."""
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float64)
    spec = AttentionSpec(window_left=1)
    pool = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(4) * 3), layout=lay, block_size=4, attention=spec,
                        free_out_of_window=True)
    pool.plan({"a": 12})
    pool.fork("a", "b")
    pool.plan({"a": 1, "b": 1})  # blocks 0, 1 dead for both: 2 come back, 2 are taken
    assert pool.allocator.num_used == len({b for ns in "ab" for b in pool.block_ids(ns) if b != -1})
    big = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(4) * 8), layout=lay, block_size=4, attention=spec,
                       free_out_of_window=True)
    big.plan({"a": 8})
    big.fork("a", "b")
    big.truncate("b", 5)  # b's partial block 1 is shared with a
    big.plan({"a": 1})  # a releases block 1 out of its window
    big.plan({"a": 1, "b": 1})  # b writes block 1 in place: nobody else holds it now
    live = {b for ns in "ab" for b in big.block_ids(ns) if b != -1}
    assert big.allocator.num_used == len(live) and big.used_bytes == len(live) * big.block_bytes
    big.free_namespace("a")
    big.free_namespace("b")
    assert big.allocator.num_used == 0


def test_torch_gradients_never_touch_released_blocks() -> None:
    """Under autograd on the torch path, keys no query sees (released blocks, NaN here)
    are zeroed before the score product: dq is finite and equals the Triton-free rule."""
    torch.manual_seed(5)
    pool = _pool()
    hist = {"a": History()}
    _step(pool, hist, {"a": 12})
    for _ in range(8):
        _step(pool, hist, {"a": 1})
    assert -1 in pool.block_ids("a")
    meta = pool.plan({"a": 1})
    _poison_free(pool)
    q = torch.randn(1, H_Q, D, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(1, H_KV, D, dtype=torch.float64), torch.randn(1, H_KV, D, dtype=torch.float64)
    pool.forward(q, k, v, meta, 0, backend="torch").square().sum().backward()
    qr = q.detach().clone().requires_grad_()
    keys, vals = torch.cat([hist["a"].k[0], k]), torch.cat([hist["a"].v[0], v])
    _want(qr, keys, vals, keys.shape[0] - 1, W).square().sum().backward()
    assert_close(q.grad, qr.grad, torch.float64, "dq after releases")


def test_rollback_margin_counts_from_the_longest_planned_length(seed) -> None:
    """The contract's rollback_tokens guarantee, restated (issue 27: "keeps that many tokens
    of rollback always possible" fails after an earlier rollback: window 4, block 4,
    rollback 3: decode to 20, truncate 3, decode 1, truncate 3 -> ValueError). What holds:
    every length n >= p - rollback_tokens is reachable, p the longest length a plan of the
    sequence started from; a rollback does not renew the margin."""
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    pool = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(4) * 64), layout=lay, block_size=4,
                        attention=AttentionSpec(window_left=4), free_out_of_window=True, rollback_tokens=3)
    p_max = 0
    gen = torch.Generator().manual_seed(seed)
    for _ in range(60):  # decode steps with speculative rollbacks of 1..3 tokens in between
        p_max = max(p_max, pool.seq_len("a") if "a" in pool else 0)  # where this plan starts
        pool.plan({"a": 1})
        n = pool.seq_len("a")
        for m in range(max(0, p_max - 3), n + 1):
            pool.check_truncate("a", m)  # guaranteed: raises if the contract's bound is wrong
        if int(torch.randint(0, 4, (1,), generator=gen)) == 0:
            pool.truncate("a", max(0, n - int(torch.randint(1, 4, (1,), generator=gen))))
    assert -1 in pool.block_ids("a"), "nothing was released: the test did not exercise the release"
    # The sequence: after the first rollback the margin is not renewed.
    pool.free_namespace("a")
    for _ in range(20):
        pool.plan({"a": 1})  # the last plan starts from p = 19
    pool.truncate("a", 17)
    pool.plan({"a": 1})
    with pytest.raises(ValueError, match="^n_tokens: rolling back to 15 tokens needs block 2"):
        pool.truncate("a", 15)  # 15 < 19 - 3: not guaranteed, and refused here
    pool.truncate("a", 16)  # 19 - 3: guaranteed
