"""Learned sink logits (gpt-oss's ``s_aux``): one logit per query head that joins the
softmax denominator as a key of value 0, in every path (torch, CPU fast path, Triton
unsplit and split-KV) and in the backward.

The oracle is written here: per sequence, the visible scores (kv_start, causal, window)
in fp64 with one extra column holding the head's sink logit, softmax over both, the sink
column dropped before ``@ V``; lse over both.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import DEVICE, assert_close, assert_lse_close, gpu_test, one_torch_thread, paged_case  # noqa: F401

import kvarena
from kvarena import paged_attention


def _oracle(case: dict, sink: torch.Tensor, *, causal=True, window_left=None, scale=None):
    """On the CPU whatever the case's device (autograd reaches the case's q through .cpu())."""
    q, k_cache, v_cache = case["q"].cpu(), case["k_cache"].cpu(), case["v_cache"].cpu()
    table, lens, sink = case["block_table"].cpu(), case["seq_lens"].tolist(), sink.cpu()
    cu = case["cu_seqlens_q"].tolist() if case["cu_seqlens_q"] is not None else list(range(len(lens) + 1))
    starts = case["kv_start"].tolist() if case["kv_start"] is not None else [0] * len(lens)
    h_q, d = q.shape[1], q.shape[2]
    bs, h_kv = k_cache.shape[1], k_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    outs, lses = [], []
    for b, n in enumerate(lens):
        qs = q[cu[b] : cu[b + 1]].double()
        rows = [(int(table[b, t // bs]), t % bs) for t in range(n)]
        k = torch.stack([k_cache[i, r] for i, r in rows]).double() if rows else torch.zeros(0, h_kv, d).double()
        v = torch.stack([v_cache[i, r] for i, r in rows]).double() if rows else torch.zeros(0, h_kv, d).double()
        g = h_q // h_kv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        k, v = torch.nan_to_num(k), torch.nan_to_num(v)  # masked slots: never weighted
        s = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [H, q, L]
        p = torch.arange(n - qs.shape[0], n)[:, None]
        t = torch.arange(n)[None, :]
        vis = t >= starts[b]
        if causal:
            vis = vis & (t <= p)
        if window_left is not None:
            vis = vis & (t >= p - window_left)
        s = s.masked_fill(~vis[None], float("-inf"))
        col = sink.double()[:, None, None].expand(h_q, qs.shape[0], 1)
        full = torch.cat([s, col], -1)
        lse = torch.logsumexp(full, -1)  # [H, q]
        w = torch.exp(full - lse[..., None])[..., :n]
        outs.append(torch.einsum("hqk,khd->qhd", w, v))
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


CASES = [
    # lens, q_lens, group, block_size, window_left, kv_start
    pytest.param([17, 1, 100], [1, 1, 1], 4, 16, None, None, id="decode-gqa4-bs16"),
    pytest.param([33, 5], [1, 1], 5, 48, None, [3, 0], id="decode-gqa5-bs48-kvstart"),
    pytest.param([17, 30], [17, 6], 1, 7, 9, None, id="prefill-window-gqa1-bs7"),
    pytest.param([0, 12], [1, 4], 4, 16, None, None, id="empty-sequence"),
]


def _sink(h_q: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(h_q, dtype=dtype) * 2.0


@pytest.mark.parametrize("lens, q_lens, group, block_size, window_left, kv_start", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_torch_path_matches_oracle(seed, lens, q_lens, group, block_size, window_left, kv_start, dtype) -> None:
    case = paged_case(lens, q_lens, dtype=dtype, group=group, h_kv=2, head_dim=16, block_size=block_size,
                      seed=seed, kv_start=kv_start)
    h_q = case["q"].shape[1]
    sink = _sink(h_q, torch.float64 if dtype == torch.float64 else torch.float32)
    out, lse = paged_attention(**case, window_left=window_left, sink_logits=sink, return_lse=True, backend="torch")
    ref, ref_lse = _oracle(case, sink, window_left=window_left)
    assert_close(out, ref, dtype, "out")
    assert_lse_close(lse, ref_lse, dtype, "lse")


@gpu_test
@pytest.mark.parametrize("num_splits", [1, 3], ids=["unsplit", "split3"])
@pytest.mark.parametrize("lens, q_lens, group, block_size, window_left, kv_start", CASES)
def test_triton_matches_oracle(seed, lens, q_lens, group, block_size, window_left, kv_start, num_splits) -> None:
    case = paged_case(lens, q_lens, dtype=torch.float32, group=group, h_kv=2, head_dim=16, block_size=block_size,
                      seed=seed, kv_start=kv_start)
    sink = _sink(case["q"].shape[1]).to(DEVICE)
    out, lse = paged_attention(**case, window_left=window_left, sink_logits=sink, return_lse=True, backend="triton",
                               num_splits=num_splits)
    ref, ref_lse = _oracle(case, sink, window_left=window_left)
    assert_close(out, ref, torch.float32, f"out ({num_splits} splits)")
    assert_lse_close(lse, ref_lse, torch.float32, f"lse ({num_splits} splits)")


def test_sink_changes_the_result_and_minus_inf_is_no_sink(seed) -> None:
    """Mutation control: a finite sink moves every row; a -inf sink is exactly no sink."""
    case = paged_case([20, 9], [1, 1], dtype=torch.float64, group=2, h_kv=2, head_dim=16, block_size=8, seed=seed)
    plain = paged_attention(**case, backend="torch")
    none = paged_attention(**case, backend="torch", sink_logits=torch.full((4,), float("-inf"), dtype=torch.float64))
    some = paged_attention(**case, backend="torch", sink_logits=torch.zeros(4, dtype=torch.float64))
    assert torch.equal(plain, none)
    assert ((some - plain).abs().amax(-1) > 1e-6).all()


def test_gradients_reach_the_sink_on_the_torch_path(seed) -> None:
    case = paged_case([13, 6], [3, 1], dtype=torch.float64, group=2, h_kv=2, head_dim=16, block_size=5, seed=seed)
    q = case.pop("q").clone().requires_grad_()
    sink = _sink(4, torch.float64).requires_grad_()
    w = torch.randn(q.shape, dtype=torch.float64)
    out = paged_attention(q, **case, sink_logits=sink)
    got = torch.autograd.grad((out * w).sum(), (q, sink))
    ref, _ = _oracle(dict(case, q=q), sink)
    want = torch.autograd.grad((ref * w).sum(), (q, sink))
    for name, g, r in zip(("q", "sink_logits"), got, want):
        assert_close(g, r, torch.float64, f"d/d{name}")


@gpu_test
def test_triton_backward_with_fixed_sinks(seed) -> None:
    """The Triton backward reads the forward's lse, which includes the sink: dq exact."""
    case = paged_case([13, 6], [3, 2], dtype=torch.float32, group=2, h_kv=2, head_dim=16, block_size=5, seed=seed)
    q = case.pop("q").clone().requires_grad_()
    sink = _sink(4).to(DEVICE)
    w = torch.randn(q.shape).to(DEVICE)
    out = paged_attention(q, **case, sink_logits=sink, backend="triton")
    (dq,) = torch.autograd.grad((out * w).sum(), (q,))
    ref, _ = _oracle(dict(case, q=q), sink)
    (want,) = torch.autograd.grad((ref * w.cpu().double()).sum(), (q,))
    assert_close(dq, want, torch.float32, "dq")
    with pytest.raises(ValueError, match="backend: 'triton' has no backward.*sink_logits"):
        paged_attention(q, **case, sink_logits=sink.clone().requires_grad_(), backend="triton")


