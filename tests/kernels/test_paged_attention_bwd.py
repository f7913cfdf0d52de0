"""Triton backward of block-table attention vs autograd through a dense fp64 reference.

The reference is written here from docs/contract.md's visibility rules (one sequence at a
time: keys gathered through the block table, an explicit mask, softmax, autograd in
fp64), independent of the kernels and of ``kvarena.attention.reference``. Unused cache
slots are NaN (``paged_case``), so a backward that read them would show it.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import DEVICE, gpu_test, interpreter_test, paged_case

from kvarena.attention import AttentionSpec, dispatch
from kvarena.attention.batch import CacheView, KeySet, QueryRows
from kvarena.attention.launch import dense_own_keys, history_and_own_forward
from kvarena.kernels import paged_attention_bwd as bwd
from kvarena.kernels.placement import OWN_AFTER_HISTORY, OWN_AT_QUERIES

# Relative L2 error of each gradient: the bounds (the backward recomputes P from a
# rounded lse and multiplies rounded dS tiles, so bf16 gets more room than the forward).
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _seam(args, max_q: int, max_k: int):
    """``(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start)`` as the
    dispatcher's cache view, key set and query rows."""
    _q, kc, vc, bt, sl, cu, ks = args
    return CacheView(kc, vc), KeySet(bt, sl, max_k, ks), QueryRows(cu, max_q)


