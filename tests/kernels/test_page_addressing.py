"""The page path's key addressing, against the fp64 oracle (Triton interpreter lane).

The page loop reads each key through its page's block-table entry: keys outside a tile's
key range read the range's nearest key (a written slot) and are masked out of the scores,
power-of-two pages take shifts, K and V share one offset per key when their strides agree,
and the offsets are int32 unless the cache spans more than 2**31 elements. Each case names
the addressing it must have been launched with (read from the launch's constexprs), so a
change of dispatch cannot leave a variant untested. Everything the kernel must not read
is NaN (``paged_case``) and table padding holds far out-of-range ids.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _helpers import (
    DEVICE,
    LSE_TOL,
    assert_attention_close,
    interpreter_test,
    paged_case,
    paged_case_ref,
)

import kvarena.kernels.attn_plan as attn_plan
import kvarena.kernels.paged_attention as pa
from kvarena.attention import AttentionSpec


def run(c, *, num_splits, **opts):
    """The kernel's (out, lse) on a case, checked against the fp64 oracle."""
    spec = dict(dict(causal=True, window_left=None, sink_tokens=0, softcap=None), **opts)
    ref_out, ref_lse = paged_case_ref(c, **spec)
    q = c["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    pa.paged_attention_fwd(
        q, c["k_cache"], c["v_cache"], c["block_table"], c["seq_lens"], c["cu_seqlens_q"], c["kv_start"], out, lse,
        spec=AttentionSpec(num_splits=num_splits, **spec), max_seqlen_q=c["max_seqlen_q"],
        max_seqlen_k=c["max_seqlen_k"],
    )
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, f"{opts} num_splits={num_splits}",
                           lse_tol=LSE_TOL[torch.float32])


# (id, block size, dtype, the PAGE_SIZE constexpr it must launch with): pages of one token,
# the pool's 16, 32 at fp16 (two pages per 64-key tile, each page's id broadcast to its
# keys), 48 (not a power of two: tiles straddle pages and divide at run time) and 64 at
# fp32 (a page as long as two of fp32's 32-key decode tiles).
PAGES = [
    pytest.param(1, torch.float32, 1, id="page1-fp32"),
    pytest.param(16, torch.bfloat16, 16, id="page16-bf16"),
    pytest.param(32, torch.float16, 32, id="page32-fp16"),
    pytest.param(48, torch.float32, 0, id="page48-straddling-fp32"),
    pytest.param(64, torch.float32, 64, id="page64-fp32"),
]
# (id, query lengths, mask options, split counts): decode (unsplit, 3 splits, 9: more splits
# than the 4-7 key tiles of a 200-key row) and a 6-query chunked-prefill step; sinks and a
# window whose edges fall inside pages; kv_start inside a page. (fp16 and the other combinations run in
# test_paged_attention's grid over 16- and 48-token pages.)
STEPS = [
    ("decode", [1, 1, 1], {}, (1, 3, 9)),
    ("decode-window-sinks", [1, 1, 1], dict(window_left=45, sink_tokens=3), (9,)),
    ("prefill-chunk", [6, 1, 6], {}, (3,)),
]
# The 6-query chunk (the slowest in the interpreter) on the pool's pages and the straddling 48 only.
CASES = [pytest.param(bs, dt, page, q_lens, opts, n, id=f"{name}-{n}-splits-{pid}")
         for name, q_lens, opts, splits in STEPS for n in splits
         for (bs, dt, page), pid in ((p.values, p.id) for p in PAGES)
         if name != "prefill-chunk" or pid in ("page16-bf16", "page48-straddling-fp32")]