@pytest.mark.parametrize(
    "sink, exc, match",
    [
        pytest.param(torch.zeros(3), ValueError, "one logit per query head \\(4\\)", id="wrong-length"),
        pytest.param(torch.zeros(4, 1), ValueError, "1-D float32", id="2-d"),
        pytest.param(torch.zeros(4, dtype=torch.float16), ValueError, "1-D float32", id="fp16"),
        pytest.param(torch.zeros(4, dtype=torch.float64), TypeError, "expected torch.float32", id="fp64-for-fp32-q"),
        pytest.param([0.0] * 4, TypeError, "sink_logits", id="a-list"),
    ],
)
def test_bad_sink_logits_name_the_argument(sink, exc, match) -> None:
    case = paged_case([5], [1], dtype=torch.float32, group=2, h_kv=2, head_dim=16, block_size=4, seed=0)
    with pytest.raises(exc, match=match):
        paged_attention(**case, sink_logits=sink)
    assert kvarena.AttentionSpec() == kvarena.AttentionSpec(sink_logits=torch.zeros(4))  # a tensor, not a constant


def test_paged_pool_takes_sink_logits_and_the_slab_pool_refuses_them(seed) -> None:
    from kvarena import AttentionSpec, CachePolicy, KVLayout, PagedKVCache, SlabKVCache

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float64)
    sink = _sink(4, torch.float64)
    pool = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(4) * 16), layout=lay, block_size=4,
                        attention=[AttentionSpec(sink_logits=sink), AttentionSpec()])
    meta = pool.plan({"a": 6, "b": 3})
    q, k = torch.randn(9, 4, 16, dtype=torch.float64), torch.randn(9, 2, 16, dtype=torch.float64)
    with_spec = pool.forward(q, k, k, meta, 0)  # the layer's spec carries the sinks
    per_call = pool.forward(q, k, k, meta, 1, sink_logits=sink)
    plain = pool.forward(q, k, k, meta, 1)
    assert torch.allclose(with_spec, per_call, atol=1e-12) and not torch.allclose(per_call, plain, atol=1e-3)
    with pytest.raises(ValueError, match="one logit per query head"):
        pool.forward(q, k, k, meta, 1, sink_logits=sink[:3])
    slab_policy = CachePolicy("slab_kv", lay.block_bytes(4) * 4)
    with pytest.raises(ValueError, match="sink_logits: not served by the slab pool"):
        SlabKVCache(slab_policy, layout=lay, slab_tokens=4, attention=AttentionSpec(sink_logits=sink))
    slab = SlabKVCache(slab_policy, layout=lay, slab_tokens=4)
    m = slab.plan({"v": 0})
    x = torch.randn(1, 4, 2, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="sink_logits: not served by the slab pool"):
        slab.forward(x, x, x, m, 0, sink_logits=sink[:2])