def _visible(q_pos: int, t: int, spec: AttentionSpec, kv_lo: int) -> bool:
    if t < kv_lo:
        return False
    if spec.causal:
        c = spec.chunk_size
        if (t // c > q_pos // c) if c else t > q_pos:
            return False
    return spec.window_left is None or t >= q_pos - spec.window_left or t < spec.sink_tokens


def dense_reference(case, own, mode, spec, do, dlse):
    """fp64 (out, lse) and the gradients of ``sum(out * do) + sum(lse * dlse)`` (on the CPU)."""
    q = case["q"].detach().cpu().double().requires_grad_(True)
    own_k = own[0].detach().cpu().double().requires_grad_(True)
    own_v = own[1].detach().cpu().double().requires_grad_(True)
    kc, vc, table = case["k_cache"].cpu().double(), case["v_cache"].cpu().double(), case["block_table"].cpu()
    lens, cu = case["seq_lens"].tolist(), case["cu_seqlens_q"].tolist()
    starts = case["kv_start"].tolist() if case["kv_start"] is not None else [0] * len(lens)
    h_q, d = q.shape[1], q.shape[2]
    h_kv = kc.shape[2]
    group, bs = h_q // h_kv, kc.shape[1]
    scale = spec.scale_for(d)
    outs, lses = [], []
    for b, n in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        qn = q1 - q0
        keys, vals, pos = [], [], []
        for t in range(n):
            if mode == OWN_AT_QUERIES and t >= n - qn:
                i = q0 + t - (n - qn)
                keys.append(own_k[i])
                vals.append(own_v[i])
            else:
                blk = int(table[b, t // bs])
                keys.append(kc[blk, t % bs])
                vals.append(vc[blk, t % bs])
            pos.append(t)
        if mode == OWN_AFTER_HISTORY:
            for i in range(own_k.shape[1]):
                keys.append(own_k[b, i])
                vals.append(own_v[b, i])
                pos.append(None)  # after the history: visible to every query
        if not keys:
            outs.append(torch.zeros(qn, h_q, d, dtype=torch.float64))
            lses.append(torch.full((qn, h_q), float("-inf"), dtype=torch.float64))
            continue
        k = torch.stack(keys).repeat_interleave(group, 1)  # [L, H_q, D]
        v = torch.stack(vals).repeat_interleave(group, 1)
        vis = torch.tensor([[p is None or _visible(n - qn + i, p, spec, starts[b]) for p in pos] for i in range(qn)])
        # Hidden keys are zeroed first: their slots may hold NaN.
        k = torch.where(vis.any(0)[:, None, None], k, torch.zeros((), dtype=k.dtype))
        v = torch.where(vis.any(0)[:, None, None], v, torch.zeros((), dtype=v.dtype))
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], k) * scale
        if spec.softcap:
            s = spec.softcap * torch.tanh(s / spec.softcap)
        s = s.masked_fill(~vis[None], float("-inf"))
        lse = torch.logsumexp(s, -1)  # [H_q, Q]
        p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        lses.append(lse.transpose(0, 1))
    out, lse = torch.cat(outs), torch.cat(lses)
    dl = torch.where(torch.isneginf(lse), 0.0, lse)
    loss = (out * do.cpu().double()).sum() + (dl * dlse.cpu().double()).sum()
    loss.backward()
    return q.grad, own_k.grad, own_v.grad


def _rel(got, ref):
    got, ref = got.cpu().double(), ref.cpu().double()
    assert torch.isfinite(got).all(), "NaN/inf in a gradient"
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


# (id, lens, q_lens, kv_start, options, mode): tiny and odd (head_dim 40, pages of 5/7).
CASES = [
    ("new-keys-causal-gqa4", [9, 23], [9, 6], None, dict(), OWN_AT_QUERIES),
    ("new-keys-window-sinks-kvstart", [30, 17], [5, 1], [4, 0], dict(window_left=6, sink_tokens=2),
     OWN_AT_QUERIES),
    ("new-keys-block-causal-softcap", [21], [14], None, dict(chunk_size=7, softcap=2.5), OWN_AT_QUERIES),
    ("own-keys-after-history", [14, 0], [5, 5], None, dict(causal=False), OWN_AFTER_HISTORY),
    ("own-keys-softcap-short-history", [3, 10], [4, 4], None, dict(causal=False, softcap=3.0),
     OWN_AFTER_HISTORY),
]


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("lens", "q_lens", "kv_start", "opts", "mode"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_backward_kernels_match_dense_fp64_autograd(seed, dtype, lens, q_lens, kv_start, opts, mode):
    _check_backward(seed, dtype, lens, q_lens, kv_start, opts, mode)


# bf16 subnormals (below 2**-126) on one side of the dot, scaled up on the other so the
# scores are O(1): (q_scale, kv_scale). The gradient that carries the huge side checks it.
# Mostly subnormal (|randn| < 1.18: 76%) against 4e36 at scale 1: gradients stay below fp32 max.
BWD_SUBNORMAL = {"q-subnormal": (1e-38, 4e36), "k-subnormal": (4e36, 1e-38)}


@gpu_test
@pytest.mark.parametrize("name", list(BWD_SUBNORMAL))
def test_backward_reads_bf16_subnormals(seed, name):
    """Issue 41 sweep (the #9 pattern in the backward): the interpreter widened bf16 q, dO,
    K and V with its plain cast, wrong for subnormals."""
    q_scale, kv_scale = BWD_SUBNORMAL[name]
    _check_backward(seed, torch.bfloat16, [9, 23], [9, 6], None, dict(scale=1.0), OWN_AT_QUERIES, q_scale=q_scale,
                    kv_scale=kv_scale)


def _check_backward(seed, dtype, lens, q_lens, kv_start, opts, mode, q_scale=1.0, kv_scale=1.0):
    group = 4 if mode == OWN_AT_QUERIES and not kv_start else 1
    h_kv = 1 if group == 4 else 2
    case = paged_case(lens, q_lens, dtype=dtype, group=group, h_kv=h_kv, head_dim=40, block_size=5 if group == 4 else 7,
                      seed=seed, kv_start=kv_start, q_scale=q_scale, kv_scale=kv_scale)
    spec = AttentionSpec(**opts)
    gen = torch.Generator().manual_seed(seed + 1)
    q = case["q"]
    total_q, h_q, d = q.shape
    if mode == OWN_AT_QUERIES:
        # The rows' own keys as stored in the cache (the forward reads them from there).
        own_k = torch.empty(total_q, h_kv, d, dtype=dtype, device=DEVICE)
        own_v = torch.empty_like(own_k)
        bs = case["k_cache"].shape[1]
        for b, (n, q0, q1) in enumerate(zip(lens, case["cu_seqlens_q"][:-1].tolist(), case["cu_seqlens_q"][1:].tolist())):
            for i in range(q1 - q0):
                t = n - (q1 - q0) + i
                blk = int(case["block_table"][b, t // bs])
                own_k[q0 + i], own_v[q0 + i] = case["k_cache"][blk, t % bs], case["v_cache"][blk, t % bs]
    else:
        own_k = torch.randn(len(lens), 6, h_kv, d, generator=gen).to(DEVICE, dtype)
        own_v = torch.randn(len(lens), 6, h_kv, d, generator=gen).to(DEVICE, dtype)
    args = (q, case["k_cache"], case["v_cache"], case["block_table"], case["seq_lens"], case["cu_seqlens_q"],
            case["kv_start"])
    fwd_spec = spec.replace(return_lse=True)
    if mode == OWN_AT_QUERIES:
        out, lse = dispatch.attend(q, *_seam(args, max(q_lens), max(lens)), spec=fwd_spec, backend="triton")
    else:
        out, lse = history_and_own_forward(q, *_seam(args, max(q_lens), max(lens)), dense_own_keys(own_k, own_v), fwd_spec)
    do = torch.randn(out.shape, generator=gen).to(DEVICE, dtype)
    dlse = torch.randn(lse.shape, generator=gen).to(DEVICE)
    dq, dk, dv = bwd.paged_attention_bwd(do, q, out, lse, dlse, *args[1:], spec=spec, max_seqlen_q=max(q_lens),
                                         own_k=own_k, own_v=own_v, placement=mode)
    rq, rk, rv = dense_reference(case, (own_k, own_v), mode, spec, do, dlse)
    tol = GRAD_TOL[dtype]
    for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        err = _rel(got, ref)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@interpreter_test
@pytest.mark.skipif(DEVICE != "cpu", reason="CPU-lane test")
def test_given_keys_no_query_sees_get_zero_gradient(monkeypatch, seed):
    """A seq_len-0 padding row (CUDA-graph batches) owns a query and a given key, and a key
    below kv_start is given too: their dk/dv rows are 0, not whatever the allocation held
    (every fresh tensor is NaN-filled here)."""
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real(t, **kw).fill_(float("nan")))
    case = paged_case([6, 0], [3, 1], dtype=torch.float32, group=2, h_kv=1, head_dim=24, block_size=5, seed=seed,
                      kv_start=[4, 0])
    spec = AttentionSpec(return_lse=True)
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_table"], case["seq_lens"], case["cu_seqlens_q"],
            case["kv_start"])
    out, lse = dispatch.attend(case["q"], *_seam(args, 3, 6), spec=spec, backend="triton")
    own_k, own_v = torch.randn(4, 1, 24), torch.randn(4, 1, 24)  # rows 0-2: positions 3-5 of seq 0; row 3: padding
    dq, dk, dv = bwd.paged_attention_bwd(torch.randn_like(out), case["q"], out, lse, None, *args[1:], spec=spec,
                                         max_seqlen_q=3, own_k=own_k, own_v=own_v)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), f"{name} holds unwritten rows"
    assert torch.equal(dk[0], torch.zeros_like(dk[0])) and torch.equal(dv[0], torch.zeros_like(dv[0])), "below kv_start"
    assert torch.equal(dk[3], torch.zeros_like(dk[3])) and torch.equal(dv[3], torch.zeros_like(dv[3])), "padding row"


@interpreter_test
@pytest.mark.skipif(DEVICE != "cpu", reason="CPU-lane test")
def test_rows_that_see_no_key_get_zero_gradient(seed):
    """kv_start == seq_len hides every key of sequence 0: its rows' dq is exactly 0."""
    case = paged_case([8, 12], [3, 4], dtype=torch.float32, group=2, h_kv=1, head_dim=24, block_size=5, seed=seed,
                      kv_start=[8, 0])
    spec = AttentionSpec(causal=False, return_lse=True)
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_table"], case["seq_lens"], case["cu_seqlens_q"],
            case["kv_start"])
    out, lse = dispatch.attend(case["q"], *_seam(args, 4, 12), spec=spec, backend="triton")
    assert torch.isneginf(lse[:3]).all()
    do = torch.randn_like(out)
    dq, _, _ = bwd.paged_attention_bwd(do, case["q"], out, lse, torch.randn_like(lse), *args[1:], spec=spec,
                                       max_seqlen_q=4)
    assert torch.equal(dq[:3], torch.zeros_like(dq[:3]))
    assert torch.isfinite(dq).all()


