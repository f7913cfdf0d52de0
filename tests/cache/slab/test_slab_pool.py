"""SlabKVCache: seed API, planning rules, in-place recycling with sinks, commit/denoise
forward against dense attention (values and gradients), training mode, snapshot/restore,
stale/foreign metadata and bad input."""

from __future__ import annotations

import pytest
import torch
from _helpers import DEVICE, assert_close, gpu_test, one_torch_thread, run_threads  # noqa: F401 - autouse fixture

from kvarena.cache._meta import StaleMetadataError
from kvarena.cache.arena import CacheFullError, KVArena, KVLayout, RegionSpec
from kvarena.cache.keys import CachePolicy
from kvarena.cache.paged import PagedKVCache
from kvarena.cache.slab import Slab, SlabKVCache

H_Q = 4


ST = 5  # slab_tokens
SHORT = 3  # a short first chunk


def _layout(dtype=torch.float32) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype)


def _cache(slots=12, *, window=3, sinks=1, training=False, dtype=torch.float32, **kw) -> SlabKVCache:
    lay = _layout(dtype)
    per = {"window": window, "sinks": sinks}
    policy = CachePolicy("slab_kv", lay.block_bytes(ST) * slots, training_mode_disables_recycle=training, per_component=per)
    return SlabKVCache(policy, layout=lay, slab_tokens=ST, **kw)


def dense(q, k, v):
    """fp64 full (non-causal) attention of ``q [T, H_q, D]`` over ``k, v [L, H_kv, D]``."""
    g = q.shape[1] // k.shape[1]
    kd = k.double().repeat_interleave(g, dim=1)
    vd = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kd) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vd)


def visible(c: int, sinks: int, window: int) -> list[int]:
    """The test's own statement of which chunks chunk c sees (sinks, then the window)."""
    return sorted({i for i in range(c + 1) if i < sinks or i > c - window})


def _rand(b, t, h, dtype=torch.float32):
    return torch.randn(b, t, h, 16, dtype=dtype)


# ---------------------------------------------------------------------------------------
# seed API
def test_seed_style_append_materializes_and_gets_views(seed) -> None:
    lay = _layout()
    cache = SlabKVCache(CachePolicy("slab_kv", lay.block_bytes(ST) * 4, per_component={"window": 2}))
    assert cache.layout is None and cache.used_bytes == 0 and cache.get("a") == []
    assert cache.window == 2 and cache.sinks == 0 and cache.training_mode is False
    chunks = [(torch.randn(2, ST, 2, 16), torch.randn(2, ST, 2, 16)) for _ in range(3)]
    for i, (k, v) in enumerate(chunks):
        cache.append("a", Slab(i, k, v))
    assert cache.layout == lay and cache.slab_tokens == ST and cache.num_slots == 4
    got = cache.get("a")
    assert [s.chunk_index for s in got] == [1, 2]
    assert cache.used_bytes == 2 * lay.block_bytes(ST), "used_bytes counts whole slabs in use"
    base, end = cache.arena.data_ptr(), cache.arena.data_ptr() + cache.arena.nbytes
    for s in got:
        assert torch.equal(s.k, chunks[s.chunk_index][0]) and torch.equal(s.v, chunks[s.chunk_index][1])
        assert base <= s.k.data_ptr() < end, "get() must return views into the arena"
    got[0].k.zero_()
    assert torch.all(cache.get("a")[0].k == 0), "a view, not a copy"
    cache.clear_namespace("a")
    cache.clear_namespace("never")
    assert cache.get("a") == [] and cache.used_bytes == 0


def test_seed_window_default_unbounded_and_budget_enforced(seed) -> None:
    lay = _layout()
    cache = SlabKVCache(CachePolicy("slab_kv", lay.block_bytes(ST) * 2))
    assert cache.window >= 1 << 30
    k = torch.randn(2, ST, 2, 16)
    cache.append("a", Slab(0, k, k))
    cache.append("a", Slab(1, k, k))
    with pytest.raises(CacheFullError):  # the seed ignored max_bytes
        cache.append("a", Slab(2, k, k))
    assert [s.chunk_index for s in cache.get("a")] == [0, 1] and cache.free_bytes == 0