@interpreter_test
@pytest.mark.parametrize(("block_size", "dtype", "page", "q_lens", "opts", "num_splits"), CASES)
def test_pages_match_the_oracle(launched, seed, block_size, dtype, page, q_lens, opts, num_splits):
    """Odd lengths (1, 77, 200 keys), GQA 4 over 2 kv heads, kv_start 5 inside a page."""
    c = paged_case([1, 77, 200], q_lens, dtype=dtype, group=4, h_kv=2, head_dim=32, block_size=block_size,
                   seed=seed, kv_start=[0, 5, 0])
    run(c, num_splits=num_splits, **opts)
    meta = launched[-1]
    assert not meta["LARGE_BLOCKS"] and meta["PAGE_SIZE"] == page, f"launched {meta}"
    assert meta["SAME_KV_STRIDES"] and not meta["WIDE_OFFSETS"], f"launched {meta}"


@interpreter_test
@pytest.mark.parametrize("group", [1, 5], ids=["mha", "gqa5"])
def test_k_and_v_with_different_strides(launched, seed, group):
    """V in its own buffer with another block stride: one offset per key no longer serves
    both, and each gets its own."""
    c = paged_case([53, 9], [1, 1], dtype=torch.float32, group=group, h_kv=1, head_dim=16, block_size=16,
                   seed=seed)
    v = c["v_cache"]
    wide = torch.full((v.shape[0], v.shape[1] + 3, *v.shape[2:]), float("nan"), dtype=v.dtype, device=DEVICE)
    wide[:, : v.shape[1]] = v
    c["v_cache"] = wide[:, : v.shape[1]]
    assert c["v_cache"].stride(0) != c["k_cache"].stride(0)
    run(c, num_splits=2)
    assert not launched[-1]["SAME_KV_STRIDES"], f"launched {launched[-1]}"


_WIDE = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
import kvarena.kernels.attn_plan as attn_plan
import kvarena.kernels.paged_attention as pa
from kvarena.attention import AttentionSpec
from kvarena.attention.reference import paged_attention_ref

torch.manual_seed(int(os.environ["SEED"]))
P, H, D = 16, 1, 16
far = 2**31 // (P * H * D) + 7  # a block id whose first element lies past 2**31
arena = torch.empty((far + 2) * P * H * D, dtype=torch.float16)  # lazily backed, ~4 GiB
k_big = arena.view(far + 2, P, H, D)
ids = [far + 1, 3, far]  # the sequence's blocks: past 2**31, near the start, past again
lens, n = torch.tensor([41], dtype=torch.int32), 41
k_small = torch.randn(3, P, H, D).half()
v_small = torch.randn(3, P, H, D).half()
v_arena = torch.empty_like(arena)
v_big = v_arena.view(far + 2, P, H, D)
for j, b in enumerate(ids):
    k_big[b], v_big[b] = k_small[j], v_small[j]
table = torch.tensor([ids + [10**8]], dtype=torch.int32)
q = torch.randn(1, 2, D).half()
cu = torch.tensor([0, 1], dtype=torch.int32)
seen = []
real = attn_plan._attn_constexprs
attn_plan._attn_constexprs = lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
ref = paged_attention_ref(q.double(), k_small.double(), v_small.double(),
                          torch.tensor([[0, 1, 2]], dtype=torch.int32), lens, cu)
for splits in (1, 2):
    out = torch.full_like(q, float("nan"))
    pa.paged_attention_fwd(q, k_big, v_big, table, lens, cu, None, out, None, spec=AttentionSpec(num_splits=splits),
                           max_seqlen_q=1, max_seqlen_k=n)
    assert seen[-1]["WIDE_OFFSETS"] and seen[-1]["PAGE_SIZE"] == P, seen[-1]
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 2e-3, f"splits={splits}: relative error {err:.3e}"
# Tokens outermost, K and V interleaved as in the arena: one block's rows lie 2**28 elements
# apart, so a row offset within a block passes int32 (15 * 2**28). Such blocks take the
# run-time divide with 64-bit rows.
X = 2**23  # blocks
kv_t = torch.empty(P, X, H, 2, D, dtype=torch.float16)  # lazily backed, ~8 GiB
k_t, v_t = kv_t[..., 0, :].transpose(0, 1), kv_t[..., 1, :].transpose(0, 1)
ids_t = [X - 1, 3, X - 2]
for j, b in enumerate(ids_t):
    k_t[b], v_t[b] = k_small[j], v_small[j]