# ------------------------------------------------------------------- memory: no [queries x keys] buffer


class _LargestOutput(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any op allocates (views of existing tensors are not
    allocations: the arena's per-layer views are skipped)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        if func.is_view:
            return res
        for t in torch.utils._pytree.tree_leaves(res):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return res


def _wan_denoise_and_commit(backend: str) -> _LargestOutput:
    """One Wan-1.3B layer (12 heads, d128, chunk 4680), sinks 1 + window 3, on meta: a
    history of 3 chunks, then the next chunk's denoising step and clean pass with grads."""
    from kvarena import CachePolicy, KVLayout, SlabKVCache

    h, d, t = 12, 128, 4680
    layout = KVLayout(num_layers=1, num_kv_heads=h, head_dim=d, dtype=torch.bfloat16)
    policy = CachePolicy("slab_kv", max_bytes=5 * layout.block_bytes(t), per_component={"sinks": 1, "window": 3})
    pool = SlabKVCache(policy, layout=layout, slab_tokens=t, device="meta")

    def qkv(grad):
        return [torch.empty(1, t, hh, d, dtype=torch.bfloat16, device="meta", requires_grad=grad) for hh in (h, h, h)]

    with torch.no_grad():
        for c in range(3):
            meta = pool.plan({"video": c})
            pool.forward(*qkv(False), meta, 0, commit=True, backend=backend)
    meta = pool.plan({"video": 3})
    rec = _LargestOutput()
    with rec:
        for commit in (False, True):
            q, k, v = qkv(True)
            out = pool.forward(q, k, v, meta, 0, commit=commit, backend=backend)
            out.float().sum().backward()
            assert q.grad is not None and k.grad is not None and v.grad is not None
    return rec


def test_training_step_at_wan_shapes_allocates_no_score_sized_tensor():
    """Forward + backward through SlabKVCache.forward (both commit modes) at Wan-1.3B
    shapes on the meta device: with backend="triton" nothing larger than a few
    [tokens, heads, head_dim] tensors is allocated; the torch path (the yardstick, same
    mode) allocates [heads, queries, keys] fp32 scores, so the check can fail."""
    row = 4680 * 12 * 128  # tokens x heads x head_dim
    triton_rec = _wan_denoise_and_commit("triton")
    assert triton_rec.largest <= 2 * row, f"{triton_rec.op} made {triton_rec.largest} elements (> 2 x {row})"
    torch_rec = _wan_denoise_and_commit("torch")
    assert torch_rec.largest >= 4680 * 4680 * 12, "the yardstick should materialize scores"


@gpu_test
def test_slab_training_step_composes_with_checkpoint(seed):
    """torch.utils.checkpoint recomputes the layer's forward in backward with the same
    metadata (no plan in between): the gradients equal the plain run's."""
    from torch.utils.checkpoint import checkpoint

    from kvarena import CachePolicy, KVLayout, SlabKVCache

    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=24, dtype=torch.float32)
    policy = CachePolicy("slab_kv", max_bytes=4 * layout.block_bytes(5), per_component={"sinks": 1, "window": 2})
    pool = SlabKVCache(policy, layout=layout, slab_tokens=5, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in range(2):
            meta = pool.plan({"v": c})
            pool.forward(*(torch.randn(1, 5, h, 24, generator=gen).to(DEVICE) for h in (4, 2, 2)), meta, 0, commit=True)
    meta = pool.plan({"v": 2})
    x = [torch.randn(1, 5, h, 24, generator=gen).to(DEVICE) for h in (4, 2, 2)]
    w = torch.randn(1, 5, 4, 24, generator=gen).to(DEVICE)

    def layer(q, k, v):
        return pool.forward(q, k, v, meta, 0, commit=False, backend="triton")

    grads = []
    for use_ckpt in (False, True):
        q, k, v = (t.clone().requires_grad_(True) for t in x)
        out = checkpoint(layer, q, k, v, use_reentrant=False) if use_ckpt else layer(q, k, v)
        (out * w).sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for name, a, b in zip("qkv", *grads):
        assert torch.equal(a, b), f"d{name} differs under checkpoint"


@gpu_test
@pytest.mark.parametrize("commit", [False, True], ids=["denoise", "commit"])
def test_compiled_training_step_keeps_the_triton_backward(monkeypatch, seed, commit):
    """torch.compile(fullgraph=True) of a layer's forward + loss: the graph calls the Triton
    forward and backward ops (fake kernels at trace time), never the score-materializing
    torch path, and the gradients equal eager."""
    from kvarena import CachePolicy, KVLayout, SlabKVCache
    from kvarena.attention import torch_path
    from kvarena.kernels import paged_attention_bwd as bwd_mod

    calls = []
    real_bwd = bwd_mod.paged_attention_bwd

    def counting_bwd(*args, **kwargs):
        calls.append(kwargs.get("placement"))
        return real_bwd(*args, **kwargs)

    def no_torch_path(*args, **kwargs):
        raise AssertionError("the torch path ran under backend='triton'")

    monkeypatch.setattr(bwd_mod, "paged_attention_bwd", counting_bwd)
    monkeypatch.setattr(torch_path, "paged_attention_torch", no_torch_path)

    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=24, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn(1, 5, h, 24, generator=gen).to(DEVICE) for h in (4, 2, 2)]
    w = torch.randn(1, 5, 4, 24, generator=gen).to(DEVICE)
    hist = [[torch.randn(1, 5, h, 24, generator=gen).to(DEVICE) for h in (4, 2, 2)] for _ in range(2)]
    grads = {}
    for mode in ("eager", "compiled"):
        policy = CachePolicy("slab_kv", max_bytes=4 * layout.block_bytes(5), per_component={"sinks": 1, "window": 2})
        pool = SlabKVCache(policy, layout=layout, slab_tokens=5, device=DEVICE)
        with torch.no_grad():
            for c in range(2):
                pool.forward(*hist[c], pool.plan({"v": c}), 0, commit=True)
        meta = pool.plan({"v": 2})

        def step(q, k, v, pool=pool, meta=meta):
            return (pool.forward(q, k, v, meta, 0, commit=commit, backend="triton") * w).sum()

        fn = step if mode == "eager" else torch.compile(step, fullgraph=True, backend="aot_eager")
        q, k, v = (t.clone().requires_grad_(True) for t in x)
        calls.clear()
        fn(q, k, v).backward()
        assert calls == [1 if not commit else 0], f"{mode}: Triton backward calls {calls}"
        grads[mode] = (q.grad, k.grad, v.grad)
    for name, a, b in zip("qkv", grads["eager"], grads["compiled"]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), f"d{name}: compiled differs from eager"