def test_sinks_are_kept_forever(seed) -> None:
    cache = _cache(window=2, sinks=1)
    ks = [torch.randn(2, ST, 2, 16) for _ in range(6)]
    cache.append("a", Slab(0, ks[0][:, :SHORT], ks[0][:, :SHORT]))
    for i in range(1, 6):
        cache.append("a", Slab(i, ks[i], ks[i]))
    got = cache.get("a")
    assert [s.chunk_index for s in got] == [0, 4, 5]
    assert got[0].k.shape == (2, SHORT, 2, 16) and torch.equal(got[0].k, ks[0][:, :SHORT])
    assert cache.used_bytes == 3 * cache.slab_bytes


def test_slab_tokens_from_policy_and_constructor_errors() -> None:
    lay = _layout()
    c = SlabKVCache(CachePolicy("slab_kv", 10_000, per_component={"slab_tokens": 7}), layout=lay)
    assert c.slab_tokens == 7
    with pytest.raises(ValueError, match="slab_tokens"):
        SlabKVCache(CachePolicy("slab_kv", 10_000), layout=lay)
    with pytest.raises(ValueError, match="block_bytes"):
        SlabKVCache(CachePolicy("slab_kv", 10_000, block_bytes=5), layout=lay, slab_tokens=4)
    with pytest.raises(TypeError, match="layout"):
        SlabKVCache(CachePolicy("slab_kv", 10_000), layout=(2, 2), slab_tokens=4)
    with pytest.raises(RuntimeError, match="layout"):
        SlabKVCache(CachePolicy("slab_kv", 10_000)).plan({"a": 0})


@pytest.mark.parametrize("key", ["windows", "sink", "sink_token"])
def test_unknown_per_component_key_names_itself(key) -> None:
    """A misspelt key used to be ignored silently ("windows": 2 gave an unbounded window)."""
    with pytest.raises(ValueError, match=f"unknown key '{key}'"):
        SlabKVCache(CachePolicy("slab_kv", 10_000, per_component={"window": 2, key: 1}), layout=_layout(),
                    slab_tokens=4)


def test_shared_arena_with_a_paged_pool(seed) -> None:
    lay, lm = _layout(), KVLayout(1, 1, 8, torch.float32)
    arena = KVArena({"slab_kv": RegionSpec(lay, ST, lay.block_bytes(ST) * 4), "paged_kv": RegionSpec(lm, 4, lm.block_bytes(4) * 8)})
    slab = SlabKVCache(CachePolicy("slab_kv", 0, per_component={"window": 2}), arena=arena)
    paged = PagedKVCache(CachePolicy("paged_kv", 0), arena=arena)
    assert slab.num_slots == 4 and slab.slab_tokens == ST and paged.total_blocks == 8
    slab.append("a", Slab(0, torch.randn(2, ST, 2, 16), torch.randn(2, ST, 2, 16)))
    paged.plan({"x": 5})
    assert arena.used_bytes == slab.used_bytes + paged.used_bytes
    with pytest.raises(ValueError, match="slab_tokens"):
        SlabKVCache(CachePolicy("slab_kv", 0), arena=arena, slab_tokens=ST + 1)


# ---------------------------------------------------------------------------------------
# planning rules
def _snap(cache: SlabKVCache):
    return (
        {ns: [(ch.index, ch.slot, ch.n_tokens, ch.committed) for ch in cache.rollout_info(ns).chunks]
         for ns in cache.namespaces()},
        cache.used_bytes,
    )


@pytest.mark.parametrize(
    "first, batch, match",
    [
        pytest.param([], {"a": 1}, "next new chunk of this namespace is 0", id="first-not-0"),
        pytest.param([{"a": 0}], {"a": 2}, "next new chunk of this namespace is 1", id="skip"),
        pytest.param([], {"a": (0, 3), "b": 0}, "one T", id="mixed-T"),
        pytest.param([], {"a": (0, ST + 1)}, "longer than a slab", id="longer-than-slab"),
        pytest.param([{"a": 0}], {"a": (1, 2)}, "only chunk 0 may be shorter", id="short-not-0"),
        pytest.param([{"a": (0, 3)}], {"a": (0, 4)}, "re-planning it with 4", id="replan-other-length"),
        pytest.param([], {"a": (0, 0)}, "n_tokens", id="zero-tokens"),
        pytest.param([], {"a": -1}, "chunk_index", id="negative-index"),
        pytest.param([], {"a": (0, 1, 2)}, "chunk_index or", id="bad-tuple"),
    ],
)
def test_plan_rejects_and_changes_nothing(first: list, batch: dict, match: str) -> None:
    cache = _cache()
    for b in first:
        cache.plan(b)
    cache.plan({"z": 0})
    before = _snap(cache)
    with pytest.raises((ValueError, TypeError), match=match):
        cache.plan({"z": 1, **batch})
    assert _snap(cache) == before, "a failed plan changed the pool"


