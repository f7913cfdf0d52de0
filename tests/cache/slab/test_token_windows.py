"""SlabKVCache with token-granular sinks and windows and multi-chunk steps (issue 12).

The reference is the rule itself, on a flat fp64 copy of every token a rollout committed:
a query of the chunk covering ``[s, e)`` sees the tokens ``t < e`` with ``t < S`` or
``t >= e - W``. Chunks are 3 "frames" of 2 tokens (``slab_tokens`` 6); image-to-video
rollouts start with a 1-frame chunk 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import DEVICE, assert_close, gpu_test, one_torch_thread  # noqa: F401 - autouse fixture

from kvarena.cache.arena import KVLayout
from kvarena.cache.keys import CachePolicy
from kvarena.cache.slab import SlabKVCache

ST = 6  # slab_tokens: a 3-frame chunk of 2-token frames
H_Q, H_KV, D, LAYERS = 4, 2, 16, 2


def _pool(per: dict, slots: int = 16, *, training: bool = False, dtype=torch.float64, device="cpu") -> SlabKVCache:
    lay = KVLayout(num_layers=LAYERS, num_kv_heads=H_KV, head_dim=D, dtype=dtype)
    policy = CachePolicy("slab_kv", lay.block_bytes(ST) * slots, per_component=per,
                         training_mode_disables_recycle=training)
    return SlabKVCache(policy, layout=lay, slab_tokens=ST, device=device)


def _dense(q, k, v):
    """fp64 full attention of ``q [n, H_q, D]`` over ``k, v [L, H_kv, D]``."""
    g = q.shape[1] // k.shape[1]
    kd, vd = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kd) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vd)


def _rule(q, keys, values, s: int, e: int, S: int, W: int | None):  # noqa: N803
    """The issue's rule on flat per-token K/V of the rollout (``keys [>= e, H_kv, D]``)."""
    t = torch.arange(e)
    vis = (t < S) | (t >= e - W) if W is not None else torch.ones(e, dtype=torch.bool)
    return _dense(q, keys[:e][vis], values[:e][vis])


def _bounds(n0: int, c: int) -> tuple[int, int]:
    return (0, n0) if c == 0 else (n0 + (c - 1) * ST, n0 + c * ST)


class Truth:
    """Flat fp64 K/V of every committed token, per layer."""

    def __init__(self) -> None:
        self.k = [torch.zeros(0, H_KV, D, dtype=torch.float64) for _ in range(LAYERS)]
        self.v = [torch.zeros(0, H_KV, D, dtype=torch.float64) for _ in range(LAYERS)]

    def with_run(self, layer: int, s: int, k: torch.Tensor, v: torch.Tensor):
        """Keys/values as they are once tokens ``s ..`` are ``k, v`` (not stored)."""
        e = s + k.shape[0]
        kk = torch.cat([self.k[layer][:s], k.double(), self.k[layer][e:]])
        vv = torch.cat([self.v[layer][:s], v.double(), self.v[layer][e:]])
        return kk, vv

    def commit(self, layer: int, s: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer], self.v[layer] = self.with_run(layer, s, k, v)


def _step(pool, truth, ns, batch_spec, n0, chunks, S, W, *, commit, backend=None, dtype=torch.float64, what=""):  # noqa: N803
    """Plan one step of one rollout, run every layer, check against the rule; returns outputs."""
    meta = pool.plan({ns: batch_spec})
    t = meta.n_tokens
    s0 = _bounds(n0, chunks[0])[0]
    opts = {} if backend is None else {"backend": backend}
    outs = []
    for layer in range(LAYERS):
        q = torch.randn(1, t, H_Q, D, dtype=dtype)
        k, v = torch.randn(1, t, H_KV, D, dtype=dtype), torch.randn(1, t, H_KV, D, dtype=dtype)
        out = pool.forward(q.to(pool.device), k.to(pool.device), v.to(pool.device), meta, layer, commit=commit, **opts)
        keys, values = truth.with_run(layer, s0, k[0], v[0])
        for c in chunks:
            s, e = _bounds(n0, c)
            ref = _rule(q[0, s - s0 : e - s0], keys, values, s, e, S, W)
            assert_close(out[0, s - s0 : e - s0], ref, dtype, f"{what} chunk {c} layer {layer} commit={commit}")
        if commit:
            truth.commit(layer, s0, k[0], v[0])
        outs.append(out)
    return meta, outs