assert (P - 1) * k_t.stride(1) > 2**31, k_t.stride()
out = torch.full_like(q, float("nan"))
pa.paged_attention_fwd(q, k_t, v_t, torch.tensor([ids_t + [10**8]], dtype=torch.int32), lens, cu, None, out, None,
                       spec=AttentionSpec(num_splits=2), max_seqlen_q=1, max_seqlen_k=n)
assert seen[-1]["WIDE_OFFSETS"] and seen[-1]["PAGE_SIZE"] == 0, seen[-1]
err = ((out.double() - ref).norm() / ref.norm()).item()
assert err < 2e-3, f"tokens outermost: relative error {err:.3e}"
print("OK")
"""


@interpreter_test
@pytest.mark.skipif(DEVICE != "cpu", reason="a lazily backed 4 GiB buffer is a CPU-lane trick")
def test_offsets_beyond_int32(seed):
    """Blocks whose keys lie past 2**31 elements of their cache view take 64-bit offsets,
    and blocks whose own rows span 2**31 elements 64-bit rows (in a subprocess: a wrapped
    int32 offset would read outside the buffer and crash)."""
    env = dict(os.environ, TRITON_INTERPRET="1", SEED=str(seed))
    res = subprocess.run([sys.executable, "-c", _WIDE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, f"rc {res.returncode}: {res.stdout}{res.stderr[-2000:]}"


def test_addressing_is_read_from_shapes_and_strides():
    """The host rule: int32 offsets while every key of a head lies within 2**31 elements of
    its base; one shared offset while K and V agree on block and token strides."""
    small = torch.empty(4, 16, 2, 8)
    assert attn_plan._cache_addressing(small, small) == attn_plan.CacheAddressing(wide_offsets=False, same_kv_strides=True)
    big = torch.empty(0, device="meta").as_strided((2**20, 16, 2, 8), (2**11 + 16, 16, 8, 1))
    assert attn_plan._cache_addressing(big, big).wide_offsets, "(2**20 - 1) * (2**11 + 16) > 2**31"
    other = torch.empty(4, 17, 2, 8)[:, :16]
    assert not attn_plan._cache_addressing(small, other).same_kv_strides
    assert not attn_plan._cache_addressing(big, big).wide_rows, "16 * 16 elements per block's rows"
    tall = torch.empty(0, device="meta").as_strided((4, 16, 2, 8), (16, 2**27, 8, 1))
    assert attn_plan._cache_addressing(tall, tall).wide_rows, "16 * 2**27 >= 2**31"


@interpreter_test
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_over_64_token_pages_takes_the_block_loop(launched, seed, num_splits):
    """16-bit decode over pages as long as its 64-key tile runs the large-block loop (its
    interior tiles software-pipelined) at 3 stages; windows and sinks cut inside pages."""
    c = paged_case([1, 77, 300], [1, 1, 1], dtype=torch.bfloat16, group=4, h_kv=2, head_dim=32, block_size=64,
                   seed=seed, kv_start=[0, 5, 0])
    run(c, num_splits=num_splits)
    run(c, num_splits=num_splits, window_left=130, sink_tokens=20)
    assert all(m["LARGE_BLOCKS"] and m["BLOCK_N"] == 64 for m in launched), f"launched {launched}"


@interpreter_test
def test_short_context_decode_runs_32_key_tiles(launched, seed):
    """B=1 decode from 1K keys whose 64-key tiles cannot fill a wave runs 32-key tiles, split
    one per tile: the result is the oracle's, windows and sinks included."""
    c = paged_case([1100], [1], dtype=torch.bfloat16, group=4, h_kv=2, head_dim=32, block_size=16, seed=seed)
    run(c, num_splits=None)
    run(c, num_splits=None, window_left=700, sink_tokens=20)
    assert launched and all(m["BLOCK_N"] == 32 and m["SPLIT"] for m in launched), f"launched {launched}"