def test_plan_rejects_empty_and_non_mapping() -> None:
    cache = _cache()
    with pytest.raises(ValueError, match="at least one"):
        cache.plan({})
    with pytest.raises(TypeError, match="batch"):
        cache.plan([("a", 0)])


def test_replanning_reuses_the_slot_and_recorded_length() -> None:
    cache = _cache()
    m1 = cache.plan({"a": (0, SHORT)})
    m2 = cache.plan({"a": 0})  # a plain index keeps the recorded length
    assert m2.n_tokens == SHORT and torch.equal(m1.slot_mapping, m2.slot_mapping)
    assert m1.kv_start.tolist() == [ST - SHORT] and m1.slot_mapping.tolist() == [2, 3, 4]
    assert cache.used_bytes == cache.slab_bytes


def test_planning_a_chunk_whose_window_was_recycled_raises() -> None:
    cache = _cache(window=2, sinks=0)
    for c in range(3):
        cache.plan({"a": c})
    assert cache.chunk_indices("a") == [1, 2]
    for c, match in ((1, r"sees chunks \[0\]"), (0, "already recycled")):
        with pytest.raises(ValueError, match=match):
            cache.plan({"a": c})
    cache.plan({"a": 2})  # its window is intact


def test_cache_full_is_all_or_nothing() -> None:
    cache = _cache(slots=3, window=4, sinks=0)
    cache.plan({"a": 0, "b": 0})
    before = _snap(cache)
    with pytest.raises(CacheFullError, match="needs 2 new slabs, only 1"):
        cache.plan({"a": 1, "b": 1})
    assert _snap(cache) == before
    cache.plan({"a": 1})


def test_recycling_is_in_place_and_moves_no_retained_bytes(seed) -> None:
    cache = _cache(window=2, sinks=1)
    for c in range(3):
        k = torch.randn(2, ST, 2, 16)
        cache.append("a", Slab(c, k, k))
    slots = {ch.index: ch.slot for ch in cache.rollout_info("a").chunks}
    kept = {s.chunk_index: s.k.clone() for s in cache.get("a")}
    ptrs = {s.chunk_index: s.k.data_ptr() for s in cache.get("a")}
    cache.append("a", Slab(3, torch.randn(2, ST, 2, 16), torch.randn(2, ST, 2, 16)))
    now = {ch.index: ch for ch in cache.rollout_info("a").chunks}
    assert list(now) == [0, 2, 3] and now[3].slot == slots[1], "the evicted chunk's slot must be reused"
    for s in cache.get("a"):
        if s.chunk_index in kept:
            assert s.k.data_ptr() == ptrs[s.chunk_index] and torch.equal(s.k, kept[s.chunk_index])


