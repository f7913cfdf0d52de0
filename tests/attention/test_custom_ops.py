"""The torch.library custom ops: schema/fake-impl consistency and torch.compile without graph breaks."""

from __future__ import annotations

import pytest
import torch

from kvarena.attention import AttentionSpec, dispatch, merge_attention_states
from kvarena.attention.batch import CacheView, KeySet, QueryRows
from kvarena.attention.reference import paged_attention_ref

_SPEC = AttentionSpec(return_lse=True)


def _paged_inputs(dtype=torch.float32):
    h_q, h_kv, d, bs, nb = 4, 1, 16, 5, 12
    lens, qlens = [7, 3, 11], [2, 1, 4]
    k_cache = torch.randn(nb, bs, h_kv, d, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.stack([torch.randperm(nb)[:3] for _ in lens]).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 2, 3, 7], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h_q, d, dtype=dtype)
    return q, k_cache, v_cache, block_table, seq_lens, cu, max(qlens), max(lens)


def test_opcheck_paged_attention(seed):
    q, kc, vc, bt, sl, cu, mq, mk = _paged_inputs()
    # The schema's option arguments are generated from AttentionSpec's fields.
    for spec in (AttentionSpec(scale=0.25, backend="torch"),
                 AttentionSpec(window_left=3, sink_tokens=1, softcap=5.0, chunk_size=2, backend="torch")):
        args = (q, kc, vc, bt, sl, cu, None, None, None, None, None, mq, mk, *spec.op_args())
        torch.library.opcheck(torch.ops.kvarena.paged_attention.default, args)
    # RoPE on read: the tables are spec fields, the per-step positions op arguments.
    cos, sin = torch.rand(64, kc.shape[-1] // 2), torch.rand(64, kc.shape[-1] // 2)
    spec = AttentionSpec(backend="torch", rope_cos=cos, rope_sin=sin, rope_interleaved=True)
    rq = torch.zeros(bt.shape[0], dtype=torch.int32)
    rk = torch.ones(bt.shape, dtype=torch.int32)
    args = (q, kc, vc, bt, sl, cu, None, None, None, rq, rk, mq, mk, *spec.op_args())
    torch.library.opcheck(torch.ops.kvarena.paged_attention.default, args)
    # fp8 caches cross the op boundary as uint8 bytes plus scales (per-token as uint8 views
    # of fp32, or 0-dim static ones).
    ks = torch.rand(kc.shape[:3]) + 0.01
    k8, v8 = (kc / ks[..., None]).to(torch.float8_e4m3fn), (vc / ks[..., None]).to(torch.float8_e4m3fn)
    spec = AttentionSpec(backend="torch")
    for sk, sv in ((ks.view(torch.uint8), ks.clone().view(torch.uint8)), (torch.tensor(0.5), torch.tensor(0.25))):
        args = (q, k8.view(torch.uint8), v8.view(torch.uint8), bt, sl, cu, None, sk, sv, None, None, mq, mk,
                *spec.op_args())
        torch.library.opcheck(torch.ops.kvarena.paged_attention.default, args)


def test_opcheck_store_and_merge(seed):
    kc = torch.randn(4, 3, 2, 8)
    vc = torch.randn_like(kc)
    k = torch.randn(5, 2, 8)
    slots = torch.tensor([0, -1, 7, 11, 2], dtype=torch.int64)
    torch.library.opcheck(torch.ops.kvarena.store_kv.default, (k, k.clone(), kc, vc, slots, "torch"))
    k8 = torch.zeros(4, 3, 2, 8, dtype=torch.uint8)
    sc = torch.ones(4, 3, 2)
    torch.library.opcheck(torch.ops.kvarena.store_kv.default,
                          (k, k.clone(), k8, k8.clone(), slots, "torch", sc.view(torch.uint8), sc.clone().view(torch.uint8)))
    out = torch.randn(6, 2, 8)
    lse = torch.randn(6, 2)
    torch.library.opcheck(
        torch.ops.kvarena.merge_attention_states.default, (out, lse, out.clone(), lse.clone(), "torch")
    )


def _layer(q, kc, vc, bt, sl, cu, knew, slots, mq, mk):
    # The pools' per-layer path: validated-once spec, no per-call checks.
    dispatch.store(knew, knew * 2, CacheView(kc, vc), slots, "torch")
    o, lse = dispatch.attend(q, CacheView(kc, vc), KeySet(bt, sl, mk), QueryRows(cu, mq), spec=_SPEC, backend="torch")
    o2, lse2 = merge_attention_states(o, lse, o * 0.5, lse - 1.0)
    return o2, lse2


def test_compile_fullgraph_aot_eager_matches_eager(seed):
    q, kc, vc, bt, sl, cu, mq, mk = _paged_inputs()
    knew = torch.randn(3, 1, 16)
    # slots inside the sequences' used blocks, so the new K/V are visible to the attention
    slots = (bt[:, 0].long() * kc.shape[1] + 1).to(torch.int64)
    eager_caches = (kc.clone(), vc.clone())
    comp_caches = (kc.clone(), vc.clone())
    ref = _layer(q, *eager_caches, bt, sl, cu, knew, slots, mq, mk)
    compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")
    got = compiled(q, *comp_caches, bt, sl, cu, knew, slots, mq, mk)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    # the mutation of the caches happened inside the compiled graph too
    assert torch.equal(comp_caches[0], eager_caches[0]) and torch.equal(comp_caches[1], eager_caches[1])
    assert not torch.equal(comp_caches[0], kc), "store_kv wrote nothing"
    # and the output is the merge of (o, lse) with (o / 2, lse - 1) over the updated cache
    want = paged_attention_ref(q, *eager_caches, bt, sl, cu)
    w = torch.exp(torch.tensor(-1.0))
    expected = want * (1 + 0.5 * w) / (1 + w)
    rel = ((got[0] - expected).norm() / expected.norm()).item()
    assert rel <= 1e-5, f"compiled layer vs reference: rel err {rel:.3e}"


@pytest.mark.slow
def test_compile_inductor_matches_eager(seed):
    """One inductor build (a cold C++ build takes ~30 s): the compiled layer equals eager."""
    q, kc, vc, bt, sl, cu, mq, mk = _paged_inputs()
    knew = torch.randn(3, 1, 16)
    slots = (bt[:, 0].long() * kc.shape[1] + 1).to(torch.int64)
    eager_caches = (kc.clone(), vc.clone())
    comp_caches = (kc.clone(), vc.clone())
    ref = _layer(q, *eager_caches, bt, sl, cu, knew, slots, mq, mk)
    got = torch.compile(_layer, fullgraph=True)(q, *comp_caches, bt, sl, cu, knew, slots, mq, mk)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(comp_caches[0], eager_caches[0])
