"""Triton store_kv and merge kernels vs their oracles (interpreter on CPU, real kernels on CUDA)."""

from __future__ import annotations

import pytest
import torch
from _covering import DTYPES, LAYOUT, covering_array, uncovered
from _helpers import DEVICE, GPU, MERGE_LSE_TOL, MERGE_TOL, assert_close, assert_lse_close

from kvarena.attention import merge_attention_states, store_kv
from kvarena.attention.reference import merge_attention_states_ref, store_kv_ref

pytestmark = [*GPU]


def _arena_views(num_blocks, block_size, h_kv, d, dtype):
    """Per-layer K/V views of an arena [blocks, layers=3, k/v, block_size, H_kv, D], NaN-filled."""
    arena = torch.full((num_blocks, 3, 2, block_size, h_kv, d), float("nan"), dtype=dtype, device=DEVICE)
    return arena, arena[:, 2, 0], arena[:, 2, 1]


# The store's grid, drawn from the shared covering array (tests/_covering.py) over the
# suites' layout factors: every triple of (dtype, slot dtype, head_dim) and of (dtype, slot
# dtype, block_size), every head_dim x block_size pair, and every combination the former
# grid (dtype x slot dtype x three tied (head_dim, block_size) pairs) held, in its 18 rows.
_SLOT_DTYPES = {"i32": torch.int32, "i64": torch.int64}
_STORE_FACTORS = {"dtype": LAYOUT["dtype"], "slot_dtype": list(_SLOT_DTYPES), "head_dim": LAYOUT["head_dim"],
                  "block_size": LAYOUT["block_size"]}
_STORE_TRIPLES = [["dtype", "slot_dtype", "head_dim"], ["dtype", "slot_dtype", "block_size"]]
_FORMER = list(zip(LAYOUT["head_dim"], LAYOUT["block_size"]))
_STORE_ALSO = [{"dtype": d, "head_dim": h, "block_size": b} for d in LAYOUT["dtype"] for h, b in _FORMER] + [
    {"slot_dtype": s, "head_dim": h, "block_size": b} for s in _SLOT_DTYPES for h, b in _FORMER]
STORE_GRID = covering_array(_STORE_FACTORS, _STORE_TRIPLES, seed=46, also=_STORE_ALSO)
assert not uncovered(STORE_GRID, _STORE_FACTORS, _STORE_TRIPLES, also=_STORE_ALSO) and len(STORE_GRID) == 18


@pytest.mark.parametrize(("dtype", "slot_dtype", "head_dim", "block_size"), [
    pytest.param(DTYPES[r["dtype"]], _SLOT_DTYPES[r["slot_dtype"]], r["head_dim"], r["block_size"],
                 id=f"{r['dtype']}-{r['slot_dtype']}-d{r['head_dim']}-bs{r['block_size']}") for r in STORE_GRID])
def test_store_kv_matches_reference(dtype, slot_dtype, head_dim, block_size, seed):
    h_kv, n = 3, 29
    num_blocks = 7
    arena, k_cache, v_cache = _arena_views(num_blocks, block_size, h_kv, head_dim, dtype)
    ref_arena, ref_k, ref_v = _arena_views(num_blocks, block_size, h_kv, head_dim, dtype)
    # k/v as strided views (head slice of a wider projection output).
    kv_buf = torch.randn(n, 2, h_kv + 2, head_dim, device=DEVICE).to(dtype)
    k, v = kv_buf[:, 0, 1:1 + h_kv], kv_buf[:, 1, :h_kv]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:n]
    slots[[0, 5, 17, n - 1]] = -1  # skipped rows (padding of a CUDA-graph batch)
    slots = slots.to(slot_dtype)
    store_kv(k, v, k_cache, v_cache, slots, backend="triton")
    store_kv_ref(k, v, ref_k, ref_v, slots)
    assert torch.equal(arena.isnan(), ref_arena.isnan()), "a skipped or foreign slot was written (or one was missed)"
    ok = ~arena.isnan()
    assert torch.equal(arena[ok], ref_arena[ok]), f"max abs err {(arena[ok].float() - ref_arena[ok].float()).abs().max()}"