# ---------------------------------------------------------------------------------------
# the rollout
def test_long_rollout_matches_dense_attention(seed) -> None:
    """40 chunks, sinks=1, window=3, three namespaces (two CFG branches and a rollout that
    starts later), short first chunks, 3 denoising steps and a commit per chunk."""
    sinks, window, steps, n_chunks = 1, 3, 3, 40
    cache = _cache(slots=3 * (sinks + window), window=window, sinks=sinks)
    start = {"cond": 0, "uncond": 0, "late": 4}
    truth: dict = {}  # (ns, chunk, layer) -> (k, v) committed
    ptr = cache.arena.data_ptr()
    used_after_fill = None
    for tick in range(n_chunks + start["late"]):
        live = {ns: tick - s for ns, s in start.items() if 0 <= tick - s < n_chunks}
        # a short first chunk has its own T, so it goes in a batch of its own
        groups = [{ns: (0, SHORT) for ns, c in live.items() if c == 0}, {ns: c for ns, c in live.items() if c > 0}]
        for batch in (g for g in groups if g):
            t = SHORT if any(isinstance(x, tuple) for x in batch.values()) else ST
            b = len(batch)
            for step in range(steps + 1):
                commit = step == steps
                meta = cache.plan(batch)
                for layer in range(2):
                    q, k, v = _rand(b, t, H_Q), _rand(b, t, 2), _rand(b, t, 2)
                    out = cache.forward(q, k, v, meta, layer, commit=commit)
                    for row, ns in enumerate(batch):
                        c = live[ns]
                        hist = [truth[(ns, i, layer)] for i in visible(c, sinks, window) if i != c]
                        kk = torch.cat([h[0] for h in hist] + [k[row]])
                        vv = torch.cat([h[1] for h in hist] + [v[row]])
                        assert_close(out[row], dense(q[row], kk, vv), torch.float32, f"{ns} chunk {c} step {step} layer {layer} commit={commit}")
                        if commit:
                            truth[(ns, c, layer)] = (k[row].clone(), v[row].clone())
        for ns, c in live.items():
            assert [s.chunk_index for s in cache.get(ns)] == visible(c, sinks, window)
        assert cache.arena.data_ptr() == ptr, "the arena was re-allocated"
        if tick == start["late"] + sinks + window:
            used_after_fill = cache.used_bytes
        elif used_after_fill is not None and tick < n_chunks:
            assert cache.used_bytes == used_after_fill, f"memory grew at tick {tick}"
    assert used_after_fill == 3 * (sinks + window) * cache.slab_bytes


@pytest.mark.parametrize("chunk", [0, 3], ids=["first-chunk", "with-history"])
def test_denoise_gradients_match_dense_and_cache_is_untouched(seed, chunk: int) -> None:
    dtype = torch.float64
    cache = _cache(window=2, sinks=1, dtype=dtype)
    truth = {}
    for c in range(chunk):
        meta = cache.plan({"a": c})
        for layer in range(2):
            k, v = _rand(1, ST, 2, dtype), _rand(1, ST, 2, dtype)
            cache.forward(_rand(1, ST, H_Q, dtype), k, v, meta, layer)
            truth[(c, layer)] = (k[0], v[0])
    meta = cache.plan({"a": chunk})
    before = cache.arena.buffer.clone()
    q = _rand(1, ST, H_Q, dtype).requires_grad_()
    k = _rand(1, ST, 2, dtype).requires_grad_()
    v = _rand(1, ST, 2, dtype).requires_grad_()
    w = torch.randn(1, ST, H_Q, 16, dtype=dtype)
    for _recompute in range(2):  # activation-checkpoint style recompute
        out = cache.forward(q, k, v, meta, 1, commit=False)
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        hist = [truth[(i, 1)] for i in visible(chunk, 1, 2) if i != chunk]
        kk = torch.cat([h[0] for h in hist] + [k[0]])
        vv = torch.cat([h[1] for h in hist] + [v[0]])
        ref = dense(q[0], kk, vv)
        ref_grads = torch.autograd.grad((ref * w[0]).sum(), (q, k, v))
        assert_close(out[0], ref.detach(), dtype, "commit=False output")
        for name, g, rg in zip("qkv", grads, ref_grads):
            assert_close(g, rg, dtype, f"d/d{name}")
        assert torch.equal(cache.arena.buffer, before), "commit=False changed the cache"


def test_commit_writes_detached_and_returns_lse(seed) -> None:
    cache = _cache()
    meta = cache.plan({"a": 0})
    q = _rand(1, ST, H_Q).requires_grad_()
    k = _rand(1, ST, 2).requires_grad_()
    out, lse = cache.forward(q, k, k.detach() * 2, meta, 0, return_lse=True)
    assert lse.shape == (1, ST, H_Q) and lse.dtype == torch.float32
    assert out.requires_grad and not cache.arena.buffer.requires_grad
    out.sum().backward()
    # The stored copy is detached; the given k is this chunk's keys and gets a gradient
    # (tests/attention/test_spec_and_checks.py checks its value against the commit=False path).
    assert q.grad is not None and k.grad is not None and not cache.arena.buffer.requires_grad


