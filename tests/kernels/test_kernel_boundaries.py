"""Boundary and regression cases of the Triton kernels, each against the fp64 oracle.

The attention cases pin tiny tiles (BLOCK_M = BLOCK_N = 16) through ``_pick_config`` so
that a few dozen keys already cross several tiles: window starts exactly on / one past a
tile edge, sink and window ranges sharing one tile, kv_start inside a tile and past the
sinks, block-causal chunks whose query block is not chunk-aligned, GQA groups larger than
BLOCK_M (one position's heads split over two tiles), block sizes that do not divide the
tile (1, 3, and a 4680-token slab), split-KV with more splits than key tiles, seq_len-0
rows that own queries, loose host maxima, and strided out/lse buffers. The cases come from
the shared builder (``_helpers.paged_case``): everything the kernel must not read is NaN
and block-table padding holds out-of-range ids. Also regressions of int64 addressing:
store_kv slot ids and head_dim strides beyond 2**31.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from _helpers import (
    DEVICE,
    LSE_TOL,
    assert_attention_close,
    gpu_test,
    interpreter_test,
    paged_case,
    paged_case_ref,
)

import kvarena.kernels.attn_plan as attn_plan
import kvarena.kernels.paged_attention as pa
from kvarena.attention import AttentionSpec


@pytest.fixture
def tiny_tiles(monkeypatch):
    """BLOCK_M = BLOCK_N = 16 whatever the shape (the smallest tl.dot tile)."""
    real = attn_plan._pick_config

    def pick(*args, **kwargs):
        return dict(real(*args, **kwargs), BLOCK_M=16, BLOCK_N=16)

    monkeypatch.setattr(attn_plan, "_pick_config", pick)


# The shared case with this module's small defaults: one 16-wide kv head, 16-slot blocks.
make = functools.partial(paged_case, group=2, h_kv=1, head_dim=16, block_size=16, dtype=torch.float32, seed=0)


def check(c, *, num_splits=1, deterministic=False, strided_out=False, **opts):
    """Launch the kernel on NaN-filled outputs and compare out and lse with the fp64 oracle."""
    opts = dict(dict(causal=True, chunk_size=None, window_left=None, sink_tokens=0, softcap=None), **opts)
    ref_out, ref_lse = paged_case_ref(c, **opts)
    q = c["q"]
    t, h, d = q.shape
    if strided_out:  # out [T, H, D] and lse [T, H] as transposed views inside wider buffers
        out = torch.full((h, t + 1, d + 3), float("nan"), dtype=q.dtype, device=DEVICE)[:, 1:, 2:2 + d].transpose(0, 1)
        lse = torch.full((h, t + 2), float("nan"), device=DEVICE)[:, 2:].t()
    else:
        out = torch.full_like(q, float("nan"))
        lse = torch.full((t, h), float("nan"), device=DEVICE)
    pa.paged_attention_fwd(
        q, c["k_cache"], c["v_cache"], c["block_table"], c["seq_lens"], c["cu_seqlens_q"], c["kv_start"],
        out, lse, spec=AttentionSpec(num_splits=num_splits, deterministic=deterministic, **opts),
        max_seqlen_q=c["max_seqlen_q"], max_seqlen_k=c["max_seqlen_k"],
    )
    # NaN fails (a row not written, or a poisoned slot read); rows that see no key are 0 and
    # -inf. lse is held to the fp32 bound whatever the input dtype: its scores are fp32 dot
    # products of the exact inputs, scaled after the dot.
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype,
                           f"{opts} num_splits={num_splits}", lse_tol=LSE_TOL[torch.float32])
    return out, lse


# ------------------------------------------------------------------- masks at tile edges

# One sequence of 70 keys with 9 queries (positions 61..69): key tiles [0,16) .. [64,80).
_MASKS = {
    # p - window_left lands exactly on a tile start for p = 64 (48) and one past it for 65
    "window_on_tile_edge": dict(window_left=16),
    "window_0_self_only": dict(window_left=0),
    # sinks end inside the first tile, the window of the first rows starts in that tile
    # too: the sink and window phases visit one tile twice, each with its own key range
    "sinks_and_window_share_a_tile": dict(window_left=55, sink_tokens=5),
    # sinks reach past the window start: the overlap must not be counted twice
    "sinks_overlap_window": dict(window_left=20, sink_tokens=50),
    # block-causal: queries 61..69 are not chunk-aligned (chunk 8: 56..63 | 64..71)
    "chunk_not_aligned": dict(chunk_size=8),
    "chunk_window_sinks": dict(chunk_size=5, window_left=13, sink_tokens=3),
    "full_window_sinks_softcap": dict(causal=False, window_left=9, sink_tokens=17, softcap=1.5),
}


@gpu_test
@pytest.mark.parametrize("name", list(_MASKS))
def test_masks_at_tile_edges(name, tiny_tiles):
    c = make([70, 19, 0], [9, 4, 2], group=3, seed=1)  # + a seq_len-0 row that owns 2 queries
    check(c, **_MASKS[name])


@gpu_test
@pytest.mark.parametrize("kv_start", [[7, 0, 0], [21, 19, 0], [66, 3, 0]],
                         ids=["past_sinks", "inside_tile_and_all_hidden", "inside_window"])
def test_kv_start(kv_start, tiny_tiles):
    """kv_start past the sinks, inside a key tile, hiding a whole sequence, inside the window."""
    c = make([70, 19, 0], [9, 4, 2], kv_start=kv_start, group=3, seed=2)
    check(c, window_left=12, sink_tokens=5)
    check(c, chunk_size=4)


# ------------------------------------------------------------------- GQA packing and blocks


@gpu_test
@pytest.mark.parametrize("group,h_kv,q_lens", [(17, 1, [3, 1]), (3, 2, [7, 6]), (5, 1, [4, 1])],
                         ids=["group_gt_block_m", "partial_last_tile", "rows_not_multiple"])
def test_gqa_packing(group, h_kv, q_lens, tiny_tiles):
    """q_len * group not a multiple of BLOCK_M; a group of 17 spreads one position over 2 tiles."""
    c = make([40, 23], q_lens, group=group, h_kv=h_kv, seed=3)
    check(c, window_left=30, sink_tokens=2)
    c["max_seqlen_q"] += 5  # loose host maximum (CUDA-graph capacity): extra tiles exit
    c["max_seqlen_k"] += 9
    check(c, strided_out=True)


@gpu_test
@pytest.mark.parametrize("block_size", [1, 3])
def test_block_size_not_dividing_tile(block_size, tiny_tiles):
    c = make([37, 5], [6, 5], group=2, h_kv=2, block_size=block_size, seed=4)
    check(c, chunk_size=3, window_left=10, sink_tokens=4)


@gpu_test
def test_slab_block_straddled_by_tiles(tiny_tiles):
    """A 4680-token slab (4680 % 16 = 8): the tiles around the block edge straddle it."""
    c = make([4700], [20], kv_start=[2], group=2, block_size=4680, seed=5)
    opts = dict(window_left=30, sink_tokens=4)
    out1, lse1 = check(c, **opts)
    out3, lse3 = check(c, num_splits=3, **opts)
    assert torch.allclose(out1, out3, atol=1e-6) and torch.allclose(lse1, lse3, atol=1e-6)


# ------------------------------------------------------------------- split-KV


@gpu_test
def test_splits_beyond_key_tiles(tiny_tiles):
    """More splits than tiles: most splits are empty (lse -inf) for every row; no NaN."""
    c = make([50, 3, 0, 20], [2, 3, 1, 1], kv_start=[0, 0, 0, 20], group=2, seed=6)
    for n in (2, 5, 50):
        check(c, num_splits=n, window_left=7, sink_tokens=2)
        check(c, num_splits=n, strided_out=True)


@gpu_test
def test_deterministic_with_empty_rows(tiny_tiles, monkeypatch):
    """Fixed 16-key splits with a seq_len-0 row and a hidden one; batch-invariant bitwise."""
    monkeypatch.setattr(attn_plan, "_DET_SPLIT_KEYS", 16)
    c = make([60, 0, 5, 90], [3, 2, 1, 1], kv_start=[4, 0, 5, 0], group=2, seed=7)
    opts = dict(window_left=25, sink_tokens=6)
    out, lse = check(c, deterministic=True, **opts)
    # The first sequence alone: 5 splits instead of the batch's 7 (the 90-key sequence).
    alone = dict(c, q=c["q"][:3], block_table=c["block_table"][:1], seq_lens=c["seq_lens"][:1],
                 cu_seqlens_q=c["cu_seqlens_q"][:2], kv_start=c["kv_start"][:1], max_seqlen_q=3, max_seqlen_k=60)
    out1, lse1 = check(alone, deterministic=True, **opts)
    assert torch.equal(out1, out[:3]) and torch.equal(lse1, lse[:3])


# ------------------------------------------------------------------- numerics


@gpu_test
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # tanh saturating
def test_fp16_scores_beyond_fp16_range(tiny_tiles):
    """|q.k| > 65504 (fp16's max): the dot accumulates in fp32 and the scale comes after."""
    c = make([33, 9], [3, 2], group=2, dtype=torch.float16, q_scale=100.0, kv_scale=100.0, seed=8)
    keys = c["k_cache"][c["block_table"][0, :3].long()].flatten(0, 1)[:33, 0].float()  # [33, D]
    assert (c["q"][:3, 0].float() @ keys.T).abs().max() > 65504
    check(c, window_left=20)
    check(c, softcap=30.0, num_splits=2)  # saturated tanh: +-softcap, finite, no NaN


# ------------------------------------------------------------------- store_kv


@gpu_test
def test_store_kv_slot_ids_beyond_int32():
    """int64 slot ids >= 2**31 address block 1 (not a negative, skipped slot).

    Calls the kernel's launcher: the public op rejects this aliasing cache (stride 0), which
    is only a way to get 2**32 slots out of 3 * D elements."""
    from kvarena.kernels.store import store_kv_fwd

    d = 8
    buf = torch.full((3 * d,), float("nan"), dtype=torch.float16, device=DEVICE)
    # [2 blocks, 2**31 rows, 1 head, D]: every row of a block aliases one D-vector (stride 0),
    # so a cache of 2**32 slots costs 3 * D elements.
    k_cache = buf.as_strided((2, 2**31, 1, d), (d, 0, d, 1))
    v_cache = buf.as_strided((2, 2**31, 1, d), (d, 0, d, 1), storage_offset=d)
    k = torch.arange(d, dtype=torch.float16, device=DEVICE).view(1, 1, d)
    slots = torch.tensor([2**31 + 5], dtype=torch.int64, device=DEVICE)
    store_kv_fwd(k, k + 100, k_cache, v_cache, slots)
    assert torch.equal(buf[d:2 * d], k.flatten()), "k row of block 1"
    assert torch.equal(buf[2 * d:], (k + 100).flatten()), "v row of block 1"
    assert buf[:d].isnan().all(), "block 0 was written: the slot id was truncated"


# ------------------------------------------------------------------- head_dim strides

_HUGE_D_STRIDE = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
import kvarena.kernels.attn_plan as attn_plan
import kvarena.kernels.paged_attention as pa
from kvarena.attention import AttentionSpec, merge_attention_states
from kvarena.attention.reference import merge_attention_states_ref, paged_attention_ref

D = 16
S = 2**31 // (D - 1) + 1024  # head_dim stride: (D - 1) * S > 2**31


def far(n, h):  # [n, h, D] with a head_dim stride of S, in a lazily backed ~4 GiB buffer
    return torch.empty(D * S + n * h, dtype=torch.float16).as_strided((n, h, D), (h, 1, S))

a = far(2, 1)
a.copy_(torch.randn(2, 1, D))
b, la, lb = torch.randn(2, 1, D).half(), torch.randn(2, 1), torch.randn(2, 1)
out, lse = merge_attention_states(a, la, b, lb, backend="triton")
ref, _ = merge_attention_states_ref(a, la, b, lb)
assert (out.float() - ref.float()).abs().max() < 1e-2, "merge"

kc, vc = torch.randn(13, 16, 1, D).half(), torch.randn(13, 16, 1, D).half()
table, lens = torch.arange(13, dtype=torch.int32)[None], torch.tensor([200], dtype=torch.int32)
cu, q = torch.tensor([0, 1], dtype=torch.int32), torch.randn(1, 1, D).half()
ref = paged_attention_ref(q.double(), kc.double(), vc.double(), table, lens, cu)
out = far(1, 1)
pa.paged_attention_fwd(q, kc, vc, table, lens, cu, None, out, None, spec=AttentionSpec(num_splits=2),
                       max_seqlen_q=1, max_seqlen_k=200)  # 200 keys: >= 2 key tiles, so a split reduce writes out
assert (out.double() - ref).abs().max() < 1e-2, "split reduce"
print("OK")
"""


@interpreter_test
@pytest.mark.skipif(DEVICE != "cpu", reason="a 4 GiB lazily backed buffer is a CPU-lane trick")
def test_head_dim_stride_beyond_int32():
    """merge inputs/outputs and the split-reduce output with D * stride(2) > 2**31 elements.

    A subprocess: before the fix the int32 offset wrapped and the interpreter crashed.
    """
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _HUGE_D_STRIDE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, f"rc {res.returncode}: {res.stdout}{res.stderr[-2000:]}"


# ------------------------------------------------------------------- large-block contiguous path


@gpu_test
@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_large_blocks_not_a_tile_multiple(num_splits, tiny_tiles, launched):
    """Slab-like launches (non-causal, kv_start) over 70-row blocks (70 = 4 x 16 + 6): the
    block-outer loop with masked edge tiles and an unmasked interior run, split 1/3/7 ways
    (a split boundary can fall inside a block)."""
    c = make([170, 71, 5], [9, 3, 5], kv_start=[13, 0, 2], group=2, h_kv=2, block_size=70, seed=11,
             dtype=torch.bfloat16)  # fp32 keeps the page path; 170 = 2 x 70 + 30 keys
    check(c, causal=False, num_splits=num_splits)
    check(c, causal=False, num_splits=num_splits, softcap=3.0)
    assert launched and all(m["LARGE_BLOCKS"] for m in launched), "the launch did not take the large-block path"


@gpu_test
@pytest.mark.parametrize("num_splits", [1, 4])
def test_large_blocks_pipelined_interior_loop(num_splits, monkeypatch, launched):
    """64-key tiles take the software-pipelined interior loop (tile j's softmax beside tile
    j + 1's Q.K^T): 330-row slabs (5 x 64 + 10), D = 24 padded to 32, GQA 3, kv_start, the
    lean slab launch (no softcap), split 1 and 4 ways (a split may start mid-run)."""
    real = attn_plan._pick_config
    monkeypatch.setattr(attn_plan, "_pick_config", lambda *a, **k: dict(real(*a, **k), BLOCK_M=64, BLOCK_N=64))
    c = make([1000, 331, 70], [7, 5, 3], kv_start=[11, 0, 2], group=3, h_kv=2, head_dim=24, block_size=330,
             seed=26, dtype=torch.bfloat16)
    check(c, causal=False, num_splits=num_splits)
    assert launched and all(m["LARGE_BLOCKS"] for m in launched), "the launch did not take the large-block path"


@gpu_test
@pytest.mark.parametrize(("window_left", "sink_tokens"), [(100, 75), (150, 3), (0, 0), (69, 140)])
def test_large_blocks_windows_and_sinks_crossing_block_edges(window_left, sink_tokens, tiny_tiles, launched):
    """Decode rows (one position per sequence, no guard) with windows and sink ranges that
    start, end and cross inside 70-row blocks."""
    c = make([300, 150, 1, 71], [1, 1, 1, 1], group=4, h_kv=1, block_size=70, seed=12, dtype=torch.float16)
    for n in (1, 4):
        check(c, causal=True, window_left=window_left, sink_tokens=sink_tokens, num_splits=n)
    assert launched and all(m["LARGE_BLOCKS"] for m in launched)


@gpu_test
def test_deterministic_mode_keeps_one_path_whatever_the_batch(tiny_tiles, launched, monkeypatch):
    """A decode row alone could take the large-block path, batched with a causal multi-row
    sequence the page path (the guard depends on the batch): the two tile orders would round
    differently on a GPU. Deterministic mode therefore always takes the page path, and a
    sequence's result is bitwise the same alone and in a batch."""
    monkeypatch.setattr(attn_plan, "_DET_SPLIT_KEYS", 48)  # 3 tiles per split
    big = make([300, 140], [1, 6], group=2, block_size=70, seed=13, dtype=torch.bfloat16)
    out_big, lse_big = check(big, causal=True, deterministic=True)
    alone = dict(big, q=big["q"][:1], block_table=big["block_table"][:1], seq_lens=big["seq_lens"][:1],
                 cu_seqlens_q=big["cu_seqlens_q"][:2], kv_start=None, max_seqlen_q=1)
    out_alone, lse_alone = check(alone, causal=True, deterministic=True)
    assert torch.equal(out_big[:1], out_alone) and torch.equal(lse_big[:1], lse_alone)
    assert launched and not any(m["LARGE_BLOCKS"] for m in launched), "deterministic launches must not take the large-block path"


# ------------------------------------------------------------------- one launch for a denoising step


@gpu_test
def test_denoising_step_is_one_launch_over_history_and_own_keys(monkeypatch):
    """commit=False on the Triton path: the cached history and the given k/v are two key
    sources of ONE launch (no partial outputs, no merge). Checked against the torch path
    over a rollout with a short first chunk (kv_start), sinks and recycling, with splits."""
    from kvarena import CachePolicy, KVLayout, SlabKVCache
    from kvarena.attention import dispatch

    launches = []
    real = dispatch.launch_triton

    def spy(*args, **kwargs):
        launches.append(kwargs.get("own") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "launch_triton", spy)
    st = 70  # slab rows >= BLOCK_N: the large-block path
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
    pool = SlabKVCache(CachePolicy("slab_kv", lay.block_bytes(st) * 6, per_component={"window": 2, "sinks": 1}),
                       layout=lay, slab_tokens=st, device=DEVICE)
    gen = torch.Generator().manual_seed(14)

    def rnd(t, h):
        return torch.randn(1, t, h, 16, generator=gen).to(DEVICE, torch.bfloat16)

    for c, n in ((0, 40), (1, st), (2, st), (3, st)):
        meta = pool.plan({"v": (c, n)})
        q, k, v = rnd(n, 2), rnd(n, 1), rnd(n, 1)
        for splits in (None, 3):
            launches.clear()
            got, lse = pool.forward(q, k, v, meta, 0, commit=False, backend="triton", num_splits=splits,
                                    return_lse=True)
            assert launches == [True], f"chunk {c}: launches with own k/v: {launches}"
            want, want_lse = pool.forward(q, k, v, meta, 0, commit=False, backend="torch", return_lse=True)
            assert_attention_close(got.float()[0], lse[0], want.float()[0], want_lse[0], torch.bfloat16,
                                   f"chunk {c} splits {splits}", lse_tol=LSE_TOL[torch.float32])
        pool.forward(q, k, v, meta, 0, commit=True, backend="torch")


@interpreter_test
def test_flash_reference_yardstick_is_attention():
    """The contiguous loop `kvarena check --perf` compares against computes attention."""
    from kvarena.kernels.flash_reference import flash_reference_fwd

    gen = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(n, 16, generator=gen) for n in (32, 48, 48))
    out = torch.empty_like(q)
    flash_reference_fwd(q, k, v, out)
    ref = torch.softmax((q.double() @ k.double().T) * 16**-0.5, -1) @ v.double()
    assert (out.double() - ref).abs().max() < 1e-5


@interpreter_test
def test_flash_reference_yardstick_with_fp8_keys_is_attention():
    """Its fp8 form (the yardstick of fp8 caches' loops): attention over the stored values,
    fp16 queries and probabilities, per-key scales."""
    from kvarena.kernels.flash_reference import flash_reference_fwd

    gen = torch.Generator().manual_seed(16)
    q = torch.randn(32, 16, generator=gen).half()
    k8, v8 = (torch.randn(48, 16, generator=gen).clamp(-8, 8).to(torch.float8_e4m3fn) for _ in range(2))
    ks, vs = (torch.rand(48, generator=gen) + 0.5 for _ in range(2))
    out = torch.empty_like(q)
    flash_reference_fwd(q, k8, v8, out, k_scale=ks, v_scale=vs)
    kd, vd = k8.double() * ks.double()[:, None], v8.double() * vs.double()[:, None]
    ref = torch.softmax((q.double() @ kd.T) * 16**-0.5, -1) @ vd
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-3, f"relative error {err:.2e} (fp16)"