def test_store_kv_all_skipped_and_empty(seed):
    arena, k_cache, v_cache = _arena_views(3, 16, 1, 32, torch.float16)
    before = arena.clone()
    k = torch.randn(4, 1, 32, device=DEVICE).half()
    store_kv(k, k, k_cache, v_cache, torch.full((4,), -1, dtype=torch.int64, device=DEVICE), backend="triton")
    store_kv(k[:0], k[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int32, device=DEVICE), backend="triton")
    assert torch.equal(arena.isnan(), before.isnan())


def _merge_inputs(n, h, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    out_a = torch.randn(n, h, d, generator=gen).to(dtype)
    out_b = torch.randn(n, h, d, generator=gen).to(dtype)
    lse_a = torch.randn(n, h, generator=gen) * 3
    lse_b = torch.randn(n, h, generator=gen) * 3
    # Empty parts (lse = -inf) carry garbage outs: NaN must not leak.
    lse_a[0], lse_b[1] = float("-inf"), float("-inf")
    lse_a[2, 0] = lse_b[2, 0] = float("-inf")  # both empty -> 0, -inf
    lse_a[3, :], lse_b[3, :] = 80.0, -80.0  # widely different scales
    out_a[0], out_b[1], out_a[2, 0], out_b[2, 0] = float("nan"), float("nan"), float("nan"), float("inf")
    return [t.to(DEVICE) for t in (out_a, lse_a, out_b, lse_b)]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("d", LAYOUT["head_dim"])
def test_merge_matches_reference(dtype, d):
    out_a, lse_a, out_b, lse_b = _merge_inputs(11, 3, d, dtype, seed=d)
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b, backend="triton")
    ref_out, ref_lse = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # NaN (garbage of an empty part leaking) fails; the merge's stricter bounds (_helpers).
    assert_close(out, ref_out, dtype, f"merge d={d}", tol=MERGE_TOL[dtype])
    assert_lse_close(lse, ref_lse, dtype, f"merge d={d}", tol=MERGE_LSE_TOL[dtype])
    assert torch.equal(out[2, 0], torch.zeros_like(out[2, 0]))


@pytest.mark.parametrize("scale", [6e-39, 1.0], ids=["subnormal", "normal"])
def test_merge_bf16_subnormal_and_rounding(scale):
    """Issue 41 sweep (the #9 pattern): the interpreter widened bf16 parts with a plain cast
    (wrong below 2**-126) and narrowed the result by truncation; subnormal parts came out
    ~100% off. Each element within one bf16 ulp of the oracle (2**-133 for subnormals: the
    relative-norm check alone cannot see values this small), NaN where it has NaN."""
    out_a, lse_a, out_b, lse_b = _merge_inputs(13, 3, 40, torch.float32, seed=5)
    out_a, out_b = (out_a * scale).bfloat16(), (out_b * scale).bfloat16()
    if scale < 1:
        live = out_a[out_a.isfinite() & (out_a != 0)]
        assert (live.abs() < 2.0**-126).float().mean() > 0.5, "the parts are not mostly subnormal"
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b, backend="triton")
    ref_out, _ = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    assert_close(out, ref_out, torch.bfloat16, f"merge x{scale}", tol=MERGE_TOL[torch.bfloat16])
    g, r = out.double().cpu(), ref_out.double().cpu()
    ulp = torch.maximum(r.abs() * 2.0**-7, torch.full_like(r, 2.0**-133))
    wrong = ((g - r).abs() > ulp) & ~(g.isnan() & r.isnan()) & ~(g == r)
    assert not wrong.any(), (f"{int(wrong.sum())} elements more than one bf16 ulp off, e.g. got "
                             f"{g[wrong][:3].tolist()}, ref {r[wrong][:3].tolist()}")


def test_merge_strided_and_fp64_lse():
    """Transposed/strided inputs and fp64 lse (allowed by the op) are read correctly."""
    out_a, lse_a, out_b, lse_b = _merge_inputs(7, 5, 48, torch.float32, seed=3)
    out_a_t = out_a.transpose(0, 1).contiguous().transpose(0, 1)  # [N, H, D] with stride(0) = D
    lse_b_t = lse_b.t().contiguous().t()
    out, lse = merge_attention_states(out_a_t, lse_a.double(), out_b, lse_b_t, backend="triton")
    ref_out, ref_lse = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)  # elementwise: each strided read
    assert_lse_close(lse, ref_lse, torch.float32, "strided merge", tol=MERGE_LSE_TOL[torch.float32])