def test_uncommitted_history_raises(seed) -> None:
    cache = _cache(window=3, sinks=0)
    m0 = cache.plan({"a": 0})
    cache.forward(_rand(1, ST, H_Q), _rand(1, ST, 2), _rand(1, ST, 2), m0, 0)  # layer 0 only
    m1 = cache.plan({"a": 1})
    cache.forward(_rand(1, ST, H_Q), _rand(1, ST, 2), _rand(1, ST, 2), m1, 0, commit=False)
    with pytest.raises(RuntimeError, match="chunk 0 of namespace 'a'.*never committed at layer 1"):
        cache.forward(_rand(1, ST, H_Q), _rand(1, ST, 2), _rand(1, ST, 2), m1, 1, commit=False)


def test_stale_and_foreign_metadata() -> None:
    cache = _cache(window=2, sinks=0)
    x = (_rand(1, ST, H_Q), _rand(1, ST, 2), _rand(1, ST, 2))
    for c in range(2):
        m = cache.plan({"a": c})
        for layer in range(2):
            cache.forward(*x, m, layer)
    old = cache.plan({"a": 1})
    cache.plan({"a": 2})  # recycles chunk 0's slab
    with pytest.raises(StaleMetadataError, match="'a'"):
        cache.forward(*x, old, 0, commit=False)
    other = _cache()
    with pytest.raises(ValueError, match="another SlabKVCache"):
        other.forward(*x, cache.plan({"a": 2}), 0)
    with pytest.raises(TypeError, match="meta"):
        cache.forward(*x, None, 0)
    cache.clear_namespace("a")
    with pytest.raises(StaleMetadataError):
        cache.forward(*x, m, 0)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        pytest.param(dict(layer=2), ValueError, "layer", id="layer-out-of-range"),
        pytest.param(dict(q=_rand(1, ST + 1, H_Q)), ValueError, "q", id="q-T"),
        pytest.param(dict(q=_rand(2, ST, H_Q)), ValueError, "q", id="q-B"),
        pytest.param(dict(q=_rand(1, ST, 3)), ValueError, "H_q", id="q-heads"),
        pytest.param(dict(k=_rand(1, ST, 1)), ValueError, "k", id="k-heads"),
        pytest.param(dict(k=torch.randn(1, ST, 2, 8)), ValueError, "k", id="k-head-dim"),
        pytest.param(dict(v=_rand(1, ST, 2, torch.float16)), TypeError, "v", id="v-dtype"),
        pytest.param(dict(q=torch.randn(1, ST, H_Q, 16, device="meta")), ValueError, "q.*device", id="q-device"),
        pytest.param(dict(commit=1), TypeError, "commit", id="commit-not-bool"),
        pytest.param(dict(kv_start=None), TypeError, "kv_start", id="reserved-kwarg"),
    ],
)
def test_forward_bad_input_leaves_cache_unchanged(seed, change: dict, exc: type, match: str) -> None:
    cache = _cache()
    meta = cache.plan({"a": 0})
    args = dict(q=_rand(1, ST, H_Q), k=_rand(1, ST, 2), v=_rand(1, ST, 2), layer=0)
    extra = {key: change.pop(key) for key in list(change) if key not in args}
    args.update(change)
    before = cache.arena.buffer.clone()
    with pytest.raises(exc, match=match):
        cache.forward(args["q"], args["k"], args["v"], meta, args["layer"], **extra)
    assert torch.equal(cache.arena.buffer, before)
    assert not any(cache.rollout_info("a").chunks[0].committed)


@pytest.mark.parametrize(
    "k, exc, match",
    [
        pytest.param(torch.randn(3, ST, 2, 16), ValueError, "slab.k", id="layers"),
        pytest.param(torch.randn(2, ST, 1, 16), ValueError, "slab.k", id="heads"),
        pytest.param(torch.randn(2, ST, 2, 8), ValueError, "slab.k", id="head-dim"),
        pytest.param(torch.randn(2, ST, 2, 16, dtype=torch.float64), TypeError, "slab.k", id="dtype"),
        pytest.param(torch.randn(2, ST, 2, 16, device="meta"), ValueError, "slab.k.*device", id="device"),
        pytest.param(torch.randn(2, ST + 1, 2, 16), ValueError, "longer than a slab", id="too-long"),
        pytest.param(torch.randn(ST, 2, 16), ValueError, "slab.k", id="ndim"),
    ],
)
def test_append_bad_input_leaves_cache_unchanged(k, exc: type, match: str) -> None:
    cache = _cache()
    cache.append("a", Slab(0, torch.randn(2, ST, 2, 16), torch.randn(2, ST, 2, 16)))
    before = (_snap(cache), cache.arena.buffer.clone())
    with pytest.raises(exc, match=match):
        cache.append("a", Slab(1, k, k))
    assert _snap(cache) == before[0] and torch.equal(cache.arena.buffer, before[1])


