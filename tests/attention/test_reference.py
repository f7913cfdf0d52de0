"""Semantics of the attention ops, checked against a naive per-query, per-key fp64 loop.

The loop below is written from docs/contract.md's rules, independently of
``kvarena.attention.reference``; both the oracle (``paged_attention_ref``) and the public
op on its PyTorch path (``paged_attention(..., backend="torch")``) must match it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _helpers import assert_attention_close, one_torch_thread  # noqa: F401 - autouse fixture

from kvarena.attention import merge_attention_states, paged_attention, store_kv
from kvarena.attention.reference import (
    merge_attention_states_ref,
    paged_attention_ref,
    store_kv_ref,
)
from kvarena.attention.spec import AttentionSpec
from kvarena.attention.torch_path import paged_attention_sdpa

H_KV = 2


def naive_attention(q, k, v, q_start, *, scale, causal=True, chunk_size=None, window_left=None,
                    sink_tokens=0, softcap=None, kv_start=0):
    """One sequence: ``q [Q, H_q, D]`` at positions ``q_start + i``, ``k, v [L, H_kv, D]``.

    Returns fp64 numpy ``out [Q, H_q, D]`` and ``lse [Q, H_q]`` (0 and -inf when a query
    sees no key).
    """
    q, k, v = (x.double().numpy() for x in (q, k, v))
    n_q, h_q, d = q.shape
    group = h_q // k.shape[1]
    kv_head = np.arange(h_q) // group
    out = np.zeros((n_q, h_q, d))
    lse = np.full((n_q, h_q), -np.inf)
    for i in range(n_q):
        p = q_start + i
        keys = []
        for t in range(k.shape[0]):
            if t < kv_start:
                continue
            if causal and chunk_size is None and t > p:
                continue
            if causal and chunk_size is not None and t // chunk_size > p // chunk_size:
                continue
            if window_left is not None and t < p - window_left and t >= sink_tokens:
                continue
            keys.append(t)
        if not keys:
            continue
        kk = k[keys][:, kv_head]  # [n, H_q, D]
        vv = v[keys][:, kv_head]
        s = np.einsum("hd,nhd->hn", q[i], kk) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m)
        z = e.sum(axis=1, keepdims=True)
        out[i] = np.einsum("hn,nhd->hd", e / z, vv)
        lse[i] = (m + np.log(z))[:, 0]
    return out, lse


class Case:
    """A NaN-poisoned paged cache holding B sequences, with queries and the naive result."""

    def __init__(self, lengths, q_lens, *, group=1, d=80, block_size=48, dtype=torch.float32,
                 kv_start=None, poison=True):
        self.lengths, self.q_lens, self.dtype = lengths, q_lens, dtype
        self.kv_start = kv_start or [0] * len(lengths)
        n_blk = [math.ceil(n / block_size) for n in lengths]
        nan_blocks = 2
        num_blocks = sum(n_blk) + nan_blocks
        fill = float("nan") if poison else 0.0
        self.k_cache = torch.full((num_blocks, block_size, H_KV, d), fill, dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, fill)
        perm = torch.randperm(num_blocks).tolist()
        width = max(n_blk, default=0) + 2
        table = []
        self.keys, self.values = [], []
        for b, n in enumerate(lengths):
            ids = [perm.pop() for _ in range(n_blk[b])]
            k = torch.randn(n, H_KV, d).to(dtype)
            v = torch.randn(n, H_KV, d).to(dtype)
            self.keys.append(k)
            self.values.append(v)
            for t in range(self.kv_start[b], n):  # hidden slots below kv_start stay poisoned
                self.k_cache[ids[t // block_size], t % block_size] = k[t]
                self.v_cache[ids[t // block_size], t % block_size] = v[t]
            # padding entries: a poisoned block, then an id far out of range
            table.append(ids + [perm[0] if perm else 0, 1 << 30][: width - len(ids)] + [1 << 30] * max(0, width - len(ids) - 2))
        self.block_table = torch.tensor(table, dtype=torch.int32).reshape(len(lengths), width)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32)
        self.cu = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
        self.q = torch.randn(int(self.cu[-1]), H_KV * group, d).to(dtype)
        self.kv_start_t = torch.tensor(self.kv_start, dtype=torch.int32) if kv_start else None

    def expected(self, **opts):
        scale = opts.pop("scale", self.q.shape[-1] ** -0.5)
        outs, lses = [], []
        for b, (n, nq) in enumerate(zip(self.lengths, self.q_lens)):
            q = self.q[self.cu[b] : self.cu[b + 1]]
            o, lse = naive_attention(q, self.keys[b], self.values[b], n - nq, scale=scale, kv_start=self.kv_start[b], **opts)
            outs.append(o)
            lses.append(lse)
        return torch.from_numpy(np.concatenate(outs)), torch.from_numpy(np.concatenate(lses))

    def run(self, fn, **opts):
        return fn(self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.cu,
                  kv_start=self.kv_start_t, return_lse=True, **opts)


def check(out, lse, exp_out, exp_lse, dtype, what):
    """out / lse against the naive loop: the shared TOL / LSE_TOL bounds, NaN or inf (a
    poisoned slot leaking) fails, and a query that sees no key gives 0 and -inf."""
    assert_attention_close(out, lse, exp_out, exp_lse, dtype, what)


FNS = [pytest.param(paged_attention_ref, id="oracle"), pytest.param(lambda *a, **k: paged_attention(*a, backend="torch", **k), id="public-torch")]

OPTS = [
    pytest.param(dict(), id="causal"),
    pytest.param(dict(causal=False), id="non-causal"),
    pytest.param(dict(window_left=0), id="window0"),
    pytest.param(dict(window_left=5), id="window5"),
    pytest.param(dict(window_left=5, sink_tokens=3), id="window5-sinks3-outside"),
    pytest.param(dict(window_left=60, sink_tokens=4), id="window60-sinks4-inside"),
    pytest.param(dict(chunk_size=7), id="block-causal7"),
    pytest.param(dict(chunk_size=16, window_left=20, sink_tokens=2), id="block-causal16-window20-sinks2"),
    pytest.param(dict(softcap=3.0), id="softcap3"),
    pytest.param(dict(causal=False, softcap=0.5, scale=0.3), id="non-causal-softcap-scale"),
]


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("group", [1, 4, 5], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("opts", OPTS)
def test_matches_naive_loop(seed, fn, group: int, opts: dict) -> None:
    case = Case([1, 17, 100], [1, 17, 9], group=group, kv_start=[0, 3, 41])
    out, lse = case.run(fn, **opts)
    check(out, lse, *case.expected(**opts), torch.float32, f"{opts} group {group}")


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dtypes_with_full_prefill(seed, fn, dtype) -> None:
    case = Case([100, 17, 1], [100, 5, 1], group=4, dtype=dtype)
    opts = dict(window_left=30, sink_tokens=2, softcap=4.0)
    out, lse = case.run(fn, **opts)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    check(out, lse, *case.expected(**opts), dtype, f"{dtype}")


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize(
    "opts",
    [
        pytest.param(dict(window_left=0), id="window0"),
        pytest.param(dict(window_left=1), id="window1"),
        pytest.param(dict(window_left=7, sink_tokens=3), id="window7-sinks3"),
        pytest.param(dict(chunk_size=9), id="block-causal9"),
        pytest.param(dict(chunk_size=9, window_left=4, sink_tokens=1), id="block-causal9-window4-sinks1"),
    ],
)
def test_mask_boundaries_exactly(fn, opts: dict) -> None:
    """q = 0 makes attention uniform over the visible keys and v = one-hot(position) shows
    which keys those are: the support must be exactly the rule's."""
    n = 100
    d = 104
    eye = torch.eye(n, d, dtype=torch.float64)[:, None, :].expand(n, 1, d).contiguous()
    table = torch.arange(math.ceil(n / 48), dtype=torch.int32)[None]
    cache = torch.zeros(table.shape[1] * 48, 1, d, dtype=torch.float64)
    cache[:n] = eye
    cache = cache.view(-1, 48, 1, d)
    q = torch.zeros(n, 1, d, dtype=torch.float64)
    out = fn(q, cache, cache, table, torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), **opts)
    w, s, c = opts.get("window_left"), opts.get("sink_tokens", 0), opts.get("chunk_size")
    for p in range(n):
        seen = set(torch.nonzero(out[p, 0, :n] > 0).flatten().tolist())
        want = {t for t in range(n) if (t // c <= p // c if c else t <= p) and (w is None or t >= p - w or t < s)}
        assert seen == want, f"query {p}: sees {sorted(seen ^ want)} wrongly ({opts})"
        if w is not None and p - w - 1 >= s:
            assert p - w in seen and p - w - 1 not in seen, f"query {p}: window edge"


@pytest.mark.parametrize("fn", FNS)
def test_rows_that_see_nothing_give_zero_and_neg_inf(fn) -> None:
    # kv_start == seq_len hides every key; a seq_len-0 row with no queries sits between.
    case = Case([17, 0, 30], [2, 0, 3], group=4, kv_start=[17, 0, 5])
    out, lse = case.run(fn, causal=False)
    assert torch.all(out[:2] == 0) and torch.all(torch.isneginf(lse[:2]))
    check(out, lse, *case.expected(causal=False), torch.float32, "empty rows")


def test_seq_len_zero_rows_with_a_query_are_padding() -> None:
    """A CUDA-graph batch pads with seq_len-0 rows that still own a query row."""
    case = Case([5, 0], [1, 1], group=1)
    ref_out, ref_lse = case.run(paged_attention_ref)
    pub_out, pub_lse = case.run(paged_attention, backend="torch", max_seqlen_q=1, max_seqlen_k=5)
    for out, lse in ((ref_out, ref_lse), (pub_out, pub_lse)):
        assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    check(pub_out, pub_lse, *case.expected(), torch.float32, "padding row (public)")
    check(ref_out, ref_lse, *case.expected(), torch.float32, "padding row (oracle)")


# ---------------------------------------------------------------------------------------
# The CPU fast path: SDPA's flash kernel when no position rule hides a key in range

def _sdpa_path(case: Case, **opts):
    spec = AttentionSpec(**opts)
    return paged_attention_sdpa(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, case.cu,
                                case.kv_start_t, spec=spec, max_seqlen_q=max(case.q_lens),
                                max_seqlen_k=max(case.lengths))


# (id, lengths, q_lens, kv_start, options): every query sees all of [kv_start, L).
FAST = [
    ("decode-ragged-lengths-kv_start", [1, 17, 100], [1, 1, 1], [0, 3, 41], dict()),
    ("decode-equal-lengths", [96, 96], [1, 1], None, dict()),
    ("decode-window-covers-all", [100, 17], [1, 1], None, dict(window_left=99)),
    ("decode-window-cut-only-in-sinks", [60, 40], [1, 1], None, dict(window_left=10, sink_tokens=49)),
    ("decode-padding-row-and-hidden-row", [17, 0, 30], [1, 1, 1], [17, 0, 5], dict()),
    ("chunk-block-causal-aligned", [14, 21, 49], [7, 7, 7], None, dict(chunk_size=7)),
    ("chunk-non-causal", [100, 17, 48], [9, 9, 9], [0, 2, 0], dict(causal=False)),
]
# (id, lengths, q_lens, options): a position rule hides keys, the query counts differ, or
# softcap: the batched path must run instead (the call still matches, see the grids above).
DECLINED = [
    ("causal-prefill", [17, 30], [5, 5], dict()),
    ("window-cuts", [100], [1], dict(window_left=10)),
    # The first query's window covers every key, the last query's does not.
    ("window-cuts-for-the-last-query-only", [4], [2], dict(causal=False, window_left=2)),
    ("block-causal-chunk-straddles", [15], [7], dict(chunk_size=7)),
    ("ragged-query-counts", [17, 30], [1, 2], dict(causal=False)),
    ("softcap", [17], [1], dict(softcap=3.0)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 5], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize(("lengths", "q_lens", "kv_start", "opts"), [pytest.param(*f[1:], id=f[0]) for f in FAST])
def test_sdpa_fast_path_runs_and_matches_naive_loop(seed, dtype, group, lengths, q_lens, kv_start, opts) -> None:
    """Unused slots are NaN and the block table's padding entries point out of range, so a
    gathered slot past L or below kv_start that met a weight would show."""
    case = Case(lengths, q_lens, group=group, dtype=dtype, kv_start=kv_start)
    res = _sdpa_path(case, **opts)
    assert res is not None, "the fast path declined a call with no position mask"
    out, lse = res
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    check(out, lse, *case.expected(**opts), dtype, f"sdpa path {opts}")
    pub_out, pub_lse = case.run(paged_attention, backend="torch", **opts)  # what the pools run
    check(pub_out, pub_lse, *case.expected(**opts), dtype, f"public op {opts}")


@pytest.mark.parametrize(("lengths", "q_lens", "opts"), [pytest.param(*f[1:], id=f[0]) for f in DECLINED])
def test_sdpa_fast_path_declines_masked_calls(lengths, q_lens, opts) -> None:
    case = Case(lengths, q_lens, group=4)
    assert _sdpa_path(case, **opts) is None


def test_sdpa_fast_path_takes_q_with_a_strided_head_dim(seed) -> None:
    """q's head_dim need not be contiguous (the public op accepts any strides); the CPU
    kernel assumes it is, so the fast path copies such a q first."""
    case = Case([17, 30], [1, 1], group=2)
    case.q = case.q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, stride(-1) != 1
    assert case.q.stride(-1) != 1
    out, lse = _sdpa_path(case)
    check(out, lse, *case.expected(), torch.float32, "strided q")


def test_torch_path_with_no_keys_keeps_q_in_the_graph() -> None:
    """Every seq_len 0 (a padding-only batch): out = 0, and backward gives q a zero
    gradient instead of failing on an output detached from q."""
    q = torch.randn(2, 4, 16, requires_grad=True)
    cache = torch.randn(2, 4, 2, 16)
    out = paged_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                          torch.zeros(2, dtype=torch.int32), backend="torch")
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_sdpa_fast_path_declines_fake_tensors() -> None:
    """Under FakeTensorMode nothing can be read on the host: the batched path traces instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = Case([17, 30], [1, 1], group=4, poison=False)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in (case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, case.cu)]
        spec = AttentionSpec()
        assert paged_attention_sdpa(*fake, None, spec=spec, max_seqlen_q=1, max_seqlen_k=30) is None


# ---------------------------------------------------------------------------------------
# store_kv
STORES = [pytest.param(store_kv_ref, id="oracle"), pytest.param(lambda *a: store_kv(*a, backend="torch"), id="public-torch")]


@pytest.mark.parametrize("fn", STORES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_store_kv_scatters_and_skips_negative_slots(seed, fn, slot_dtype) -> None:
    kc = torch.randn(6, 48, H_KV, 80)
    vc = torch.randn_like(kc)
    k, v = torch.randn(9, H_KV, 80), torch.randn(9, H_KV, 80)
    slots = torch.tensor([0, 47, -1, 48, 287, -5, 100, 101, 3], dtype=slot_dtype)
    ek, ev = kc.clone(), vc.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            ek[s // 48, s % 48] = k[i]
            ev[s // 48, s % 48] = v[i]
    fn(k, v, kc, vc, slots)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


@pytest.mark.parametrize("fn", STORES)
@pytest.mark.parametrize(
    "slots, match",
    [pytest.param([1, 2, 1], "twice", id="duplicate"), pytest.param([0, 96], "past the cache", id="out-of-range")],
)
def test_store_kv_rejects_bad_slots_and_writes_nothing(fn, slots, match) -> None:
    kc = torch.randn(2, 48, H_KV, 8)
    vc = torch.randn_like(kc)
    before = (kc.clone(), vc.clone())
    k = torch.randn(len(slots), H_KV, 8)
    with pytest.raises(ValueError, match=match):
        fn(k, k, kc, vc, torch.tensor(slots))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


# ---------------------------------------------------------------------------------------
# merge
MERGES = [pytest.param(merge_attention_states_ref, id="oracle"), pytest.param(lambda *a: merge_attention_states(*a, backend="torch"), id="public-torch")]


@pytest.mark.parametrize("fn", MERGES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_merge_of_two_key_halves_equals_attention_over_all(seed, fn, dtype) -> None:
    case = Case([96, 48], [4, 3], group=4, block_size=48, dtype=dtype)
    full_out, full_lse = case.run(paged_attention_ref, causal=False)
    first = case.block_table[:, :1].contiguous()
    second = case.block_table[:, 1:2].contiguous()
    lens_a = torch.tensor([48, 48], dtype=torch.int32)
    lens_b = torch.tensor([48, 0], dtype=torch.int32)  # the second row has no second half: -inf
    common = dict(causal=False, return_lse=True)
    oa, la = paged_attention_ref(case.q, case.k_cache, case.v_cache, first, lens_a, case.cu, **common)
    ob, lb = paged_attention_ref(case.q, case.k_cache, case.v_cache, second, lens_b, case.cu, **common)
    ob[4:] = float("nan")  # an empty part's out must not leak
    out, lse = fn(oa, la, ob, lb)
    exp_out, exp_lse = case.expected(causal=False)
    check(out, lse, exp_out, exp_lse, dtype, "merged halves")
    check(full_out, full_lse, exp_out, exp_lse, dtype, "full")


@pytest.mark.parametrize("fn", MERGES)
def test_merge_of_two_empty_parts_is_zero(fn) -> None:
    o = torch.full((3, 2, 8), float("nan"))
    lse = torch.full((3, 2), float("-inf"))
    out, merged = fn(o, lse, o.clone(), lse.clone())
    assert torch.all(out == 0) and torch.all(torch.isneginf(merged))


# ---------------------------------------------------------------------------------------
# validation of the public op
def _valid_args():
    case = Case([10, 5], [2, 1], group=2, d=16, block_size=4, poison=False)
    return dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, block_table=case.block_table, seq_lens=case.seq_lens, cu_seqlens_q=case.cu)


BAD = [
    pytest.param(lambda a: a.update(q=a["q"][0]), ValueError, "q", id="q-2d"),
    pytest.param(lambda a: a.update(q=a["q"].double()), TypeError, "k_cache", id="dtype-mismatch"),
    pytest.param(lambda a: a.update(q=a["q"].to(torch.int32)), TypeError, "q", id="q-int"),
    pytest.param(lambda a: a.update(q=a["q"][:, :3]), ValueError, "H_q", id="gqa-ratio"),
    pytest.param(lambda a: a.update(v_cache=a["v_cache"][:, :2]), ValueError, "v_cache", id="v-shape"),
    pytest.param(lambda a: a.update(k_cache=a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "k_cache.*contiguous", id="k-last-dim-strided"),
    pytest.param(lambda a: a.update(q=a["q"][..., :12], k_cache=a["k_cache"][..., :12], v_cache=a["v_cache"][..., :12]), ValueError, "head_dim", id="head-dim-12"),
    pytest.param(lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table", id="table-int64"),
    pytest.param(lambda a: a.update(seq_lens=a["seq_lens"][:1]), ValueError, "seq_lens", id="seq-lens-shape"),
    pytest.param(lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:2]), ValueError, "cu_seqlens_q", id="cu-shape"),
    pytest.param(lambda a: a.update(window_left=-1), ValueError, "window_left", id="window-negative"),
    pytest.param(lambda a: a.update(chunk_size=0), ValueError, "chunk_size", id="chunk-size-0"),
    pytest.param(lambda a: a.update(sink_tokens=-2), ValueError, "sink_tokens", id="sinks-negative"),
    pytest.param(lambda a: a.update(softcap=-1.0), ValueError, "softcap", id="softcap-negative"),
    pytest.param(lambda a: a.update(scale=float("inf")), ValueError, "scale", id="scale-inf"),
    pytest.param(lambda a: a.update(backend="cuda"), ValueError, "backend", id="backend-name"),
    pytest.param(lambda a: a.update(seq_lens=torch.tensor([10, 99], dtype=torch.int32)), ValueError, "seq_lens", id="seq-len-over-capacity"),
    pytest.param(lambda a: a.update(seq_lens=torch.tensor([1, 5], dtype=torch.int32)), ValueError, "seq_lens", id="fewer-keys-than-queries"),
    pytest.param(lambda a: a["block_table"].__setitem__((0, 1), 99), ValueError, "block_table.*99", id="block-id-out-of-range"),
    pytest.param(lambda a: a.update(kv_start=torch.tensor([11, 0], dtype=torch.int32)), ValueError, "kv_start", id="kv-start-past-seq-len"),
    pytest.param(lambda a: a.update(max_seqlen_k=3), ValueError, "max_seqlen_k", id="max-seqlen-k-too-small"),
    pytest.param(lambda a: a.update(cu_seqlens_q=torch.tensor([0, 2, 2], dtype=torch.int32)), ValueError, "cu_seqlens_q", id="cu-end"),
    pytest.param(lambda a: a.update(out=torch.empty(3, 4, 8)), ValueError, "out", id="out-shape"),
]


@pytest.mark.parametrize("mutate, exc, match", BAD)
def test_public_op_rejects_bad_input_naming_the_argument(seed, mutate, exc, match) -> None:
    args = _valid_args()
    paged_attention(**args, backend="torch")  # the unmodified call is fine
    args["backend"] = "torch"
    mutate(args)
    with pytest.raises(exc, match=match):
        paged_attention(**args)


def test_store_kv_and_merge_reject_bad_input() -> None:
    kc = torch.zeros(2, 4, H_KV, 8)
    k = torch.zeros(3, H_KV, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, kc, kc.clone(), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="slot_mapping"):
        store_kv(k, k, kc, kc.clone(), torch.zeros(3))
    with pytest.raises(TypeError, match="k"):
        store_kv(k.half(), k.half(), kc, kc.clone(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="k"):
        store_kv(torch.zeros(3, 1, 8), torch.zeros(3, 1, 8), kc, kc.clone(), torch.arange(3))
    o, lse = torch.zeros(3, 2, 8), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="lse_b"):
        merge_attention_states(o, lse, o, lse[:2])
    with pytest.raises(TypeError, match="lse_a"):
        merge_attention_states(o, lse.half(), o, lse)
    with pytest.raises(ValueError, match="out_b"):
        merge_attention_states(o, lse, o[:, :1], lse)
