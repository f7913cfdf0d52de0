"""Triton block-table attention vs the oracle (interpreter on CPU, the real kernels on CUDA).

The option space (dtype x group x head_dim x block_size x masks x kv_start x query mode x
lse) is covered by a generated covering array: every pair of option values appears in at
least one case, and every triple of the mask options (causal, chunk, window/sinks,
softcap, kv_start, query mode) too, since that is where the masks interact. Each case
poisons with NaN everything the kernel must not read (unused blocks, slots past seq_len,
slots below kv_start) and fills block-table padding with out-of-range ids, so a stray
read either shows up as NaN or, in the interpreter, as a crash.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from _covering import DTYPES, LAYOUT, covering_array
from _helpers import (
    DEVICE,
    assert_close,
    assert_lse_close,
    gpu_test,
    interpreter_test,
    paged_case,
    paged_case_ref,
)

import kvarena.kernels.attn_plan as attn_plan
import kvarena.kernels.paged_attention as pa
import kvarena.kernels.split_reduce as sr
from kvarena.attention import AttentionSpec, paged_attention
from kvarena.attention.reference import paged_attention_ref

# ------------------------------------------------------------------- case construction

# Query modes: lengths per sequence (a seq_len-0 padding row in the cu_seqlens modes).
_MODES = {
    "decode": dict(lens=[1, 17, 100, 0, 63], q_lens=[1, 1, 1, 0, 1], cu=True),
    "decode_nocu": dict(lens=[1, 17, 100, 40], q_lens=[1, 1, 1, 1], cu=False),
    "ragged": dict(lens=[1, 17, 100, 0, 37], q_lens=[1, 5, 13, 0, 37], cu=True),
    "long_q": dict(lens=[200, 3], q_lens=[100, 2], cu=True),
}
_KV_START_PATTERN = [1, 3, 60, 0, 20]  # seq 0 loses its only key: an empty row


def make_case(*, dtype, group, head_dim, block_size, mode, kv_start, seed, h_kv=None):
    """The shared NaN-poisoned case (``_helpers.paged_case``) of one query mode."""
    spec = _MODES[mode]
    lens = spec["lens"]
    starts = [min(s, n) for s, n in zip(_KV_START_PATTERN, lens)] if kv_start else None
    return paged_case(lens, spec["q_lens"], dtype=dtype, group=group, h_kv=h_kv or (2 if group < 4 else 1),
                      head_dim=head_dim, block_size=block_size, seed=seed, kv_start=starts, cu=spec["cu"])


reference = paged_case_ref  # fp64 oracle (every dtype upcast: the kernel's own rounding is measured)


@pytest.fixture
def nan_prefilled(monkeypatch):
    """Make the launches see out/lse buffers full of NaN: every element must be written (the
    ops' planned launch, and the kernel launcher's one-shot entry)."""
    from kvarena.attention import launch

    real_fwd, real_planned = pa.paged_attention_fwd, launch.launch_planned

    def wrapper(q, k_cache, v_cache, block_table, seq_lens, cu, kv_start, out, lse, **kw):
        out.fill_(float("nan"))
        if lse is not None:
            lse.fill_(float("nan"))
        return real_fwd(q, k_cache, v_cache, block_table, seq_lens, cu, kv_start, out, lse, **kw)

    def planned(fwd, q, cache, keys, rows, out, lse, spec, own=None):
        out.fill_(float("nan"))
        if lse is not None:
            lse.fill_(float("nan"))
        return real_planned(fwd, q, cache, keys, rows, out, lse, spec, own)

    monkeypatch.setattr(pa, "paged_attention_fwd", wrapper)
    monkeypatch.setattr(launch, "launch_planned", planned)


def run_triton(case, **opts):
    keys = ("q", "k_cache", "v_cache", "block_table", "seq_lens", "cu_seqlens_q")
    return paged_attention(
        *(case[k] for k in keys), kv_start=case["kv_start"], max_seqlen_q=case["max_seqlen_q"],
        max_seqlen_k=case["max_seqlen_k"], backend="triton", **opts,
    )


# ------------------------------------------------------------------- the covering array

# The layout factors (dtype, head_dim, block_size) are the suites' shared ones
# (tests/_covering.py); the grid is drawn by the shared generator.
FACTORS = {
    "dtype": LAYOUT["dtype"],
    "group": [1, 4, 5],
    "head_dim": LAYOUT["head_dim"],
    "block_size": LAYOUT["block_size"],
    "mode": ["decode", "decode_nocu", "ragged"],
    "causal": [True, False],
    "chunk": [None, 4],
    "window": ["none", "window", "window+sinks"],
    "softcap": [None, 2.0],
    "kv_start": [False, True],
    "lse": [False, True],
}
# Factor groups whose every triple must appear: the masks (their interactions are the
# risky part) and the layout (how rows are packed and keys gathered).
_TRIPLE_GROUPS = [
    ["mode", "causal", "chunk", "window", "softcap", "kv_start"],
    ["dtype", "group", "head_dim", "block_size", "mode"],
]


def _case_id(c: dict) -> str:
    parts = [c["dtype"], f"g{c['group']}", f"d{c['head_dim']}", f"bs{c['block_size']}", c["mode"],
             "causal" if c["causal"] else "full"]
    if c["chunk"]:
        parts.append(f"chunk{c['chunk']}")
    if c["window"] != "none":
        parts.append(c["window"])
    if c["softcap"]:
        parts.append("softcap")
    if c["kv_start"]:
        parts.append("kvstart")
    if c["lse"]:
        parts.append("lse")
    return "-".join(parts)


COVERING = covering_array(FACTORS, _TRIPLE_GROUPS)


def _opts_of(c: dict, index: int) -> dict:
    window_left = [7, 0, 40][index % 3] if c["window"] != "none" else None
    return dict(
        causal=c["causal"], chunk_size=c["chunk"], window_left=window_left,
        sink_tokens=[3, 70][index % 2] if c["window"] == "window+sinks" else 0, softcap=c["softcap"],
    )


def test_covering_array_covers_all_pairs():
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(c[a], c[b]) for c in COVERING}
        assert len(seen) == len(FACTORS[a]) * len(FACTORS[b]), (a, b)
    for group in _TRIPLE_GROUPS:
        for a, b, d in itertools.combinations(group, 3):
            seen = {(c[a], c[b], c[d]) for c in COVERING}
            assert len(seen) == len(FACTORS[a]) * len(FACTORS[b]) * len(FACTORS[d]), (a, b, d)
    assert len(COVERING) <= 80, len(COVERING)


@gpu_test
@pytest.mark.parametrize("index", range(len(COVERING)), ids=[_case_id(c) for c in COVERING])
def test_attention_matches_reference(index, nan_prefilled):
    c = COVERING[index]
    dtype = DTYPES[c["dtype"]]
    case = make_case(dtype=dtype, group=c["group"], head_dim=c["head_dim"], block_size=c["block_size"],
                     mode=c["mode"], kv_start=c["kv_start"], seed=100 + index)
    opts = _opts_of(c, index)
    ref_out, ref_lse = reference(case, **opts)
    out_buf = torch.full_like(case["q"], float("nan"))
    res = run_triton(case, out=out_buf, return_lse=c["lse"], **opts)
    out = res[0] if c["lse"] else res
    assert out is out_buf
    assert_close(out, ref_out, dtype, f"out [{_case_id(c)}]")
    if c["lse"]:
        assert res[1].dtype == torch.float32
        assert_lse_close(res[1], ref_lse, dtype, f"lse [{_case_id(c)}]")


# ------------------------------------------------------------------- edge cases

EDGES = {
    # all rows empty: every seq_len 0 except a 1-token sequence hidden by kv_start
    "all_empty": dict(mode="decode", kv_start=True, opts=dict(causal=True)),
    "window0_sinks_past_window": dict(mode="ragged", kv_start=False, opts=dict(window_left=0, sink_tokens=50)),
    "chunk_larger_than_seq": dict(mode="ragged", kv_start=True, opts=dict(chunk_size=1000)),
    "custom_scale_softcap": dict(mode="ragged", kv_start=False, opts=dict(scale=0.3, softcap=0.5, causal=False)),
    # keys 64..127 form one tile: sinks end inside it and the window hides part of it
    # for the last rows, so it is not an interior tile although it starts among the sinks.
    "sinks_end_inside_tile": dict(mode="long_q", kv_start=False, opts=dict(causal=False, window_left=36, sink_tokens=70)),
    "chunk_window_sinks_softcap": dict(mode="ragged", kv_start=True,
                                      opts=dict(chunk_size=7, window_left=9, sink_tokens=5, softcap=3.0)),
}


@gpu_test
@pytest.mark.parametrize("name", list(EDGES))
def test_attention_edge_cases(name, nan_prefilled):
    e = EDGES[name]
    case = make_case(dtype=torch.float32, group=4, head_dim=32, block_size=48, mode=e["mode"],
                     kv_start=e["kv_start"], seed=7)
    if name == "all_empty":
        case["seq_lens"].zero_()
        case["seq_lens"][0] = 1
        case["kv_start"].zero_()
        case["kv_start"][0] = 1
        case["cu_seqlens_q"] = torch.tensor([0, 1, 1, 1, 1, 1], dtype=torch.int32, device=DEVICE)
        case["q"] = case["q"][:1]
        case["max_seqlen_k"] = 1
    ref_out, ref_lse = reference(case, **e["opts"])
    out, lse = run_triton(case, return_lse=True, **e["opts"])
    assert_close(out, ref_out, torch.float32, name)
    assert_lse_close(lse, ref_lse, torch.float32, name)
    if name == "all_empty":
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# bf16 subnormals (below 2**-126 ~ 1.18e-38) on one side of the dot, scaled up on the other
# so the scores are O(1) and a misread subnormal moves them: (q_scale, kv_scale, rope).
SUBNORMAL = {"q-subnormal": (6e-39, 4e37, False), "k-subnormal": (4e37, 6e-39, False),
             "q-subnormal-rope": (6e-39, 4e37, True)}


def _rope_tables(n_pos: int, head_dim: int):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return dict(rope_cos=ang.cos().float().to(DEVICE), rope_sin=ang.sin().float().to(DEVICE))


def _rotated_reference(case, rope_cos, rope_sin, **opts):
    """The fp64 oracle on explicitly rotated q and k (half-split pairs): key t of a sequence
    at position t, its queries at the bottom-right positions ``seq_len - q_len + i``."""
    cos, sin = rope_cos.double().cpu(), rope_sin.double().cpu()

    def rot(x, pos):
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    q, kc = case["q"].double().cpu(), case["k_cache"].double().cpu().clone()
    bs, cu = kc.shape[1], case["cu_seqlens_q"].tolist()
    for b, n in enumerate(case["seq_lens"].tolist()):
        t = torch.arange(n)
        blk, row = case["block_table"].cpu()[b, t // bs].long(), t % bs
        kc[blk, row] = rot(kc[blk, row], t)
        q[cu[b]:cu[b + 1]] = rot(q[cu[b]:cu[b + 1]], n - (cu[b + 1] - cu[b]) + torch.arange(cu[b + 1] - cu[b]))
    return paged_case_ref({**case, "q": q, "k_cache": kc}, **opts)


@gpu_test
@pytest.mark.parametrize("name", list(SUBNORMAL))
def test_bf16_subnormal_queries_and_keys_match_the_oracle(name, nan_prefilled):
    """Issue 41 #9: the interpreter widened bf16 q / k with a plain cast, which it gets wrong
    for subnormals (21-37% off the oracle); they must read as what they are."""
    q_scale, kv_scale, rope = SUBNORMAL[name]
    case = paged_case([37, 5, 61], [3, 5, 1], dtype=torch.bfloat16, group=3, h_kv=1, head_dim=24, block_size=16,
                      seed=11, q_scale=q_scale, kv_scale=kv_scale)
    tiny = case["q"] if q_scale < 1 else case["k_cache"].nan_to_num(0.0)
    share = float((tiny.abs() < 2.0**-126)[tiny != 0].float().mean())
    assert share > 0.5, f"only {share:.0%} of the small side is subnormal"
    tables = _rope_tables(64, 24) if rope else {}
    ref_out, ref_lse = _rotated_reference(case, **tables, scale=1.0) if rope else reference(case, scale=1.0)
    out, lse = run_triton(case, return_lse=True, scale=1.0, **tables)
    assert_close(out, ref_out, torch.bfloat16, name)
    assert_lse_close(lse, ref_lse, torch.bfloat16, name)


@interpreter_test  # the interpreter's own bf16 rounding is what is pinned (compiled casts are the GPU's)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-reduce"])
def test_bf16_subnormal_outputs_round_like_a_gpu(num_splits, nan_prefilled):
    """Issue 41 sweep (the #9 pattern, on the way out): the interpreter narrowed the fp32
    output to bf16 by truncation, so subnormal outputs (subnormal values V) came out far
    off. Each element within one bf16 ulp of the oracle (2**-133 for subnormals: the
    relative-norm check cannot see values this small)."""
    case = paged_case([37, 5, 61], [3, 5, 1], dtype=torch.bfloat16, group=3, h_kv=1, head_dim=24, block_size=16,
                      seed=13)
    case["v_cache"].mul_(6e-39)
    ref_out, _ = reference(case)
    out = run_triton(case, num_splits=num_splits)
    g, r = out.double().cpu(), ref_out.double().cpu()
    assert (r.abs() < 2.0**-126).float().mean() > 0.9, "the outputs are not subnormal"
    ulp = torch.maximum(r.abs() * 2.0**-7, torch.full_like(r, 2.0**-133))
    wrong = ((g - r).abs() > ulp) | g.isnan()
    assert not wrong.any(), (f"{int(wrong.sum())} of {g.numel()} outputs more than one bf16 ulp off, e.g. got "
                             f"{g[wrong][:3].tolist()}, ref {r[wrong][:3].tolist()}")


@gpu_test
def test_loose_host_maxima(nan_prefilled):
    """max_seqlen_q/k may over-bound the real lengths (CUDA-graph capacity): same result."""
    case = make_case(dtype=torch.float16, group=4, head_dim=32, block_size=16, mode="ragged",
                     kv_start=False, seed=3)
    ref_out, ref_lse = reference(case)
    case["max_seqlen_q"] += 20
    case["block_table"] = torch.cat([case["block_table"], case["block_table"][:, :4]], 1)
    case["max_seqlen_k"] = case["block_table"].shape[1] * 16
    out, lse = run_triton(case, return_lse=True)
    assert_close(out, ref_out, torch.float16, "loose maxima")
    assert_lse_close(lse, ref_lse, torch.float16, "loose maxima")


# ------------------------------------------------------------------- split-KV

_SPLIT_MODES = {
    "decode_long": dict(lens=[300, 130, 5, 0], q_lens=[1, 1, 1, 0], cu=True),
    "ragged_long": dict(lens=[300, 70, 0], q_lens=[6, 70, 0], cu=True),
}


@pytest.fixture
def split_modes(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_MODES", {**_MODES, **_SPLIT_MODES})


@gpu_test
@pytest.mark.parametrize(
    "dtype,group,mode,opts",
    [
        (torch.float32, 4, "decode_long", dict()),
        (torch.bfloat16, 4, "decode_long", dict(window_left=150, sink_tokens=20, softcap=2.0)),
        (torch.float16, 4, "ragged_long", dict(chunk_size=16, window_left=100, sink_tokens=70)),
        (torch.float32, 1, "ragged_long", dict(causal=False)),
    ],
    ids=["fp32-decode", "bf16-decode-window-sinks-softcap", "fp16-ragged-chunk-window-sinks", "fp32-ragged-full"],
)
def test_split_matches_unsplit(dtype, group, mode, opts, split_modes, nan_prefilled):
    case = make_case(dtype=dtype, group=group, head_dim=32, block_size=48, mode=mode, kv_start=True, seed=11, h_kv=2)
    ref_out, ref_lse = reference(case, **opts)
    base_out, base_lse = run_triton(case, return_lse=True, num_splits=1, **opts)
    assert_close(base_out, ref_out, dtype, "unsplit")
    for n in (3, 7):
        out, lse = run_triton(case, return_lse=True, num_splits=n, **opts)
        assert_close(out, ref_out, dtype, f"num_splits={n}")
        assert_lse_close(lse, ref_lse, dtype, f"num_splits={n}")
        assert_close(out, base_out, dtype, f"num_splits={n} vs 1")
    # Split without an lse output (the reduce then writes out only).
    out = run_triton(case, num_splits=3, **opts)
    assert_close(out, ref_out, dtype, "num_splits=3, no lse")


@gpu_test
def test_deterministic_split_is_batch_invariant(monkeypatch, split_modes):
    """Fixed keys per split: a sequence's output is bitwise the same alone or in a batch."""
    monkeypatch.setattr(attn_plan, "_DET_SPLIT_KEYS", 128)  # 300 keys -> 3 splits in the interpreter
    opts = dict(window_left=200, sink_tokens=10)
    big = make_case(dtype=torch.bfloat16, group=4, head_dim=32, block_size=48, mode="decode_long",
                    kv_start=False, seed=5, h_kv=2)
    ref_out, ref_lse = reference(big, **opts)
    out_big, lse_big = run_triton(big, return_lse=True, deterministic=True, **opts)
    assert_close(out_big, ref_out, torch.bfloat16, "deterministic")
    assert_lse_close(lse_big, ref_lse, torch.bfloat16, "deterministic")
    for i in range(3):  # each sequence alone (batch of 1)
        alone = dict(big)
        alone.update(
            q=big["q"][i:i + 1], block_table=big["block_table"][i:i + 1], seq_lens=big["seq_lens"][i:i + 1],
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            max_seqlen_q=1, max_seqlen_k=int(big["seq_lens"][i]),
        )
        out1, lse1 = run_triton(alone, return_lse=True, deterministic=True, **opts)
        assert torch.equal(out1, out_big[i:i + 1]), f"sequence {i}: deterministic output depends on the batch"
        assert torch.equal(lse1, lse_big[i:i + 1])


def _reduce_ref(part, lse2, sink):
    """fp64 merge of split partials (lse in log2 units; -inf: empty, its partial unread)."""
    lse = lse2.double() * math.log(2.0)
    terms = lse if sink is None else torch.cat([lse, sink.double().expand(1, *lse.shape[1:])], 0)
    ref_lse = torch.logsumexp(terms, 0)
    w = torch.exp(lse - ref_lse).nan_to_num(0.0)  # a row with no key: -inf - -inf
    out = (torch.where(w[..., None] > 0, part.double(), 0.0) * w[..., None]).sum(0)
    return torch.where(torch.isneginf(ref_lse)[..., None], 0.0, out), ref_lse


@gpu_test
@pytest.mark.parametrize("dtype,head_dim,splits", [
    (torch.float32, 24, 37), (torch.float16, 24, 37), (torch.bfloat16, 24, 37),
    (torch.float32, 80, 3), (torch.bfloat16, 128, 70), (torch.float16, 40, 64),
], ids=["fp32-D24-37", "fp16-D24-37", "bf16-D24-37", "fp32-D80-3", "bf16-D128-70", "fp16-D40-64"])
def test_split_reduce_kernel(dtype, head_dim, splits):
    """The parallel reduce at odd D and many splits (past 64: chunks), rows whose splits are
    partly or wholly empty (lse -inf over NaN partials), with and without sinks and lse, both
    tiles (deterministic), into NaN-filled outputs."""
    g = torch.Generator().manual_seed(head_dim * 1000 + splits)
    tokens, heads = 3, 5
    part = torch.randn(splits, tokens, heads, head_dim, generator=g).to(DEVICE)
    lse2 = (torch.randn(splits, tokens, heads, generator=g) * 3).to(DEVICE)
    lse2[splits // 2:, 0, 1] = float("-inf")  # partly empty
    part[splits // 2:, 0, 1] = float("nan")
    lse2[:, 1, 2] = float("-inf")  # wholly empty
    part[:, 1, 2] = float("nan")
    lse2[1::3, 2, :] = float("-inf")  # every third split empty
    part[1::3, 2, :] = float("nan")
    sink = torch.randn(heads, generator=g).to(DEVICE)
    for sk, with_lse, det in ((None, True, False), (sink, True, True), (sink, False, False)):
        ref_out, ref_lse = _reduce_ref(part, lse2, sk)
        out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
        lse = torch.full((tokens, heads), float("nan"), device=DEVICE) if with_lse else None
        sr.split_reduce(part, lse2, out, lse, sk, deterministic=det)
        what = f"D={head_dim} splits={splits} sink={sk is not None} lse={with_lse} det={det}"
        assert_close(out, ref_out, dtype, what)
        if sk is None:
            assert torch.equal(out[1, 2].float(), torch.zeros(head_dim, device=DEVICE)), what
        if with_lse:
            assert_lse_close(lse, ref_lse, torch.float32, what)


@gpu_test
@pytest.mark.parametrize("dtype,group", [(torch.float32, 1), (torch.bfloat16, 4), (torch.float16, 5)],
                         ids=["fp32-gqa1", "bf16-gqa4", "fp16-gqa5"])
def test_many_splits_match_oracle(monkeypatch, dtype, group, nan_prefilled):
    """37 splits end to end at an odd head dim (40): the short sequences' rows see mostly
    empty splits (lse -inf), NaN-poisoned unused slots stay unread."""
    monkeypatch.setattr(sys.modules[__name__], "_MODES",
                        {"decode_splits": dict(lens=[2400, 130, 5, 0], q_lens=[1, 1, 1, 0], cu=True)})
    case = make_case(dtype=dtype, group=group, head_dim=40, block_size=16, mode="decode_splits", kv_start=False,
                     seed=21, h_kv=1)
    ref_out, ref_lse = reference(case)
    out, lse = run_triton(case, return_lse=True, num_splits=37)
    assert_close(out, ref_out, dtype, "num_splits=37")
    assert_lse_close(lse, ref_lse, dtype, "num_splits=37")


def test_split_heuristic_numbers():
    """Splits fill the last wave to >= 90% of the CTA slots (SMs x CTAs per SM); a grid
    under one wave takes one full wave of splits."""
    sms = 132
    assert attn_plan._pick_num_splits(8, 32768, sms) == 16  # B=1, 8 kv heads decode: 128 of 132
    assert attn_plan._pick_num_splits(32, 32768, sms) == 4
    assert attn_plan._pick_num_splits(128, 32768, sms) == 1  # 0.97 of a wave already
    assert attn_plan._pick_num_splits(200, 32768, sms) == 3  # 1.52 waves (0.76) -> 4.55 (0.91)
    assert attn_plan._pick_num_splits(300, 10**6, sms) == 2  # 2.27 waves (0.76) -> 4.55 (0.91)
    assert attn_plan._pick_num_splits(8, 1024, sms) == 16  # from 1K keys: one full wave, <= 1 split per 32 keys
    assert attn_plan._pick_num_splits(8, 1000, sms) == 3  # under 1K: one split per 256 keys at most
    assert attn_plan._pick_num_splits(8, 400, sms) == 1  # < 2 x 256 keys: nothing to split
    # Two CTAs per SM make a wave 264 programs: B=16 decode (128 programs) now splits.
    assert attn_plan._pick_num_splits(128, 16384, sms, 2) == 2
    assert attn_plan._pick_num_splits(444, 18720, sms, 1) == 2  # Wan-1.3B chunk: 3.36 waves -> 6.73
    # B=1 decode at 2 CTAs/SM: one full wave (33 x 8 = 264) from 2K keys on (64-key tiles).
    assert attn_plan._pick_num_splits(8, 131072, sms, 2, tiles=2048) == 33
    assert attn_plan._pick_num_splits(8, 4096, sms, 2, tiles=64) == 33
    assert attn_plan._pick_num_splits(8, 2048, sms, 2, tiles=32) == 32  # one split per key tile
    for ctas in (1, 2, 3):
        for programs in range(1, 3 * sms):
            for keys in (600, 4096, 131072):
                s = attn_plan._pick_num_splits(programs, keys, sms, ctas)
                per = attn_plan._FULL_WAVE_SPLIT_KEYS if keys >= attn_plan._FULL_WAVE_MIN_KEYS else attn_plan._MIN_SPLIT_KEYS
                assert 1 <= s <= min(attn_plan._MAX_SPLITS, max(1, keys // per))
                assert attn_plan._pick_num_splits(programs, keys, sms, ctas, tiles=5) <= 5


@pytest.mark.parametrize(("keys", "opts"), [
    (1024, {}), (1536, {}), (2048, {}), (131072, {}), (1000, {}),
    (1024, {"num_splits": 4}), (1024, {"deterministic": True}), (1024, {"rope": True}),
], ids=["1K", "1.5K", "2K", "128K", "under-1K", "explicit-splits", "deterministic", "rope"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120a", "gfx942", "gfx950"])
def test_short_context_decode_tile(keys, opts, arch):
    """B=1 decode (8 kv heads) from 1K keys on fills >= 90% of a wave on every target, at the
    occupancy of the tile that launches, or runs every key tile as its own split where the
    keys are too few for that (1K-2K keys on 148-304 SMs at 2-4 CTAs each: 8 x 32-64 programs
    of the 32-key minimum): the launch takes 32-key tiles exactly where 64-key tiles cannot
    reach 90% at one split per tile; an explicit split count, the deterministic pin, RoPE on
    read and contexts under 1K keep the target's own tile."""
    from kvarena.kernels.arch import arch_named
    from kvarena.kernels.occupancy import ctas_per_sm

    kw = dict(num_splits=None, deterministic=False, rope=False)
    kw.update(opts)
    plan = attn_plan.plan_launch(head_dim=128, group=4, elem_bytes=2, num_seqs=1, num_kv_heads=8, max_seqlen_q=1,
                          max_seqlen_k=keys, block_size=16, causal=True, window_left=None, sink_tokens=0,
                          softcap=False, arch=arch, **kw)
    own_tile = attn_plan._pick_config(128, 4, 2, None if kw["deterministic"] else 1, arch, rope=kw["rope"])
    if opts or keys < 1024:
        assert plan.cfg["BLOCK_N"] == own_tile["BLOCK_N"], plan
        return
    target = arch_named(arch)
    slots = target.sm_count * ctas_per_sm(target, own_tile, 2)
    full_at_64 = 8 * -(-keys // 64) >= 0.9 * slots
    assert plan.cfg["BLOCK_N"] == (64 if full_at_64 else 32), (plan, slots)
    every_tile_split = plan.num_splits == -(-keys // plan.cfg["BLOCK_N"])
    assert plan.wave_efficiency() >= 0.9 or every_tile_split, plan


def test_reduce_tile_fills_the_grid_within_its_budget():
    """The reduce's tile holds <= ROW_TILE_ELEMS partials, <= 4 rows, every split up to 64 at
    once; B=1 (32 rows) gets >= one program per SM; deterministic tiles ignore the batch."""
    from kvarena.kernels._common import ROW_TILE_ELEMS

    for d in (16, 72, 128, 256):
        for splits in (2, 3, 30, 33, 37, 64, 65, 300):
            for rows in (1, 32, 512, 8192):
                t = sr._reduce_tile(rows, d, splits, 132)
                assert t.BLOCK_R * t.BLOCK_S * t.BLOCK_D <= ROW_TILE_ELEMS and t.BLOCK_R <= 4
                assert min(64, 1 << (splits - 1).bit_length()) == t.BLOCK_S
                assert t.grid == (-(-rows // t.BLOCK_R), -(-d // t.BLOCK_D))
                if rows >= 32 and d >= 128:
                    assert t.programs >= 132, t
                det = sr._reduce_tile(rows, d, splits, 132, deterministic=True)
                pinned = sr._reduce_tile(1, d, 2, 1, deterministic=True)
                assert (det.BLOCK_R, det.BLOCK_D, det.BLOCK_S) == (pinned.BLOCK_R, pinned.BLOCK_D, pinned.BLOCK_S)


def test_pick_config_is_pure_and_bounded():
    for d in (8, 32, 80, 128, 256):
        for g in (1, 4, 5, 8):
            for eb in (2, 4):
                for ql in (None, 1, 3, 100, 12150):
                    cfg = attn_plan._pick_config(d, g, eb, ql)
                    assert cfg == attn_plan._pick_config(d, g, eb, ql)
                    assert cfg["HEAD_DIM_PAD"] >= max(16, d) and cfg["BLOCK_M"] >= 16 and cfg["BLOCK_N"] >= 16
                    assert cfg["num_warps"] in (4, 8)
    # Decode packs the group into the smallest MMA tile.
    assert attn_plan._pick_config(128, 4, 2, 1)["BLOCK_M"] == 16


# ------------------------------------------------------------------- the sm_80 tiles

# (id, options, block_size): a slab-like lean launch (large blocks, no mask) and a guarded
# causal prefill over pages, the two loops the sm_80 chunk tile runs.
SM80_CASES = [
    pytest.param(dict(causal=False), 48, id="lean-large-blocks"),
    pytest.param(dict(window_left=37, sink_tokens=5), 16, id="guarded-window-sinks-pages16"),
]


@interpreter_test
@pytest.mark.skipif(DEVICE != "cpu", reason="pins the sm_80 config under the interpreter")
@pytest.mark.parametrize(("opts", "block_size"), SM80_CASES)
def test_sm80_chunk_tile_matches_oracle(monkeypatch, seed, opts, block_size):
    """The H100 config is what the interpreter runs by default; pin the A100 one (128 x 16
    tiles, warps along M) so the tile sm_80 launches is proven on CPU too."""
    monkeypatch.setenv("KVARENA_ARCH", "sm_80")
    cfg = attn_plan._pick_config(80, 2, 2, 100, "sm_80", lean=not opts.get("window_left"))
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (128, 16), cfg
    case = paged_case([200, 3], [100, 2], dtype=torch.bfloat16, group=2, h_kv=2, head_dim=80,
                      block_size=block_size, seed=seed, kv_start=[7, 0], cu=True)
    out, lse = run_triton(case, return_lse=True, **opts)
    ref_out, ref_lse = reference(case, **opts)
    assert_close(out, ref_out, torch.bfloat16, f"sm_80 tile {opts}")
    assert_lse_close(lse, ref_lse, torch.bfloat16, f"sm_80 tile {opts}")


# ------------------------------------------------------------------- int64 addressing


@interpreter_test
@pytest.mark.skipif(DEVICE != "cpu", reason="a 4 GiB lazily backed buffer is a CPU-lane trick")
def test_int64_offsets_beyond_2_31_elements():
    """Used blocks lie past 2**31 elements of the arena (torch.empty is lazily backed)."""
    from kvarena.attention import store_kv

    h_kv, d, bs = 1, 32, 16
    per_block = 2 * bs * h_kv * d  # [num_blocks, k/v, bs, H_kv, D]
    n_el = 2**31 + 64 * per_block
    buf = torch.empty(n_el, dtype=torch.float16)
    nb = n_el // per_block
    arena = buf[: nb * per_block].view(nb, 2, bs, h_kv, d)
    k_cache, v_cache = arena[:, 0], arena[:, 1]
    hi_blocks = [nb - 1, nb - 5, nb - 3]
    assert min(hi_blocks) * per_block > 2**31
    gen = torch.Generator().manual_seed(0)
    lens = [40, 9]
    k = torch.randn(sum(lens), h_kv, d, generator=gen).half()
    v = torch.randn(sum(lens), h_kv, d, generator=gen).half()
    slots = [hi_blocks[t // bs] * bs + t % bs for t in range(40)] + [(nb - 7) * bs + t for t in range(9)]
    store_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64), backend="triton")
    assert torch.equal(k_cache[nb - 5, 3], k[bs + 3]) and torch.equal(v_cache[nb - 7, 8], v[40 + 8])
    table = torch.tensor([hi_blocks, [nb - 7, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q = torch.randn(5, h_kv * 4, d, generator=gen).half()
    ref = paged_attention_ref(q.double(), k_cache, v_cache, table, seq_lens, cu).double()
    for n in (1, 2):
        out = paged_attention(q, k_cache, v_cache, table, seq_lens, cu, max_seqlen_q=3, max_seqlen_k=40,
                              backend="triton", num_splits=n)
        assert_close(out, ref, torch.float16, f"int64 offsets, num_splits={n}")

    # q and out as views with a 2**30-element row pitch: a tile's in-tile row offsets would
    # pass 2**31 (int32), so the launcher must route them through contiguous copies.
    pitch = 2**30 + 64
    q3, ref3 = q[:3], ref[:3]  # sequence 0 alone: 3 queries, rows 0..2 of one tile

    def far_view(fill):
        buf = torch.empty(2 * pitch + 4 * d, dtype=torch.float16)  # lazily backed, ~4 GiB
        view = buf.as_strided((3, 4, d), (pitch, d, 1))
        view.copy_(fill)
        return view

    q_far, out_far = far_view(q3), far_view(torch.full_like(q3, float("nan")))
    lse = torch.full((3, 4), float("nan"))
    pa.paged_attention_fwd(
        q_far, k_cache, v_cache, table[:1], seq_lens[:1], cu[:2], None, out_far, lse, spec=AttentionSpec(),
        max_seqlen_q=3, max_seqlen_k=40,
    )
    assert_close(out_far, ref3, torch.float16, "row pitch 2**30")
    assert not lse.isnan().any()


# ------------------------------------------------------------------- dispatch


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter requirement only applies to CPU tensors")
def test_triton_backend_on_cpu_without_interpreter_raises():
    code = (
        "import torch, kvarena\n"
        "q = torch.randn(1, 2, 16); kc = torch.randn(2, 4, 2, 16)\n"
        "try:\n"
        "    kvarena.paged_attention(q, kc, kc.clone(), torch.zeros(1, 1, dtype=torch.int32),\n"
        "                            torch.ones(1, dtype=torch.int32), backend='triton')\n"
        "except RuntimeError as e:\n"
        "    assert 'TRITON_INTERPRET' in str(e), e\n"
        "    print('RAISED')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "RAISED" in res.stdout, res.stdout + res.stderr


@gpu_test
@pytest.mark.parametrize("num_splits", [1, 3])
def test_launcher_without_lse_output(num_splits):
    """lse=None (WRITE_LSE off; the public op always asks for it) still writes every row."""
    case = make_case(dtype=torch.float16, group=5, head_dim=32, block_size=48, mode="ragged", kv_start=True, seed=9)
    opts = dict(causal=True, chunk_size=None, window_left=20, sink_tokens=3, softcap=None)
    ref_out, _ = reference(case, **opts)
    q = case["q"]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    cu = case["cu_seqlens_q"]
    pa.paged_attention_fwd(
        q, case["k_cache"], case["v_cache"], case["block_table"], case["seq_lens"], cu, case["kv_start"], out,
        None, spec=AttentionSpec(num_splits=num_splits, **opts), max_seqlen_q=case["max_seqlen_q"],
        max_seqlen_k=case["max_seqlen_k"],
    )
    assert_close(out, ref_out, torch.float16, f"lse=None, num_splits={num_splits}")


# ------------------------------------------------------------------- the full cross-product
# KVARENA_FULL_GRID=N (bench/gpu.sh, on a GPU) runs every N-th case of the cross-product of
# all FACTORS (N=1: all 23,328), as 27 tests of 864 cases each so that a time cap loses at
# most one block. The interpreter lane does not run it (~0.5 s a case on CPU).
_FULL_STRIDE = int(os.environ.get("KVARENA_FULL_GRID", "0") or 0)
_LAYOUT_KEYS = ("dtype", "group", "head_dim")
_REST_KEYS = [k for k in FACTORS if k not in _LAYOUT_KEYS]


@gpu_test
@pytest.mark.skipif(_FULL_STRIDE < 1, reason="full cross-product only with KVARENA_FULL_GRID=N (GPU script)")
@pytest.mark.parametrize(
    "layout", list(itertools.product(*(FACTORS[k] for k in _LAYOUT_KEYS))),
    ids=lambda t: f"{t[0]}-g{t[1]}-d{t[2]}",
)
def test_attention_full_cross_product(layout, monkeypatch):
    c0 = dict(zip(_LAYOUT_KEYS, layout))
    dtype = DTYPES[c0["dtype"]]
    base = FACTORS["dtype"].index(c0["dtype"]) * 1000003 + c0["group"] * 7919 + c0["head_dim"]
    failures, ran = [], 0
    for index, rest in enumerate(itertools.product(*(FACTORS[k] for k in _REST_KEYS))):
        if (base + index) % _FULL_STRIDE:
            continue
        c = {**c0, **dict(zip(_REST_KEYS, rest))}
        case = make_case(dtype=dtype, group=c["group"], head_dim=c["head_dim"], block_size=c["block_size"],
                         mode=c["mode"], kv_start=c["kv_start"], seed=base + index)
        opts = _opts_of(c, index)
        ref_out, ref_lse = reference(case, **opts)
        res = run_triton(case, out=torch.full_like(case["q"], float("nan")), return_lse=True, **opts)
        ran += 1
        try:
            assert_close(res[0], ref_out, dtype, f"out [{_case_id(c)}]")
            assert_lse_close(res[1], ref_lse, dtype, f"lse [{_case_id(c)}]")
        except AssertionError as exc:
            failures.append(str(exc).splitlines()[0])
    assert ran > 0, "the stride skipped every case of this block"
    assert not failures, f"{len(failures)}/{ran} cases failed, first: " + "\n".join(failures[:5])
