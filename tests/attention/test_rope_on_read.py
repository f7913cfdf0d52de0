"""RoPE on read (issue 14, part 2): pools store un-rotated keys, the kernels rotate q and k.

The reference rotates explicitly, in fp64, with an implementation of its own (complex
multiplication for interleaved pairs, ``rotate_half`` for half-split pairs), at the
positions the contract defines, then attends densely:

* absolute: a key's logical token index, a query's own token index;
* virtual (slab pool): the index in the concatenation of the keys a chunk sees (sinks,
  window, its own tokens), queries at their own tokens' indices in it.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import DEVICE, GPU, TOL, TRITON, assert_close, device_for, gpu_test, one_torch_thread  # noqa: F401

from kvarena import AttentionSpec, CachePolicy, KVLayout, PagedKVCache, paged_attention
from kvarena.attention.fp8 import dequantize_fp8, fp8_row_scales, quantize_fp8
from kvarena.attention.reference import paged_attention_ref
from kvarena.attention.rope import rope_table, wan_rope_table
from kvarena.cache.slab import SlabKVCache

BACKENDS = ["torch", TRITON]


def _rot(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """fp64 rotation of ``x [n, H, D]`` at positions ``pos [n]`` (independent of the package)."""
    x = x.double()
    c, s = cos.double()[pos][:, None, :], sin.double()[pos][:, None, :]
    if interleaved:
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def _dense(q, k, v):
    """fp64 full attention of ``q [n, H_q, D]`` over ``k, v [L, H_kv, D]``."""
    g = q.shape[1] // k.shape[1]
    kd, vd = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kd) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vd)


# --------------------------------------------------------------------------- tables


def test_wan_table_matches_wans_own_construction() -> None:
    """Wan 2.1 builds per-axis complex frequencies (rope_params), splits the D/2 channels
    c - 2(c//3) / c//3 / c//3 and joins them per (frame, height, width): restated here."""
    f_n, h_n, w_n, d = 3, 2, 5, 80
    cos, sin = wan_rope_table(f_n, h_n, w_n, d)
    c = d // 2

    def params(n, dim):
        freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return torch.polar(torch.ones(n, len(freqs), dtype=torch.float64), torch.outer(torch.arange(n).double(), freqs))

    pf, ph, pw = params(f_n, d - 4 * (d // 6)), params(h_n, 2 * (d // 6)), params(w_n, 2 * (d // 6))
    assert pf.shape[1] + ph.shape[1] + pw.shape[1] == c
    for f in range(f_n):
        for h in range(h_n):
            for w in range(w_n):
                z = torch.cat([pf[f], ph[h], pw[w]])
                row = f * h_n * w_n + h * w_n + w
                assert torch.allclose(cos[row].double(), z.real, atol=1e-7)
                assert torch.allclose(sin[row].double(), z.imag, atol=1e-7)


# --------------------------------------------------------------------------- functional op


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize(("bs", "dtype", "causal", "fp8"), [
    (5, torch.float32, True, False),
    (48, torch.bfloat16, True, False),
    (64, torch.bfloat16, False, False),  # large-block path on the Triton backend
    (16, torch.bfloat16, True, True),    # fp8 storage + RoPE on read
], ids=["page5-fp32", "page48-bf16", "large-bf16", "fp8"])
def test_paged_attention_rotates_like_explicit_rope(backend, interleaved, bs, dtype, causal, fp8) -> None:
    g = torch.Generator().manual_seed(3)
    lens, q_lens, h_kv, group, d = [1, 17, 100], [1, 5, 3], 2, 4, 80
    cos, sin = rope_table(160, d)
    per = [-(-n // bs) for n in lens]
    nb = sum(per) + 2
    kc = torch.full((nb, bs, h_kv, d), float("nan"))  # unused slots NaN
    vc = torch.full((nb, bs, h_kv, d), float("nan"))
    ids = torch.randperm(nb, generator=g)
    table = torch.zeros(3, max(per), dtype=torch.int32)
    at = 0
    for b, n in enumerate(lens):
        table[b, : per[b]] = ids[at : at + per[b]].int()
        at += per[b]
        rows = (table[b, : per[b]].long()[:, None] * bs + torch.arange(bs)).flatten()[:n]
        kc.view(-1, h_kv, d)[rows] = torch.randn(n, h_kv, d, generator=g)
        vc.view(-1, h_kv, d)[rows] = torch.randn(n, h_kv, d, generator=g)
    shift = torch.randint(0, 30, (3, 1), generator=g).int().expand(3, max(per)).contiguous()
    shift[:, 1:] += 7  # a different shift from the second block on
    q_pos = torch.tensor([40, 3, 17], dtype=torch.int32)
    q = torch.randn(sum(q_lens), h_kv * group, d, generator=g)
    cu = torch.tensor([0, 1, 6, 9], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    kw = {}
    k_in, v_in, kd, vd = kc.to(dtype), vc.to(dtype), kc.to(dtype).double(), vc.to(dtype).double()
    if fp8:
        k8, v8 = torch.zeros_like(kc, dtype=torch.float8_e4m3fn), torch.zeros_like(vc, dtype=torch.float8_e4m3fn)
        ks, vs = fp8_row_scales(kc.nan_to_num()), fp8_row_scales(vc.nan_to_num())
        k8.copy_(quantize_fp8(kc.nan_to_num(), ks))
        v8.copy_(quantize_fp8(vc.nan_to_num(), vs))
        k_in, v_in, kw = k8, v8, dict(k_scale=ks, v_scale=vs)
        kd, vd = dequantize_fp8(k8, ks, torch.float64), dequantize_fp8(v8, vs, torch.float64)
    # Reference: every stored key rotated at t + shift[b, t // bs], queries at q_pos[b] + i.
    kr = kd.clone()
    qr = q.to(dtype).double().clone()
    for b, n in enumerate(lens):
        t = torch.arange(n)
        blk, row = table[b, t // bs].long(), t % bs
        kr[blk, row] = _rot(kd[blk, row], t + shift[b, t // bs].long(), cos, sin, interleaved)
        i = torch.arange(cu[b], cu[b + 1])
        qr[i] = _rot(qr[i], q_pos[b] + torch.arange(len(i)), cos, sin, interleaved)
    ref = paged_attention_ref(qr, kr, vd, table, sl, cu, causal=causal)
    dev = device_for(backend)  # the reference above stays on the CPU
    q, k_in, v_in, table, sl, cu, cos, sin, q_pos, shift = (
        t.to(dev) for t in (q, k_in, v_in, table, sl, cu, cos, sin, q_pos, shift))
    kw = {n: t.to(dev) for n, t in kw.items()}
    out = paged_attention(q.to(dtype), k_in, v_in, table, sl, cu, causal=causal, backend=backend, rope_cos=cos,
                          rope_sin=sin, rope_interleaved=interleaved, rope_q_pos=q_pos, rope_k_shift=shift, **kw)
    assert_close(out, ref, dtype, f"rope {backend} bs={bs} interleaved={interleaved}")


def test_functional_errors_and_gradients() -> None:
    cos, sin = rope_table(20, 16)
    kc, vc = torch.randn(4, 4, 1, 16), torch.randn(4, 4, 1, 16)
    table, sl = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="rope_cos: expected D/2 = 8 columns"):
        paged_attention(q, kc, vc, table, sl, rope_cos=cos[:, :4], rope_sin=sin[:, :4])
    with pytest.raises(ValueError, match="rope_cos/rope_sin: give both"):
        paged_attention(q, kc, vc, table, sl, rope_cos=cos)
    with pytest.raises(ValueError, match="rope_k_shift: sequence 0's key positions reach"):
        paged_attention(q, kc, vc, table, sl, rope_cos=cos, rope_sin=sin,
                        rope_k_shift=torch.full((1, 4), 15, dtype=torch.int32))
    with pytest.raises(ValueError, match="rope_q_pos: sequence 0's query positions"):
        paged_attention(q, kc, vc, table, sl, rope_cos=cos, rope_sin=sin, rope_q_pos=torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(ValueError, match="rope_q_pos/rope_k_shift: give rope_cos"):
        paged_attention(q, kc, vc, table, sl, rope_q_pos=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"backend: 'triton' has no backward for this call's gradient \(w.r.t. q \(RoPE"):
        paged_attention(q.clone().requires_grad_(), kc, vc, table, sl, rope_cos=cos, rope_sin=sin, backend="triton")
    with pytest.raises(ValueError, match="rope_sin: expected rope_cos's shape .*strides"):
        paged_attention(q, kc, vc, table, sl, rope_cos=cos, rope_sin=torch.cat([sin, sin], 1)[:, :8])
    # A seq_len-0 padding row (a CUDA-graph batch) sees nothing: its default query position
    # (-1) is not checked; keys hidden by kv_start may lie outside the table.
    two = torch.tensor([[0, 1, 2, 3], [0, 0, 0, 0]], dtype=torch.int32)
    out = paged_attention(torch.randn(2, 2, 16), kc, vc, two, torch.tensor([9, 0], dtype=torch.int32),
                          rope_cos=cos, rope_sin=sin, kv_start=torch.tensor([4, 0], dtype=torch.int32),
                          rope_k_shift=torch.tensor([[-4, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32))
    assert bool((out[1] == 0).all()) and bool(out[0].isfinite().all())
    # The torch path differentiates through the rotation: gradients equal explicit RoPE's.
    qg = q.clone().double().requires_grad_()
    out = paged_attention(qg, kc.double(), vc.double(), table, sl, rope_cos=cos, rope_sin=sin, backend="torch")
    out.square().sum().backward()
    qe = q.clone().double().requires_grad_()
    kr = _rot(kc.double().flatten(0, 1)[:9], torch.arange(9), cos, sin, False)
    ref = _dense(_rot(qe, torch.tensor([8]), cos, sin, False), kr, vc.double().flatten(0, 1)[:9])
    ref.square().sum().backward()
    assert_close(qg.grad, qe.grad, torch.float64, "dq through RoPE on read")


# --------------------------------------------------------------------------- paged pool


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_pool_stores_unrotated_and_rotates_on_read(backend) -> None:
    torch.manual_seed(2)
    dev = device_for(backend)
    d, h_q, h_kv = 16, 4, 2
    cos, sin = rope_table(64, d)
    lay = KVLayout(num_layers=1, num_kv_heads=h_kv, head_dim=d, dtype=torch.float32)
    spec = AttentionSpec(window_left=20, sink_tokens=2, rope_cos=cos.to(dev), rope_sin=sin.to(dev))
    pool = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(8) * 12), layout=lay, block_size=8, attention=spec,
                        device=dev)
    keys, vals = torch.zeros(0, h_kv, d), torch.zeros(0, h_kv, d)
    steps = [23, 1, 1, 6, 1] if backend == "torch" else [13, 1]
    for n in steps:
        m = pool.plan({"a": n})
        q, k, v = torch.randn(n, h_q, d), torch.randn(n, h_kv, d), torch.randn(n, h_kv, d)
        out = pool.forward(q.to(dev), k.to(dev), v.to(dev), m, 0, backend=backend)
        keys, vals = torch.cat([keys, k]), torch.cat([vals, v])
        total = keys.shape[0]
        ids = torch.tensor(pool.block_ids("a"))
        assert torch.equal(pool.region.k(0).cpu()[ids].flatten(0, 1)[:total], keys), "the arena holds un-rotated keys"
        kr = _rot(keys, torch.arange(total), cos, sin, False)
        for i in range(n):
            p = total - n + i
            t = torch.arange(p + 1)
            vis = (t >= p - 20) | (t < 2)
            want = _dense(_rot(q[i : i + 1], torch.tensor([p]), cos, sin, False), kr[: p + 1][vis], vals[: p + 1][vis])
            assert_close(out[i : i + 1], want, torch.float32, f"paged step of {n}, row {i}")
    with pytest.raises(ValueError, match="rope_cos: this step reaches position"):
        short = PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(8) * 12), layout=lay, block_size=8,
                             attention=AttentionSpec(rope_cos=cos[:10], rope_sin=sin[:10]))
        short.forward(torch.randn(11, h_q, d), torch.randn(11, h_kv, d), torch.randn(11, h_kv, d),
                      short.plan({"a": 11}), 0)
    with pytest.raises(ValueError, match=r"attention\[0\].rope_positions: PagedKVCache gives absolute"):
        PagedKVCache(CachePolicy("paged_kv", 1 << 16), layout=lay, block_size=8,
                     attention=AttentionSpec(rope_cos=cos, rope_sin=sin, rope_positions="virtual"))
    with pytest.raises(ValueError, match=r"attention\[0\].rope_cos: expected head_dim / 2 = 8"):
        PagedKVCache(CachePolicy("paged_kv", 1 << 16), layout=lay, block_size=8,
                     attention=AttentionSpec(rope_cos=cos[:, :4], rope_sin=sin[:, :4]))


# --------------------------------------------------------------------------- slab pool

ST = 6  # a chunk of 3 "frames" of 2 tokens


def _slab(per, spec, *, dtype=torch.float64, st=ST, slots=16, h_kv=2, d=16, device=None):
    lay = KVLayout(num_layers=1, num_kv_heads=h_kv, head_dim=d, dtype=dtype)
    pol = CachePolicy("slab_kv", lay.block_bytes(st) * slots, per_component=per)
    return SlabKVCache(pol, layout=lay, slab_tokens=st, attention=spec, device=device)


def _visible(e: int, S: int, W: int) -> torch.Tensor:  # noqa: N803
    t = torch.arange(e)
    return t[(t < S) | (t >= e - W)]


_TOKEN_WINDOW = ({"sink_tokens": 2, "window_tokens": 8}, 2, 8)


@pytest.mark.parametrize(("table", "positions", "per", "S", "W", "backend"), [
    (table, positions, *win, "torch")
    for table in ("1d", "wan3d") for positions in ("absolute", "virtual")
    for win in (({"sinks": 1, "window": 2}, ST, 2 * ST), _TOKEN_WINDOW)
] + [pytest.param("wan3d", "virtual", *_TOKEN_WINDOW, "triton", marks=GPU)],
    ids=lambda x: x if isinstance(x, str) else None)
def test_slab_rollout_positions(table, positions, per, S, W, backend) -> None:  # noqa: N803
    """24 chunks past recycling, each a denoising step (commit=False, own k/v given) and a
    clean pass (commit=True), against explicit rotation at the rule's positions. Virtual
    positions stay below sinks + window + chunk: a table of that size serves the rollout.
    ``wan3d``: Wan's table with 2-token frames (H = 1, W = 2): the frame index moves, the
    width channels repeat every frame."""
    torch.manual_seed(4)
    dev = device_for(backend)
    d, h_q, h_kv = 16, 4, 2
    n_pos = 1000 if positions == "absolute" else S + W + ST
    cos, sin = rope_table(n_pos, d) if table == "1d" else wan_rope_table(n_pos // 2, 1, 2, d)
    spec = AttentionSpec(rope_cos=cos.to(dev), rope_sin=sin.to(dev), rope_interleaved=True, rope_positions=positions,
                         backend=backend)
    dt = torch.float64 if backend == "torch" else torch.float32  # the interpreter: fp32, small slabs
    pool = _slab(per, spec, dtype=dt, device=dev)
    keys, vals = torch.zeros(0, h_kv, d, dtype=torch.float64), torch.zeros(0, h_kv, d, dtype=torch.float64)
    for c in range(24 if backend == "torch" else 21):
        s0, e = c * ST, (c + 1) * ST
        q = torch.randn(1, ST, h_q, d, dtype=torch.float64)
        k, v = torch.randn(1, ST, h_kv, d, dtype=torch.float64), torch.randn(1, ST, h_kv, d, dtype=torch.float64)
        vis = _visible(e, S, W)
        kk, vv = torch.cat([keys, k[0]]), torch.cat([vals, v[0]])
        if positions == "absolute":
            kpos, qpos = vis, torch.arange(s0, e)
        else:  # index in the concatenation; the chunk's own tokens are its last ST entries
            kpos, qpos = torch.arange(len(vis)), torch.arange(len(vis) - ST, len(vis))
        assert int(kpos.max()) < n_pos
        want = _dense(_rot(q[0], qpos, cos, sin, True), _rot(kk[vis], kpos, cos, sin, True), vv[vis])
        for commit in (False, True):
            meta = pool.plan({"r": c})
            out = pool.forward(q.to(dev, dt), k.to(dev, dt), v.to(dev, dt), meta, 0, commit=commit)
            assert_close(out[0], want, dt, f"chunk {c} commit={commit} ({positions}, {backend})")
        keys, vals = kk, vv
    if positions == "absolute":
        small = _slab(per, spec.replace(rope_cos=cos[:20], rope_sin=sin[:20]))
        for c in range(3):
            m = small.plan({"r": c})
            x = torch.randn(1, ST, h_kv, d, dtype=torch.float64)
            if c < 3 and (c + 1) * ST <= 20:
                small.forward(torch.randn(1, ST, h_q, d, dtype=torch.float64), x, x, m, 0, commit=True)
            else:
                with pytest.raises(ValueError, match="rope_cos: this step reaches absolute position 17"):
                    small.forward(torch.randn(1, ST, h_q, d, dtype=torch.float64), x, x, m, 0, commit=True)


def test_slab_multichunk_step_and_short_first_chunk() -> None:
    """An image-to-video rollout (chunk 0 of 2 tokens) planned as one 3-chunk run, then one by
    one: the same outputs, absolute and virtual."""
    d, h_q, h_kv = 16, 4, 2
    for positions in ("absolute", "virtual"):
        torch.manual_seed(6)
        cos, sin = rope_table(64, d)
        spec = AttentionSpec(rope_cos=cos, rope_sin=sin, rope_positions=positions)
        n = 2 + 2 * ST
        q = torch.randn(1, n, h_q, d, dtype=torch.float64)
        k, v = torch.randn(1, n, h_kv, d, dtype=torch.float64), torch.randn(1, n, h_kv, d, dtype=torch.float64)
        per = {"sink_tokens": 2, "window_tokens": 8}
        a, b = _slab(per, spec), _slab(per, spec)
        run = a.forward(q, k, v, a.plan({"r": (range(0, 3), n)}), 0, commit=True)
        bounds = [(0, 2), (2, 2 + ST), (2 + ST, n)]
        for c, (s0, e) in enumerate(bounds):
            m = b.plan({"r": (c, e - s0)})
            one = b.forward(q[:, s0:e], k[:, s0:e], v[:, s0:e], m, 0, commit=True)
            assert_close(run[:, s0:e], one.double(), torch.float64, f"run vs one-by-one chunk {c} ({positions})")
        # Denoising form of the run (the own keys read through pages) against the clean one.
        c2 = _slab(per, spec)
        den = c2.forward(q, k, v, c2.plan({"r": (range(0, 3), n)}), 0, commit=False)
        assert_close(den, run.double(), torch.float64, f"run commit=False ({positions})")


@gpu_test
@pytest.mark.parametrize("positions", ["absolute", "virtual"])
def test_slab_triton_one_launch_denoising_step(positions) -> None:
    """64-token slabs in bf16: the denoising step attends to the history and its own k/v in
    ONE launch (own keys rotated at q_pos + r), the clean pass through the large-block path."""
    torch.manual_seed(8)
    st, d, h_q, h_kv = 64, 16, 2, 1
    cos, sin = rope_table(400, d)
    spec = AttentionSpec(rope_cos=cos.to(DEVICE), rope_sin=sin.to(DEVICE), rope_positions=positions, backend="triton")
    pool = _slab({"sinks": 1, "window": 2}, spec, dtype=torch.bfloat16, st=st, slots=6, h_kv=h_kv, d=d, device=DEVICE)
    keys, vals = torch.zeros(0, h_kv, d), torch.zeros(0, h_kv, d)
    for c in range(4):
        q = torch.randn(1, st, h_q, d).bfloat16()
        k, v = torch.randn(1, st, h_kv, d).bfloat16(), torch.randn(1, st, h_kv, d).bfloat16()
        kk, vv = torch.cat([keys, k[0].float()]), torch.cat([vals, v[0].float()])
        vis = _visible((c + 1) * st, st, 2 * st)
        kpos = vis if positions == "absolute" else torch.arange(len(vis))
        qpos = torch.arange(c * st, (c + 1) * st) if positions == "absolute" else torch.arange(len(vis) - st, len(vis))
        want = _dense(_rot(q[0], qpos, cos, sin, False), _rot(kk[vis], kpos, cos, sin, False), vv[vis])
        for commit in (False, True):
            out = pool.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pool.plan({"r": c}), 0, commit=commit)
            assert_close(out[0], want, torch.bfloat16, f"triton chunk {c} commit={commit} ({positions})")
        keys, vals = kk, vv
    assert math.isfinite(float(out.float().abs().max()))


# --------------------------------------------------------------------------- issue 27: position checks


def test_paged_graph_plan_checks_the_steps_real_positions(seed) -> None:
    """Issue 27 #6: under graph_capacity=(2, 8) with 4-token blocks a graph plan's
    max_seqlen_k is the capacity (32), and a decode step at position 5 was refused against a
    30-row table ("reaches position 31"). The step's real largest position is checked: the
    step runs (equal to a plan without a graph), a step reaching position 30 is refused."""
    d, h_q, h_kv, bs = 16, 2, 1, 4
    cos, sin = rope_table(30, d)
    lay = KVLayout(num_layers=1, num_kv_heads=h_kv, head_dim=d, dtype=torch.float64)
    spec = AttentionSpec(rope_cos=cos, rope_sin=sin)
    graph, plain = (PagedKVCache(CachePolicy("paged_kv", lay.block_bytes(bs) * 16), layout=lay, block_size=bs,
                                 attention=spec, graph_capacity=cap) for cap in ((2, 8), None))
    for n, decode_at in ((5, 5), (30, 30)):
        ns = f"seq{n}"
        q, k = torch.randn(n, h_q, d, dtype=torch.float64), torch.randn(n, h_kv, d, dtype=torch.float64)
        for pool in (graph, plain):
            pool.forward(q, k, k, pool.plan({ns: n}), 0)
        q, k = torch.randn(1, h_q, d, dtype=torch.float64), torch.randn(1, h_kv, d, dtype=torch.float64)
        pad = torch.zeros(1, h_kv, d, dtype=torch.float64)  # the graph batch's padding row
        if decode_at < 30:
            got = graph.forward(torch.cat([q, q.new_zeros(1, h_q, d)]), torch.cat([k, pad]), torch.cat([k, pad]),
                                graph.plan({ns: 1}, graph=True), 0)
            want = plain.forward(q, k, k, plain.plan({ns: 1}), 0)
            assert_close(got[:1], want, torch.float64, f"graph decode at position {decode_at}")
        else:
            with pytest.raises(ValueError, match="^rope_cos: this step reaches position 30, past the 30-row"):
                graph.forward(torch.cat([q, q]), torch.cat([k, pad]), torch.cat([k, pad]),
                              graph.plan({ns: 1}, graph=True), 0)


@pytest.mark.parametrize(("shift", "ok"), [
    pytest.param([-4, 0, 0, 0], True, id="shift-of-a-block-outside-the-window"),
    pytest.param([-90, 40, 0, 0], True, id="any-shift-outside-the-window"),
    pytest.param([0, 0, 0, 20], False, id="visible-block-past-the-table"),
    pytest.param([-1, 0, 0, 0], False, id="sink-block-before-the-table"),
])
def test_functional_rope_check_counts_only_visible_keys(shift, ok, seed) -> None:
    """Issue 27 #7: a StreamingLLM-style shift of a block outside the window (rope_k_shift
    [[-4, 0, 0, 0]], window_left=3) was refused although only visible positions must be rows
    of the table. Hidden keys may be shifted anywhere (the output is the unshifted call's);
    a visible key, a sink included, outside the table is still refused."""
    d = 16
    cos, sin = rope_table(30, d)
    kc = torch.randn(4, 4, 1, d, dtype=torch.float64)
    q = torch.randn(1, 2, d, dtype=torch.float64)
    args = (q, kc, kc, torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), torch.tensor([16], dtype=torch.int32))
    sinks = 0 if ok else 2
    kw = dict(window_left=3, sink_tokens=sinks, rope_cos=cos, rope_sin=sin, backend="torch")
    rk = torch.tensor([shift], dtype=torch.int32)
    if ok:
        got = paged_attention(*args, rope_k_shift=rk, **kw)
        want = paged_attention(*args, rope_k_shift=torch.zeros_like(rk), **kw)
        assert_close(got, want, torch.float64, f"hidden blocks shifted by {shift}")
    else:
        with pytest.raises(ValueError, match="^rope_k_shift: sequence 0's key positions reach"):
            paged_attention(*args, rope_k_shift=rk, **kw)


@pytest.mark.parametrize(("sizes", "exc", "name"), [
    pytest.param((0, 2, 3, 16), ValueError, "frames", id="no-frames"),
    pytest.param((-1, 2, 3, 16), ValueError, "frames", id="negative-frames"),
    pytest.param((2, 0, 3, 16), ValueError, "height", id="no-height"),
    pytest.param((2, 2, -3, 16), ValueError, "width", id="negative-width"),
    pytest.param((2.0, 2, 3, 16), TypeError, "frames", id="float-frames"),
    pytest.param((2, 2, 3, 15), ValueError, "head_dim", id="odd-head-dim"),
])
def test_wan_rope_table_refuses_bad_sizes(sizes, exc, name) -> None:
    """Issue 27 #8: frames=0 returned an empty table and frames=-1 raised a torch
    RuntimeError naming nothing; each bad size is an error naming its argument."""
    with pytest.raises(exc, match=f"^{name}: expected an"):
        wan_rope_table(*sizes)