def _kept(pool, ns) -> dict:
    return {s.chunk_index: (s.k.data_ptr(), s.k.clone(), s.v.clone()) for s in pool.get(ns)}


# (n0, S, W): chunk 0's length, sink tokens, window tokens (None: unbounded)
TOKEN_RULES = [
    pytest.param(2, 2, 10, id="i2v-1f-chunk0-sink1f-window5f"),
    pytest.param(6, 2, 8, id="sink1f-window4f"),
    pytest.param(2, 4, 13, id="i2v-sink2f-window13tok"),  # page size 1: nothing aligns
    pytest.param(6, 0, 7, id="no-sink-window7tok"),
    pytest.param(4, 9, 12, id="sink-past-chunk1-window2chunks"),
    pytest.param(2, 3, None, id="sinks-unbounded-window"),
]


@pytest.mark.parametrize("n0, S, W", TOKEN_RULES)
def test_token_rollout_matches_the_rule_and_stays_bounded(seed, n0, S, W) -> None:  # noqa: N803
    """10 chunks: a denoising step then the clean pass per chunk, both against the rule;
    slab count bounded by ceil(S/T) + ceil(W/T) + 2, retained slabs never move."""
    pool = _pool({"sink_tokens": S} if W is None else {"sink_tokens": S, "window_tokens": W})
    truth = Truth()
    bound = math.ceil(S / ST) + (math.ceil(W / ST) if W is not None else 99) + 2
    most = 0
    for c in range(10):
        before = _kept(pool, "a")
        spec = (0, n0) if c == 0 else c
        for commit in (False, True):
            _step(pool, truth, "a", spec, n0, [c], S, W, commit=commit, what=f"n0={n0} S={S} W={W}")
        held = pool.chunk_indices("a")
        most = max(most, len(held))
        assert len(held) <= bound, f"chunk {c}: {len(held)} slabs > bound {bound}"
        assert pool.used_bytes == len(held) * pool.slab_bytes
        assert held == pool.visible_chunks(c, "a"), f"chunk {c}: holds {held}, sees {pool.visible_chunks(c, 'a')}"
        for i, (ptr, k, v) in before.items():
            if i in held:
                now = next(s for s in pool.get("a") if s.chunk_index == i)
                assert now.k.data_ptr() == ptr and torch.equal(now.k, k) and torch.equal(now.v, v), (
                    f"retained chunk {i} moved or changed at chunk {c}")
    if W is not None:  # the sizing helper gives exactly the most slabs the rollout held
        assert pool.slabs_per_rollout(n0) == most


def test_whole_chunk_tokens_equal_the_chunk_policy(seed) -> None:
    """sink_tokens = n * T and window_tokens = m * T is exactly {"sinks": n, "window": m}."""
    by_chunks, by_tokens = _pool({"sinks": 1, "window": 2}), _pool({"sink_tokens": ST, "window_tokens": 2 * ST})
    for c in range(6):
        m1, m2 = by_chunks.plan({"a": c}), by_tokens.plan({"a": c})
        assert m1.page_tokens == m2.page_tokens == ST
        for layer in range(LAYERS):
            q, k, v = torch.randn(1, ST, H_Q, D, dtype=torch.float64), *torch.randn(2, 1, ST, H_KV, D, dtype=torch.float64)
            assert torch.equal(by_chunks.forward(q, k, v, m1, layer), by_tokens.forward(q, k, v, m2, layer))
        assert by_chunks.chunk_indices("a") == by_tokens.chunk_indices("a")


def test_visible_chunks_and_pages_of_an_i2v_sink() -> None:
    pool = _pool({"sink_tokens": 2, "window_tokens": 10})
    for c in range(6):
        meta = pool.plan({"a": (0, 2)} if c == 0 else {"a": c})
    # chunk 5 covers tokens [26, 32): window [22, 32) = chunks 4 and 5, sink [0, 2) = chunk 0
    assert pool.visible_chunks(5, "a") == [0, 4, 5] and pool.chunk_indices("a") == [0, 4, 5]
    # the sink ends and the window starts on 2-token pages: 1 sink page + 1 + 3 window pages
    assert meta.page_tokens == 2 and meta.seq_lens.tolist() == [12] and meta.kv_start.tolist() == [0]


