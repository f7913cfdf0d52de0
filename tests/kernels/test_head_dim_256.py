"""Head dim 256 past decode: the tiles the launcher picks on sm_90a (the interpreter's
target) for each kind of launch, run against the fp64 oracle.

``attn_configs._d256_config`` gives lean chunks 128 x 32 tiles (each warpgroup its own
64 query rows), an fp8 cache 32 x 32 over 4 warps (8 when guarded) and the rest 64 x 32;
each case asserts the tile it ran, so a rule change cannot leave a tile unexecuted here.
GQA 7 over 12-13 positions: a position's heads straddle tiles of 32 rows, and 84-91 rows
fill part of one 128-row tile.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import INTERPRETER, assert_close, paged_case, paged_case_ref, paged_fp8_case

import kvarena.kernels.attn_plan as attn_plan
from kvarena import paged_attention
from kvarena.attention.fp8 import dequantize_fp8
from kvarena.attention.reference import paged_attention_ref

pytestmark = [*INTERPRETER]


@pytest.fixture
def picked(monkeypatch):
    """The configs the launcher picked during the test, in order."""
    real, seen = attn_plan._pick_config, []

    def spy(*args, **kwargs):
        cfg = real(*args, **kwargs)
        seen.append((cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]))
        return cfg

    monkeypatch.setattr(attn_plan, "_pick_config", spy)
    return seen


# (id, options, block_size, tile (BLOCK_M, BLOCK_N, warps)).
BF16_CASES = [
    pytest.param(dict(causal=False), 64, (128, 32, 8), id="lean-large-blocks-128x32"),
    pytest.param(dict(causal=False), 16, (128, 32, 8), id="lean-pages16-128x32"),
    pytest.param(dict(causal=True), 16, (64, 32, 8), id="guarded-causal-64x32"),
]


@pytest.mark.parametrize(("opts", "block_size", "tile"), BF16_CASES)
def test_d256_bf16_tiles_match_oracle(picked, seed, opts, block_size, tile):
    case = paged_case([75, 40], [13, 12], dtype=torch.bfloat16, group=7, h_kv=1, head_dim=256,
                      block_size=block_size, seed=seed, kv_start=[3, 0], cu=True)
    ref, _ = paged_case_ref(case, **opts)
    for splits in (1, 2):
        out = paged_attention(case["q"], case["k_cache"], case["v_cache"], case["block_table"], case["seq_lens"],
                              case["cu_seqlens_q"], kv_start=case["kv_start"], backend="triton", num_splits=splits,
                              **opts)
        assert picked and picked[-1] == tile, f"ran {picked[-1:]}, expected {tile}"
        assert_close(out, ref, torch.bfloat16, f"D256 {opts} pages {block_size} splits {splits}")


FP8_CASES = [
    pytest.param(dict(causal=False), (32, 32, 4), id="lean-32x32-w4"),
    pytest.param(dict(causal=True, softcap=20.0), (32, 32, 8), id="guarded-softcap-32x32-w8"),
]


@pytest.mark.parametrize(("opts", "tile"), FP8_CASES)
def test_d256_fp8_tiles_match_oracle(picked, seed, opts, tile):
    c = paged_fp8_case([70, 33], [12, 13], dtype=torch.bfloat16, group=7, h_kv=1, d=256, bs=16, seed=seed)
    kd, vd = dequantize_fp8(c["kc"], c["ks"], torch.float64), dequantize_fp8(c["vc"], c["vs"], torch.float64)
    ref = paged_attention_ref(c["q"].double(), kd, vd, c["table"], c["lens"], c["cu"], **opts)
    out = paged_attention(c["q"], c["kc"], c["vc"], c["table"], c["lens"], c["cu"], k_scale=c["ks"],
                          v_scale=c["vs"], backend="triton", **opts)
    assert picked and picked[-1] == tile, f"ran {picked[-1:]}, expected {tile}"
    assert_close(out, ref, torch.bfloat16, f"D256 fp8 {opts}")
