"""The caches inside a model forward: sync-free per-layer path, CUDA-graph buffers, torch.compile."""

from __future__ import annotations

import pytest
import torch

from kvarena import CachePolicy, KVLayout, PagedKVCache, SlabKVCache
from kvarena.attention.reference import paged_attention_ref

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def _paged(device="cpu", **kw):
    policy = CachePolicy("paged_kv", max_bytes=64 * LAYOUT.block_bytes(16))
    return PagedKVCache(policy, layout=LAYOUT, block_size=16, device=device, **kw)


def _slab(device="cpu", slab_tokens=5):
    policy = CachePolicy("slab_kv", max_bytes=8 * LAYOUT.block_bytes(slab_tokens), per_component={"window": 2, "sinks": 1})
    return SlabKVCache(policy, layout=LAYOUT, slab_tokens=slab_tokens, device=device)


def test_paged_forward_is_sync_free_on_meta_device():
    """On the meta device any host read of device data (.item, .tolist, bool(t)) raises."""
    cache = _paged(device="meta")
    meta = cache.plan({"a": 5, "b": 1, "c": 17})
    q = torch.empty(23, 4, 16, device="meta")
    k = torch.empty(23, 2, 16, device="meta")
    for layer in range(LAYOUT.num_layers):
        out, lse = cache.forward(q, k, k, meta, layer, return_lse=True)
    assert out.shape == (23, 4, 16) and lse.shape == (23, 4) and out.device.type == "meta"


@pytest.mark.parametrize("commit", [False, True], ids=["denoise", "commit"])
def test_slab_forward_is_sync_free_on_meta_device(commit):
    cache = _slab(device="meta")
    meta = cache.plan({"v0/cond": 0, "v0/uncond": 0})
    q = torch.empty(2, 5, 4, 16, device="meta")
    k = torch.empty(2, 5, 2, 16, device="meta")
    for layer in range(LAYOUT.num_layers):
        out = cache.forward(q, k, k, meta, layer, commit=commit)
    assert out.shape == (2, 5, 4, 16) and out.device.type == "meta"


def test_graph_plan_buffers_stay_put_and_replay_new_metadata(seed):
    """plan(graph=True) writes into fixed buffers: a captured step could replay with new data."""
    cache = _paged(graph_capacity=(4, 8))
    ptrs = None
    for step in range(4):
        batch = {"a": 1, "b": 1} if step % 2 else {"a": 1, "b": 1, "c": 1}
        meta = cache.plan(batch, graph=True)
        now = tuple(t.data_ptr() for t in (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.cu_seqlens_q))
        ptrs = ptrs or now
        assert now == ptrs, f"step {step}: metadata buffers moved"
        q = torch.randn(meta.total_q, 4, 16)
        k = torch.randn(meta.total_q, 2, 16)
        out = cache.forward(q, k, k, meta, 0)
        assert not out.isnan().any()
        # the padded rows see nothing (out 0); the real rows equal the reference on the same metadata
        ref = paged_attention_ref(q, cache.arena[cache.region.name].k(0), cache.arena[cache.region.name].v(0),
                                  meta.block_table, meta.seq_lens, meta.cu_seqlens_q)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel <= 1e-5, f"step {step}: rel err {rel:.2e}"


def _paged_layer(cache, meta, q, k, v):
    o0 = cache.forward(q, k, v, meta, 0)
    return cache.forward(o0 * 0.5 + q, k, v, meta, 1)


def test_compile_fullgraph_paged_layer_equals_eager(seed):
    eager, comp = _paged(), _paged()
    hq, hk = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
    for c in (eager, comp):  # some history, stored in both layers
        c.arena.buffer.zero_()  # unwritten slots are torch.empty garbage: make them comparable
        m = c.plan({"a": 7, "b": 3})
        for layer in range(2):
            c.forward(hq, hk, hk * 2, m, layer)
    meta_e = eager.plan({"a": 1, "b": 1})
    meta_c = comp.plan({"a": 1, "b": 1})
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    ref = _paged_layer(eager, meta_e, q, k, k)
    fn = torch.compile(_paged_layer, fullgraph=True, backend="aot_eager")
    got = fn(comp, meta_c, q, k, k)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    region = eager.region.name
    assert torch.equal(eager.arena[region].k(1), comp.arena[region].k(1)), "compiled store_kv differs"


@pytest.mark.parametrize("commit", [False, True], ids=["denoise", "commit"])
def test_compile_fullgraph_slab_layer_equals_eager(seed, commit):
    eager, comp = _slab(), _slab()
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    for c in (eager, comp):  # commit two chunks of history first
        for chunk in range(2):
            m = c.plan({"x": chunk, "y": chunk})
            for layer in range(2):
                c.forward(q, k + chunk, k - chunk, m, layer, commit=True)
    meta_e = eager.plan({"x": 2, "y": 2})
    meta_c = comp.plan({"x": 2, "y": 2})

    def layer_fn(cache, meta, q, k, v):
        return cache.forward(q, k, v, meta, 0, commit=commit)

    ref = layer_fn(eager, meta_e, q, k, k)
    got = torch.compile(layer_fn, fullgraph=True, backend="aot_eager")(comp, meta_c, q, k, k)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_forward_rejects_non_contiguous_head_dim():
    """The kernels index head_dim with stride 1: a transposed k must be refused, not misread."""
    cache = _paged()
    meta = cache.plan({"a": 3})
    q = torch.randn(3, 4, 16)
    k_t = torch.randn(3, 16, 2).transpose(1, 2)  # [3, 2, 16] with head_dim stride 2
    with pytest.raises(ValueError, match="k: the last .head_dim. dimension must be contiguous"):
        cache.forward(q, k_t, k_t.contiguous(), meta, 0)


def test_store_kv_all_skipped_into_an_empty_cache_is_a_no_op():
    """Every slot -1 and a cache of 0 blocks: nothing to write, no index error."""
    from kvarena import store_kv

    k_cache = torch.empty(0, 4, 2, 8)
    k = torch.randn(3, 2, 8)
    store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([-1, -1, -1]))
    with pytest.raises(ValueError, match="slot_mapping: slot 0 is past the cache"):
        store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([-1, 0, -1]))


@pytest.mark.parametrize("commit", [False, True], ids=["denoise", "commit"])
def test_compile_fullgraph_token_window_pages_equal_eager(seed, commit):
    """Token sinks/windows read the arena through strided page views: they trace too."""

    def pool():
        policy = CachePolicy("slab_kv", LAYOUT.block_bytes(5) * 8, per_component={"sink_tokens": 2, "window_tokens": 7})
        return SlabKVCache(policy, layout=LAYOUT, slab_tokens=5)

    eager, comp = pool(), pool()
    q, k = torch.randn(1, 5, 4, 16), torch.randn(1, 5, 2, 16)
    for c in (eager, comp):
        for chunk in range(3):
            m = c.plan({"x": chunk})
            for layer in range(LAYOUT.num_layers):
                c.forward(q, k + chunk, k - chunk, m, layer, commit=True)
    meta_e, meta_c = eager.plan({"x": 3}), comp.plan({"x": 3})
    assert meta_c.page_tokens == 1  # gcd(5, 2, 7): one-token pages

    def layer_fn(cache, meta, q, k, v):
        return cache.forward(q, k, v, meta, 1, commit=commit)

    ref = layer_fn(eager, meta_e, q, k, k)
    got = torch.compile(layer_fn, fullgraph=True, backend="aot_eager")(comp, meta_c, q, k, k)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