# ---------------------------------------------------------------------------------------
# multi-chunk steps
def _one_by_one(pool, truth, ns, n0, chunks, kv, S, W):  # noqa: N803
    """Plan and commit ``chunks`` one at a time with the run's q/k/v; returns per-layer outputs."""
    outs = [[] for _ in range(LAYERS)]
    for c in chunks:
        s, e = _bounds(n0, c)
        meta = pool.plan({ns: (0, n0) if c == 0 else c})
        for layer in range(LAYERS):
            q, k, v = (x[:, s - kv["s0"] : e - kv["s0"]] for x in kv[layer])
            outs[layer].append(pool.forward(q, k, v, meta, layer))
            truth.commit(layer, s, k[0], v[0])
    return [torch.cat(o, 1) for o in outs]


def _run(pool, truth, ns, spec, n0, chunks, kv, *, commit):
    meta = pool.plan({ns: spec})
    outs = []
    for layer in range(LAYERS):
        q, k, v = kv[layer]
        outs.append(pool.forward(q, k, v, meta, layer, commit=commit))
        if commit:
            truth.commit(layer, kv["s0"], k[0], v[0])
    return meta, outs


def _run_kv(n0, chunks):
    s0, e = _bounds(n0, chunks[0])[0], _bounds(n0, chunks[-1])[1]
    kv = {"s0": s0}
    for layer in range(LAYERS):
        kv[layer] = tuple(torch.randn(1, e - s0, h, D, dtype=torch.float64) for h in (H_Q, H_KV, H_KV))
    return kv


@pytest.mark.parametrize(
    "per, n0, schedule",
    [
        pytest.param({"sink_tokens": 2, "window_tokens": 10}, 2, [range(0, 3), range(3, 5), range(5, 6), range(6, 9)],
                     id="i2v-tokens"),
        pytest.param({"sinks": 1, "window": 2}, 6, [range(0, 4), range(4, 5), range(5, 8)], id="chunks-runs-past-window"),
        pytest.param({"sink_tokens": 3, "window_tokens": 7}, 4, [range(0, 1), range(1, 5), range(5, 7)], id="odd-tokens"),
    ],
)
def test_multi_chunk_steps_equal_one_by_one(seed, per, n0, schedule) -> None:
    """Each run: commit=False (nothing written) == commit=True == planning and committing its
    chunks one by one; afterwards the same chunks are held with the same bytes."""
    run_pool, ref_pool = _pool(per), _pool(per)
    run_truth, ref_truth = Truth(), Truth()
    for chunks in schedule:
        chunks = list(chunks)
        n_run = sum(_bounds(n0, c)[1] - _bounds(n0, c)[0] for c in chunks)
        spec = (range(chunks[0], chunks[-1] + 1), n_run) if chunks[0] == 0 else range(chunks[0], chunks[-1] + 1)
        kv = _run_kv(n0, chunks)
        arena = run_pool.arena.buffer.clone()
        _m, noisy = _run(run_pool, run_truth, "a", spec, n0, chunks, kv, commit=False)
        assert torch.equal(run_pool.arena.buffer, arena), "commit=False wrote into the arena"
        meta, clean = _run(run_pool, run_truth, "a", spec, n0, chunks, kv, commit=True)
        ref = _one_by_one(ref_pool, ref_truth, "a", n0, chunks, kv, None, None)
        for layer in range(LAYERS):
            assert_close(noisy[layer], ref[layer].double(), torch.float64, f"run {chunks} layer {layer} commit=False")
            assert_close(clean[layer], ref[layer].double(), torch.float64, f"run {chunks} layer {layer} commit=True")
        assert meta.chunk_ranges == (range(chunks[0], chunks[-1] + 1),) and meta.num_chunks == len(chunks)
        assert run_pool.chunk_indices("a") == ref_pool.chunk_indices("a")
        for s1, s2 in zip(run_pool.get("a"), ref_pool.get("a"), strict=True):
            assert torch.equal(s1.k, s2.k) and torch.equal(s1.v, s2.v), f"chunk {s1.chunk_index} differs"
    if "window" in per:  # a run needs at most sinks + window + (c1 - c0) - 1 slabs
        assert run_pool.used_bytes <= (per["sinks"] + per["window"] + 2) * run_pool.slab_bytes
    run_pool.plan({"a": schedule[-1][-1]})  # the next plan frees the slabs only the run read
    assert run_pool.used_bytes == ref_pool.used_bytes