# ---------------------------------------------------------------------------------------
# training mode, snapshot / restore
def test_training_mode_keeps_every_slab_with_inference_visibility(seed) -> None:
    cache = _cache(slots=6, window=2, sinks=1, training=True)
    truth = {}
    for c in range(6):
        meta = cache.plan({"a": c} if c else {"a": (0, SHORT)})
        t = meta.n_tokens
        q, k, v = _rand(1, t, H_Q), _rand(1, t, 2), _rand(1, t, 2)
        out = cache.forward(q, k, v, meta, 0)
        cache.forward(q, k, v, meta, 1)
        truth[c] = (k[0], v[0])
        vis = visible(c, 1, 2)
        ref = dense(q[0], torch.cat([truth[i][0] for i in vis]), torch.cat([truth[i][1] for i in vis]))
        assert_close(out[0], ref, torch.float32, f"training chunk {c}")
    assert [s.chunk_index for s in cache.get("a")] == list(range(6))
    before = _snap(cache)
    with pytest.raises(CacheFullError):
        cache.plan({"a": 6})
    assert _snap(cache) == before
    cache.plan({"a": 1})  # an old chunk can be recomputed: nothing was recycled


def _run_chunk(cache, c, kv, *, recompute: bool) -> None:
    batch = {"a": (0, SHORT)} if c == 0 else {"a": c}
    snap = cache.snapshot("a") if recompute and "a" in cache else None
    for attempt in range(2 if recompute else 1):
        for _step in range(2):  # denoising steps re-plan the same chunk
            meta = cache.plan(batch)
            for layer in range(2):
                cache.forward(kv[c][0], kv[c][1], kv[c][2], meta, layer, commit=False)
        meta = cache.plan(batch)
        for layer in range(2):
            cache.forward(kv[c][0], kv[c][1], kv[c][2], meta, layer)
        if recompute and attempt == 0:
            if snap is None:
                cache.clear_namespace("a")
            else:
                cache.restore("a", snap)


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_snapshot_restore_and_replanning_equal_a_single_pass(seed, training: bool) -> None:
    n = 5 if training else 4  # inference: a fifth chunk recycles one the snapshot holds
    kv = {}
    for c in range(n):
        t = SHORT if c == 0 else ST
        kv[c] = (_rand(1, t, H_Q), _rand(1, t, 2), _rand(1, t, 2))
    single, replayed = _cache(slots=6, training=training), _cache(slots=6, training=training)
    for c in range(n):
        _run_chunk(single, c, kv, recompute=False)
        _run_chunk(replayed, c, kv, recompute=True)
        assert _snap(single) == _snap(replayed), f"state differs after chunk {c}"
        for s1, s2 in zip(single.get("a"), replayed.get("a"), strict=True):
            assert torch.equal(s1.k, s2.k) and torch.equal(s1.v, s2.v), f"chunk {s1.chunk_index} differs after chunk {c}"


def test_snapshot_restore_errors() -> None:
    cache = _cache(window=2, sinks=0)
    with pytest.raises(KeyError):
        cache.snapshot("a")
    cache.plan({"a": 0})
    cache.plan({"b": 0})
    snap = cache.snapshot("a")
    with pytest.raises(KeyError):
        cache.restore("zz", snap)
    with pytest.raises(ValueError, match="snap"):
        cache.restore("b", snap)
    with pytest.raises(TypeError, match="snap"):
        cache.restore("a", object())
    cache.plan({"a": 1})
    cache.plan({"a": 2})  # recycles chunk 0, which the snapshot holds
    before = _snap(cache)
    with pytest.raises(ValueError, match="chunk 0 .* recycled"):
        cache.restore("a", snap)
    assert _snap(cache) == before
    snap2 = cache.snapshot("a")
    cache.restore("a", snap2)  # nothing claimed since: a no-op
    assert _snap(cache) == before and cache.chunk_indices("a") == [1, 2]


