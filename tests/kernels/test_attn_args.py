"""The attention launcher's per-layout arguments (``kernels/attn_args.py``): a plan launched
for several layers builds its step-constant arguments once and reuses them, and each layer
still gets its own answer (each against the one-shot launch of its own tensors)."""

from __future__ import annotations

import pytest
import torch
from _helpers import GPU, paged_case

import kvarena.kernels.paged_attention as pa
from kvarena.attention import AttentionSpec
from kvarena.kernels.arch import launch_arch

pytestmark = [*GPU]

_CASE = dict(dtype=torch.float32, group=2, h_kv=2, head_dim=32, block_size=16)


def _layers(n: int) -> list[dict]:
    """``n`` layers of one step: one layout and the step's metadata (the first layer's
    tensors), each layer its own q and caches (other values, same strides)."""
    cases = [paged_case([5, 40, 17], [1, 1, 1], seed=0, **_CASE) for _ in range(n)]
    for i, c in enumerate(cases[1:], 1):
        for name in ("q", "k_cache", "v_cache"):
            c[name].mul_(torch.linspace(0.5, 1.5, c[name].shape[-1]) * (1 + i))
        c.update({k: cases[0][k] for k in ("block_table", "seq_lens", "cu_seqlens_q")})
    return cases


def _plan(c, spec):
    shape = pa.launch_shape(c["q"], c["k_cache"], c["v_cache"], num_seqs=c["seq_lens"].shape[0],
                            max_seqlen_q=c["max_seqlen_q"], max_seqlen_k=c["max_seqlen_k"], own_len=None,
                            has_kv_start=False, write_lse=True, kv_scales=None, rope_q_pos=False,
                            rope_k_shift=False)
    return pa.plan_attention(shape, spec, launch_arch(c["q"]))


def _run(launch, c, spec, **kw):
    out = torch.empty_like(c["q"])
    lse = torch.empty(c["q"].shape[:2], dtype=torch.float32)
    launch(c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["seq_lens"], c["cu_seqlens_q"], None, out, lse,
           spec=spec, **kw)
    return out, lse


@pytest.mark.parametrize("num_splits", [1, 3])
def test_one_plan_many_layers_each_its_answer(num_splits):
    spec = AttentionSpec(num_splits=num_splits)
    cases = _layers(3)
    fwd = _plan(cases[0], spec)
    for c in cases:
        got = _run(lambda *a, **k: pa.launch_planned(fwd, *a, **k), c, spec)
        want = _run(pa.paged_attention_fwd, c, spec, max_seqlen_q=c["max_seqlen_q"], max_seqlen_k=c["max_seqlen_k"])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(fwd.layouts) == 1  # built by the first layer, read by the others


def test_a_new_layout_or_a_copied_table_is_not_read_from_the_record():
    spec = AttentionSpec()
    c0, c1 = _layers(2)
    fwd = _plan(c0, spec)
    _run(lambda *a, **k: pa.launch_planned(fwd, *a, **k), c0, spec)
    # q of other strides: a record of its own, and the right answer.
    c1["q"] = c1["q"].contiguous()
    got = _run(lambda *a, **k: pa.launch_planned(fwd, *a, **k), c1, spec)
    assert len(fwd.layouts) == 2
    want = _run(pa.paged_attention_fwd, c1, spec, max_seqlen_q=c1["max_seqlen_q"], max_seqlen_k=c1["max_seqlen_k"])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # A block table the launcher copies (not unit-stride) is not kept: an in-place update
    # of it must reach the next launch.
    fresh = _plan(c0, spec)
    wide = torch.zeros(c0["block_table"].shape[0], 2 * c0["block_table"].shape[1], dtype=torch.int32)
    table = wide[:, ::2]
    table.copy_(c0["block_table"])
    c0["block_table"] = table
    _run(lambda *a, **k: pa.launch_planned(fresh, *a, **k), c0, spec)
    assert len(fresh.layouts) == 0
