"""Launch plans per GPU architecture (issue 40): the records, ``KVARENA_ARCH``, the launch
object the kernel receives, and every target's plan run in the interpreter against the fp64
oracle."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from _helpers import DEVICE, assert_close, assert_lse_close, paged_case, paged_case_ref

import kvarena.kernels.attn_plan as attn_plan
import kvarena.kernels.paged_attention as pa
from kvarena.attention import paged_attention
from kvarena.kernels.arch import ARCHS, arch_for_device, arch_named, interpreter_arch

TARGETS = list(ARCHS)
interp_only = pytest.mark.skipif(DEVICE != "cpu", reason="KVARENA_ARCH plans for a target under the interpreter")


def test_the_eight_targets_and_their_limits():
    assert TARGETS == ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120a", "gfx942", "gfx950"]
    for name, arch in ARCHS.items():
        assert arch.name == name and arch.smem_per_block <= arch.smem_per_sm, arch
        assert arch.warp_size == (64 if arch.is_amd else 32)
    assert {a.mma for a in ARCHS.values()} == {"mma.sync", "wgmma", "tcgen05", "mfma"}
    # Native fp8: OCP e4m3 from sm_89 on and on gfx950; gfx942's is e4m3fnuz (served decoded).
    assert [n for n, a in ARCHS.items() if a.fp8_native("float8_e4m3fn")] == \
        ["sm_89", "sm_90a", "sm_100a", "sm_120a", "gfx950"]
    assert ARCHS["gfx942"].fp8_native("float8_e4m3fnuz")


@pytest.mark.parametrize(("name", "regs", "shared", "warps", "ctas"), [
    ("sm_90a", 148, 71 * 1024, 4, 3),  # registers: 148 x 128 threads -> 3 of 65536 (smem allows 3)
    ("sm_90a", 214, 71 * 1024, 4, 2),
    ("sm_89", 148, 71 * 1024, 4, 1),  # 100 KiB per SM: one 71 KiB CTA
    ("sm_80", 255, 128 * 1024, 8, 1),
    ("sm_86", 100, 120 * 1024, 4, 0),  # over the 99 KiB a block may take: does not fit
    ("gfx942", 256, 32 * 1024, 4, 2),  # 512 / 256 = 2 waves per SIMD -> 8 waves per CU
    ("gfx942", 353, 32 * 1024, 4, 1),
    ("gfx942", 128, 40 * 1024, 4, 1),  # LDS: 64 KiB per CU holds one 40 KiB CTA
], ids=["sm90-3", "sm90-2", "sm89-smem", "sm80-regs", "sm86-over", "gfx942-2", "gfx942-1", "gfx942-lds"])
def test_occupancy_rule_per_target(name, regs, shared, warps, ctas):
    assert arch_named(name).occupancy(regs, shared, warps) == ctas


def test_unknown_name_is_refused_with_the_known_ones(monkeypatch):
    with pytest.raises(ValueError, match="sm_75.*sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_120a, gfx942, gfx950"):
        arch_named("sm_75")
    monkeypatch.setenv("KVARENA_ARCH", "h100")
    with pytest.raises(ValueError, match="KVARENA_ARCH='h100'.*expected one of sm_80"):
        interpreter_arch()
    monkeypatch.delenv("KVARENA_ARCH")
    assert interpreter_arch().name == "sm_90a"  # the default


@interp_only
def test_unknown_kvarena_arch_refuses_a_launch_and_changes_nothing(monkeypatch, seed):
    case = paged_case([40], [1], dtype=torch.float16, group=4, h_kv=2, head_dim=32, block_size=16, seed=seed)
    out = torch.full_like(case["q"], 7.0)
    monkeypatch.setenv("KVARENA_ARCH", "rtx4090")
    with pytest.raises(ValueError, match="KVARENA_ARCH='rtx4090'"):
        _run(case, out=out)
    assert torch.equal(out, torch.full_like(out, 7.0)), "a refused launch wrote its output"


def _props(**kw):
    return types.SimpleNamespace(multi_processor_count=kw.pop("sms"), **kw)


@pytest.mark.parametrize(("hip", "props", "want"), [
    (None, _props(major=8, minor=9, sms=142), "sm_89"),  # L40S: the device's 142 SMs size the waves
    (None, _props(major=8, minor=7, sms=16), "sm_86"),  # Jetson Orin: the sm_86 record
    (None, _props(major=12, minor=0, sms=170), "sm_120a"),
    (None, _props(major=10, minor=0, sms=148), "sm_100a"),
    ("6.4", _props(major=9, minor=4, gcnArchName="gfx942:sramecc+:xnack-", sms=304), "gfx942"),
    ("7.0", _props(major=9, minor=5, gcnArchName="gfx950", sms=256), "gfx950"),
], ids=["l40s", "orin", "rtx5090", "b200", "mi300x", "mi355x"])
def test_record_comes_from_the_device(monkeypatch, hip, props, want):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known device plans without a warning
        arch = arch_for_device(0)
    assert arch.name == want and arch.sm_count == props.multi_processor_count, arch


@pytest.mark.parametrize(("hip", "props", "want"), [
    (None, _props(major=7, minor=5, sms=40), "sm_86"),  # T4: the conservative 99 KiB mma.sync record
    (None, _props(major=11, minor=0, sms=20), "sm_86"),  # a future part: the same
    (None, _props(major=9, minor=9, sms=99), "sm_90a"),
    ("6.4", _props(major=11, minor=0, gcnArchName="gfx1100", sms=48), "gfx942"),  # RDNA: 64 KiB LDS
], ids=["t4", "future", "sm99", "rdna"])
def test_unknown_device_gets_the_closest_conservative_record_and_one_warning(monkeypatch, hip, props, want):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    with pytest.warns(RuntimeWarning, match=f"closest conservative record, {want}"):
        arch = arch_for_device(0)
    assert arch.name == want and arch.sm_count == props.multi_processor_count
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert arch_for_device(0) == arch  # once: the record is memoized per device


def _run(case, **opts):
    keys = ("q", "k_cache", "v_cache", "block_table", "seq_lens", "cu_seqlens_q")
    return paged_attention(*(case[k] for k in keys), kv_start=case["kv_start"], max_seqlen_q=case["max_seqlen_q"],
                           max_seqlen_k=case["max_seqlen_k"], backend="triton", **opts)


class _KernelSpy:
    """Stands in for ``_paged_attn_kernel``: records each launch's grid and keywords and runs
    the real kernel."""

    def __init__(self, real):
        self.real, self.calls = real, []
        self.arg_names = real.arg_names

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.real[grid](*args, **kwargs)
        return launch


# (id, case kwargs, op options): decode over 16-token pages (GQA 4), a prefill chunk over
# 48-token pages with a window (the guarded page path, GQA 5), a slab-like chunk over one
# big block (the large-block path, GQA 1).
PLAN_CASES = [
    pytest.param(dict(lens=[37, 61], q_lens=[1, 1], group=4, block_size=16, dtype=torch.bfloat16), {},
                 id="decode-gqa4-bf16"),
    pytest.param(dict(lens=[70, 29], q_lens=[9, 5], group=5, block_size=48, dtype=torch.float16),
                 dict(window_left=23), id="prefill-window-gqa5-fp16"),
    pytest.param(dict(lens=[90], q_lens=[33], group=1, block_size=96, dtype=torch.bfloat16), dict(causal=False),
                 id="chunk-large-block-gqa1-bf16"),
]


@interp_only
@pytest.mark.gpu  # runs the kernels (interpreter lane: interp_only)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("shape", "opts"), PLAN_CASES)
def test_every_target_plan_matches_the_oracle_and_is_what_the_kernel_receives(monkeypatch, seed, target, shape,
                                                                               opts):
    """Under KVARENA_ARCH=target the launcher plans that target's tiles (the launch object),
    passes exactly its grid, constexprs, warps, stages and None for its unread pointers, and
    the result equals the fp64 oracle."""
    monkeypatch.setenv("KVARENA_ARCH", target)
    case = paged_case(shape["lens"], shape["q_lens"], dtype=shape["dtype"], group=shape["group"], h_kv=2,
                      head_dim=40, block_size=shape["block_size"], seed=seed)
    plans = []
    real_plan = pa.plan_attention
    monkeypatch.setattr(pa, "plan_attention", lambda *a, **k: plans.append(real_plan(*a, **k)) or plans[-1])
    spy = _KernelSpy(pa._paged_attn_kernel)
    monkeypatch.setattr(pa, "_paged_attn_kernel", spy)
    out, lse = _run(case, return_lse=True, **opts)
    ref_out, ref_lse = paged_case_ref(case, **opts)
    assert_close(out, ref_out, shape["dtype"], f"{target} out")
    assert_lse_close(lse, ref_lse, shape["dtype"], f"{target} lse")

    assert len(plans) == 1 and len(spy.calls) == 1, (len(plans), len(spy.calls))
    launch, (grid, args, kwargs) = plans[0], spy.calls[0]
    assert launch.arch.name == target
    want_cfg = attn_plan._pick_config(40, shape["group"], case["q"].element_size(), None, target)
    assert launch.plan.cfg["num_warps"] in (4, 8) and want_cfg["HEAD_DIM_PAD"] == launch.meta["HEAD_DIM_PAD"]
    assert grid == launch.grid
    assert {k: kwargs[k] for k in launch.meta} == launch.meta
    cfg = launch.plan.cfg
    assert (kwargs["num_warps"], kwargs["num_stages"], kwargs["maxnreg"]) == \
        (cfg["num_warps"], cfg["num_stages"], cfg["maxnreg"])
    assert not args, "the kernel is launched by keyword"
    pointers = {name: value for name, value in kwargs.items() if name.endswith("_ptr")}
    assert set(pointers) == {name for name in spy.arg_names if name.endswith("_ptr")}
    assert {name for name, value in pointers.items() if value is None} == set(launch.unused)


def test_plans_differ_where_the_targets_do():
    """The same call plans what each target holds: AMD's decode keeps 2 stages (64 KiB LDS),
    sm_90a's chunks take 128-row wgmma tiles and 3 stages, sm_80's 128 x 16 mma.sync tiles."""
    def cfg(target, q_len, lean=True):
        return attn_plan._pick_config(128, 4, 2, q_len, target, lean=lean)

    assert cfg("sm_90a", 1)["num_stages"] == 5 and cfg("gfx942", 1)["num_stages"] <= 2
    assert (cfg("sm_90a", 4096)["BLOCK_M"], cfg("sm_90a", 4096)["num_stages"]) == (128, 3)
    assert (cfg("sm_80", 4096)["BLOCK_M"], cfg("sm_80", 4096)["BLOCK_N"]) == (128, 16)
    for target in TARGETS:  # a pure function of its arguments
        assert cfg(target, 4096) == cfg(target, 4096)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2], ids=["e4m3fnuz", "e5m2"])
def test_other_float8_formats_are_refused_by_name(seed, dtype):
    """gfx942's native fp8 (e4m3fnuz) has another bias and NaN byte than the OCP e4m3fn the
    store writes; a cache in it (or in e5m2) is refused, naming k_cache, never misread."""
    case = paged_case([20], [1], dtype=torch.bfloat16, group=1, h_kv=1, head_dim=16, block_size=16, seed=seed)
    k8 = torch.zeros(case["k_cache"].shape, dtype=dtype)
    with pytest.raises(TypeError, match=f"k_cache: float8 caches must be torch.float8_e4m3fn.*{dtype}"):
        paged_attention(case["q"], k8, k8.clone(), case["block_table"], case["seq_lens"], case["cu_seqlens_q"],
                        max_seqlen_q=1, max_seqlen_k=20)