def test_plan_and_forward_never_read_device_data() -> None:
    """On the meta device every .item()/.tolist()/bool() of a tensor raises: plan and both
    forward modes running there prove they never synchronize with the device."""
    cache = _cache(window=2, sinks=1, device="meta")
    for c in range(5):
        meta = cache.plan({"x": (0, SHORT), "y": (0, SHORT)} if c == 0 else {"x": c, "y": c})
        t = meta.n_tokens
        for commit in (False, True):
            for layer in range(2):
                q = torch.empty(2, t, H_Q, 16, device="meta")
                kv = torch.empty(2, t, 2, 16, device="meta")
                out = cache.forward(q, kv, kv, meta, layer, commit=commit)
                assert out.device.type == "meta" and out.shape == (2, t, H_Q, 16)


def test_concurrent_rollouts_from_threads(seed) -> None:
    cache = _cache(slots=4 * 3, window=2, sinks=1)

    def worker(i: int) -> None:
        k = torch.randn(2, ST, 2, 16)
        for rep in range(3):
            ns = f"r{i}"
            for c in range(8):
                cache.append(ns, Slab(c, k, k))
                assert [s.chunk_index for s in cache.get(ns)] == visible(c, 1, 2)
            if rep < 2:
                cache.clear_namespace(ns)

    errors = run_threads(worker, 4)
    assert not errors, errors
    assert cache.used_bytes == 4 * 3 * cache.slab_bytes and cache.free_bytes == 0


def test_failed_first_append_makes_no_arena() -> None:
    cache = SlabKVCache(CachePolicy("slab_kv", 1 << 20), device="meta")
    k = torch.randn(2, ST, 2, 16)  # on the CPU, while the pool was told "meta"
    with pytest.raises(ValueError, match="slab.k.*device"):
        cache.append("a", Slab(0, k, k))
    assert cache.arena is None and cache.layout is None and cache.slab_tokens is None
    with pytest.raises(ValueError, match="next new chunk"):
        SlabKVCache(CachePolicy("slab_kv", 1 << 20)).append("a", Slab(1, k, k))
    fine = SlabKVCache(CachePolicy("slab_kv", 1 << 20))
    fine.append("a", Slab(0, k[:, :SHORT], k[:, :SHORT]))
    assert fine.slab_tokens == SHORT  # no slab_tokens in the policy: the first chunk's length


@gpu_test
def test_rollout_on_the_triton_path(seed) -> None:
    """Slab metadata (kv_start of a short chunk 0, empty history, sinks + window) through the
    Triton kernels (interpreted on CPU) equals dense attention."""
    cache = _cache(window=2, sinks=1, device=DEVICE)
    truth = {}
    for c in range(4):
        meta = cache.plan({"a": (0, SHORT)} if c == 0 else {"a": c})
        t = meta.n_tokens
        for commit in (False, True):
            q, k, v = _rand(1, t, H_Q), _rand(1, t, 2), _rand(1, t, 2)
            out = cache.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), meta, 0, commit=commit, backend="triton")
            hist = [truth[i] for i in visible(c, 1, 2) if i != c]
            ref = dense(q[0], torch.cat([h[0] for h in hist] + [k[0]]), torch.cat([h[1] for h in hist] + [v[0]]))
            assert_close(out[0], ref, torch.float32, f"triton chunk {c} commit={commit}")
            if commit:
                truth[c] = (k[0], v[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_short_rollout_per_dtype(seed, dtype) -> None:
    cache = _cache(window=2, sinks=1, dtype=dtype)
    truth = {}
    for c in range(5):
        meta = cache.plan({"a": (0, SHORT), "b": (0, SHORT)} if c == 0 else {"a": c, "b": c})
        t = meta.n_tokens
        for commit in (False, True):
            q, k, v = _rand(2, t, H_Q, dtype), _rand(2, t, 2, dtype), _rand(2, t, 2, dtype)
            out = cache.forward(q, k, v, meta, 1, commit=commit)
            assert out.dtype == dtype
            for row, ns in enumerate("ab"):
                hist = [truth[(ns, i)] for i in visible(c, 1, 2) if i != c]
                ref = dense(q[row], torch.cat([h[0] for h in hist] + [k[row]]), torch.cat([h[1] for h in hist] + [v[row]]))
                assert_close(out[row], ref, dtype, f"{ns} chunk {c} commit={commit}")
                if commit:
                    truth[(ns, c)] = (k[row], v[row])