def test_recache_rewrites_resident_chunks_in_place(seed) -> None:
    """LongLive-style recache: the resident chunks go through the model again in ONE step,
    rewritten in place (no slab moves), equal to re-planning them one by one."""
    per = {"sink_tokens": 2, "window_tokens": 24}
    run_pool, ref_pool = _pool(per), _pool(per)
    run_truth, ref_truth = Truth(), Truth()
    for pool, truth in ((run_pool, run_truth), (ref_pool, ref_truth)):
        _one_by_one(pool, truth, "a", 6, range(3), _run_kv(6, [0, 1, 2]), None, None)
    ptrs = {s.chunk_index: s.k.data_ptr() for s in run_pool.get("a")}
    kv = _run_kv(6, [0, 1, 2])
    _m, outs = _run(run_pool, run_truth, "a", range(0, 3), 6, [0, 1, 2], kv, commit=True)
    ref = _one_by_one(ref_pool, ref_truth, "a", 6, [0, 1, 2], kv, None, None)
    for layer in range(LAYERS):
        assert_close(outs[layer], ref[layer].double(), torch.float64, f"recache layer {layer}")
    assert {s.chunk_index: s.k.data_ptr() for s in run_pool.get("a")} == ptrs
    for s1, s2 in zip(run_pool.get("a"), ref_pool.get("a"), strict=True):
        assert torch.equal(s1.k, s2.k)


def test_multi_chunk_gradients_match_the_rule(seed) -> None:
    """commit=False over a 3-chunk run: gradients reach q, k, v across chunks (fp64)."""
    S, W, n0 = 2, 10, 2  # noqa: N806
    pool, truth = _pool({"sink_tokens": S, "window_tokens": W}), Truth()
    _one_by_one(pool, truth, "a", n0, [0, 1], _run_kv(n0, [0, 1]), None, None)
    chunks = [2, 3, 4]
    meta = pool.plan({"a": range(2, 5)})
    t = meta.n_tokens
    q, k, v = (torch.randn(1, t, h, D, dtype=torch.float64, requires_grad=True) for h in (H_Q, H_KV, H_KV))
    w = torch.randn(1, t, H_Q, D, dtype=torch.float64)
    out = pool.forward(q, k, v, meta, 1, commit=False)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    s0 = _bounds(n0, chunks[0])[0]
    keys, values = truth.with_run(1, s0, k[0], v[0])
    ref = torch.cat([_rule(q[0, _bounds(n0, c)[0] - s0 : _bounds(n0, c)[1] - s0], keys, values, *_bounds(n0, c), S, W)
                     for c in chunks])
    ref_grads = torch.autograd.grad((ref * w[0]).sum(), (q, k, v))
    assert_close(out[0], ref.detach(), torch.float64, "output")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, torch.float64, f"d/d{name}")


def test_multi_chunk_under_grad_names_the_backend() -> None:
    """The Triton backward gives no gradient through a run's given k/v read as pages."""
    pool = _pool({"sink_tokens": 2, "window_tokens": 12}, dtype=torch.float32)
    meta = pool.plan({"a": range(0, 2)})
    q = torch.randn(1, 2 * ST, H_Q, D, requires_grad=True)
    k = torch.randn(1, 2 * ST, H_KV, D)
    with pytest.raises(ValueError, match="backend: 'triton' has no backward.*multi-chunk"):
        pool.forward(q, k, k, meta, 0, commit=False, backend="triton")


def test_short_window_run_retires_then_frees(seed) -> None:
    """A run longer than the window keeps the slabs only it reads until the next plan."""
    pool = _pool({"sinks": 0, "window": 1}, slots=6)
    pool.plan({"a": range(0, 4)})
    assert pool.chunk_indices("a") == [3] and pool.used_bytes == 4 * pool.slab_bytes
    stale = pool.plan({"a": range(0, 4)[-1:]})
    assert pool.used_bytes == pool.slab_bytes
    del stale


@pytest.mark.parametrize(
    "per, batch, exc, match",
    [
        pytest.param({"sinks": 1, "window_tokens": 12}, None, ValueError, "cannot be mixed", id="mixed-forms"),
        pytest.param({"sink_tokens": 1, "window_tokens": ST - 1}, None, ValueError, "window_tokens.*>= slab_tokens",
                     id="window-shorter-than-a-chunk"),
        pytest.param({"sink_tokens": -1}, None, ValueError, "sink_tokens", id="negative-sinks"),
        pytest.param({"sink_tokens": 2}, {"a": range(0, 4, 2)}, ValueError, "consecutive", id="range-step"),
        pytest.param({"sink_tokens": 2}, {"a": range(1, 3)}, ValueError, "next new chunk of this namespace is 0",
                     id="run-skips-ahead"),
        pytest.param({"sink_tokens": 2}, {"a": (range(0, 3), 30)}, ValueError, "expected 13 to 18", id="run-too-long"),
        pytest.param({"sink_tokens": 2}, {"a": range(0, 3), "b": 0}, ValueError, "one T", id="mixed-T"),
    ],
)
def test_token_policy_and_run_errors(per, batch, exc, match) -> None:
    if batch is None:
        with pytest.raises(exc, match=match):
            _pool(per)
        return
    pool = _pool(per)
    with pytest.raises(exc, match=match):
        pool.plan(batch)
    assert pool.used_bytes == 0 and pool.chunk_indices("a") == []


def test_hundred_chunk_rollout_is_bounded_and_never_moves(seed) -> None:
    S, W, n0 = 2, 10, 2  # noqa: N806
    pool = _pool({"sink_tokens": S, "window_tokens": W}, slots=6)
    bound = math.ceil(S / ST) + math.ceil(W / ST) + 2
    first = {}
    for c in range(100):
        meta = pool.plan({"a": (0, n0) if c == 0 else c})
        k = torch.full((1, meta.n_tokens, H_KV, D), float(c), dtype=torch.float64)
        pool.forward(k.repeat(1, 1, H_Q // H_KV, 1), k, k, meta, 0)
        held = pool.get("a")
        assert len(held) <= bound and pool.used_bytes <= bound * pool.slab_bytes
        for s in held:
            ptr = first.setdefault(s.chunk_index, s.k.data_ptr())
            assert s.k.data_ptr() == ptr and bool((s.k[0] == s.chunk_index).all()), f"chunk {s.chunk_index} moved"


@gpu_test
def test_token_rules_and_runs_on_the_triton_path(seed) -> None:
    """Pages of 2 tokens, an I2V sink and a 2-chunk run through the Triton kernels (interpreted)."""
    S, W, n0 = 2, 10, 2  # noqa: N806
    dtype = torch.float32
    pool, truth = _pool({"sink_tokens": S, "window_tokens": W}, dtype=dtype, device=DEVICE), Truth()
    _step(pool, truth, "a", (range(0, 2), n0 + ST), n0, [0, 1], S, W, commit=True, backend="triton", dtype=dtype,
          what="triton run")
    for c in (2, 3, 4):
        for commit in (False, True):
            _step(pool, truth, "a", c, n0, [c], S, W, commit=commit, backend="triton", dtype=dtype, what="triton")
    _step(pool, truth, "a", range(5, 7), n0, [5, 6], S, W, commit=False, backend="triton", dtype=dtype,
          what="triton run")


def test_restore_frees_the_slabs_a_later_run_retired() -> None:
    """A run past the window retires slabs; restoring a snapshot taken before it frees them
    (they belong to the abandoned timeline), and clearing frees everything."""
    pool = _pool({"sinks": 1, "window": 1})
    pool.plan({"a": 0})
    snap = pool.snapshot("a")
    pool.plan({"a": range(1, 4)})  # retires chunks 1 and 2
    assert pool.used_bytes == 4 * pool.slab_bytes
    pool.restore("a", snap)
    assert pool.used_bytes == pool.slab_bytes and pool.chunk_indices("a") == [0]
    pool.plan({"a": range(1, 4)})
    pool.plan({"a": 3})  # releases the run's retired slabs
    assert pool.used_bytes == 2 * pool.slab_bytes
    pool.clear_namespace("a")
    assert pool.used_bytes == 0
