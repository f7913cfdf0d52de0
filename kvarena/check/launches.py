"""Each case of :mod:`kvarena.check.cases` as the launchers would launch it: the kernel,
its typed signature, constexprs, hints and options (kernels imported on call)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvarena.check.cases import (
    _FLAG_NAMES,
    ATTENTION_CASES,
    BWD_CASES,
    FP8_CASES,
    MERGE_CASES,
    OWN_CASES,
    REDUCE_CASES,
    ROPE_CASES,
    SHORT_CASES,
    STORE_CASES,
    WIDE_CASES,
)
from kvarena.kernels.arch import ARCHS, Arch
from kvarena.kernels.placement import OWN_AFTER_HISTORY


@dataclass
class _Launch:
    """One compile: the kernel, its typed signature, constexprs, hints and options."""

    kernel_name: str
    config: str
    fn: object
    pointers: dict
    constexprs: dict
    num_warps: int
    num_stages: int
    i64: tuple = ()
    floats: tuple = ()
    maxnreg: int | None = None
    # Integer arguments the JIT would see as multiples of 16 (strides always are here).
    div16: tuple = ()
    # Stride arguments that are NOT multiples of 16 (the fp8 scales' token stride is H_kv).
    nodiv: tuple = ()
    variant: str = ""
    occupancy_key: tuple | None = None
    ref_tile: tuple | None = None  # (BLOCK_M, BLOCK_N, HEAD_DIM_PAD, warps, stages, dtype, K/V dtype)


def _elem_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def _launches(only: str | None, target: str, all_variants: bool = False) -> list[_Launch]:
    """What the launchers would launch on ``target`` (a kvarena.kernels.arch name), one per case.

    By default each attention config is compiled with every flag on (causal, kv_start,
    lse): the most code. ``all_variants`` adds the other flag combinations, since
    ptxas's register allocation is not monotone in the amount of code.
    """
    out = []
    for case in ATTENTION_CASES:
        name, split, launched = case[0], case[6], case[8]
        for (flags, own, kv), label in _attention_variants(name, launched, split, all_variants).items():
            out.append(_attention_launch(case, flags, own, kv, label, ARCHS[target]))
    out += _bwd_launches(ARCHS[target]) + _reduce_launches() + _store_launches() + _merge_launches()
    if only:
        out = [x for x in out if only in x.config or only in x.kernel_name]
    return out


def _attention_variants(name: str, launched: tuple, split: bool, all_variants: bool) -> dict:
    """``(flags, own keys, kv kind) -> label`` of one attention case: as launched (with its
    own-keys, fp8 and RoPE forms), every flag on, and with ``all_variants`` the rest."""
    if split:  # a split always writes its lse
        launched = (launched[0], launched[1], True, launched[3])
    variants = {(launched, False, False): "as launched"}
    if name in OWN_CASES:
        variants[(launched, True, False)] = "as launched"
    if name in FP8_CASES:
        variants[(launched, name in OWN_CASES, True)] = "as launched"
    if name in ROPE_CASES:
        variants[(launched, name in OWN_CASES, "rope")] = "as launched"
        if name in FP8_CASES and all_variants:  # both at once: --all only (CI time)
            variants[(launched, name in OWN_CASES, "rope+fp8")] = "variant"
    if name in WIDE_CASES:
        variants[(launched, False, "wide")] = "as launched"
    if name in SHORT_CASES:
        variants[(launched, False, "short")] = "as launched"
        if name in FP8_CASES:
            variants[(launched, False, "short+fp8")] = "as launched"
    variants.setdefault(((True, True, True, True), False, False), "all flags")
    if all_variants:  # a split always writes its lse
        for f in itertools.product((True, False), repeat=4):
            if f[2] or not split:
                variants.setdefault((f, False, False), "variant")
    return variants


def _attention_launch(case: tuple, flags: tuple, own: bool, kv, label: str, arch: Arch) -> _Launch:
    """One attention compile: ``case`` (an ``ATTENTION_CASES`` entry) with these flags, as
    :func:`kvarena.kernels.attn_plan.plan_attention` plans it on ``arch``."""
    from kvarena.kernels import attn_plan
    from kvarena.kernels.occupancy import config_key, launch_kind
    from kvarena.kernels.paged_attention import _paged_attn_kernel

    name, d, group, dt, q_len, block, split, det, _launched = case
    fp8 = kv in (True, "rope+fp8", "short+fp8")
    short = kv in ("short", "short+fp8")
    rope = (2 if own else 1) if kv in ("rope", "rope+fp8") else 0
    eb = _elem_bytes(dt)
    shape, spec = _attention_call(case, flags, own, fp8, short, rope, kv == "wide", label == "all flags")
    launch = attn_plan.plan_attention(shape, spec, arch, upcast=False)
    if launch.split != split or launch.plan.own != own:
        raise AssertionError(f"{name} ({label}, {kv}): the plan on {arch.name} is not the case's launch: {launch}")
    cfg, meta = launch.plan.cfg, dict(launch.meta)
    meta.update(stride_qd=1, stride_od=1)  # unit strides: the JIT specializes them too
    meta.update(dict.fromkeys(launch.unused))  # passed as None: constexprs
    kv_dt = ("fp8e4nv" if meta["FP8_NATIVE"] else "u8") if fp8 else dt
    ptrs = {"q_ptr": dt, "k_ptr": kv_dt, "v_ptr": kv_dt, "o_ptr": "fp32" if split else dt, "lse_ptr": "fp32",
            "block_table_ptr": "i32", "seq_lens_ptr": "i32", "cu_q_ptr": "i32", "kv_start_ptr": "i32",
            "own_k_ptr": dt, "own_v_ptr": dt, "sink_ptr": "fp32", "ks_ptr": "fp32", "vs_ptr": "fp32",
            "cos_ptr": "fp32", "sin_ptr": "fp32", "qpos_ptr": "i32", "kshift_ptr": "i32"}
    if fp8:  # per-token scales [blocks, block_size, H_kv]: unit head stride, token stride H_kv
        meta.update(stride_ksh=1, stride_vsh=1)
    flags = (meta["CAUSAL"], meta["HAS_KV_START"], meta["WRITE_LSE"], meta["HAS_SOFTCAP"])
    return _Launch("attention", _attention_desc(name, dt, d, group, cfg, flags, meta, fp8, rope, short),
                   _paged_attn_kernel, ptrs, meta, cfg["num_warps"],
                   # Block strides are one block's elements (< 2**31): int32, as the JIT sees them.
                   cfg["num_stages"], i64=(),
                   floats=("scale_log2", "softcap_inv", "softcap_log2"), maxnreg=cfg.get("maxnreg"),
                   div16=("block_size",) if block % 16 == 0 else (), variant=label,
                   nodiv=("stride_kst", "stride_vst"),
                   occupancy_key=config_key(arch, cfg, eb, launch_kind(kv_fp8=fp8, rope=bool(rope),
                                                                        own=launch.plan.own)),
                   # fp8 rows against the yardstick's fp8 form, but with own keys: the loop the
                   # row counts is then the own keys' (the smallest with the dots), in q's dtype.
                   ref_tile=(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["HEAD_DIM_PAD"], cfg["num_warps"],
                             cfg["num_stages"], dt, dt if meta["HAS_OWN"] else kv_dt))


#: The kv heads and the softcap of the calls the check plans (any value: they set no tile).
_KV_HEADS, _SOFTCAP = 8, 30.0


def _attention_call(case: tuple, flags: tuple, own: bool, fp8: bool, short: bool, rope: int, wide: bool,
                    sinks: bool):
    """A call of ``case``: its :class:`LaunchShape` and ``AttentionSpec``. A split case asks
    for 2 splits over 8K keys (the deterministic pin: 4096 keys per split); the short-context
    form is B = 1 over 1K keys with the split count left to the plan, where it takes the
    32-key tile on every target."""
    import torch

    from kvarena.attention.spec import AttentionSpec
    from kvarena.kernels import attn_plan

    name, d, group, dt, q_len, block, split, det, _launched = case
    causal, has_kv_start, write_lse, softcap = flags
    keys = 1024 if short else 8192
    shape = attn_plan.LaunchShape(
        head_dim=d, group=group, elem_bytes=_elem_bytes(dt), num_seqs=1 if short else 2, num_kv_heads=_KV_HEADS,
        max_seqlen_q=q_len, max_seqlen_k=keys, block_size=block, own_len=q_len if own else None,
        has_kv_start=has_kv_start, write_lse=write_lse, kv_fp8=fp8, rope_q_pos=bool(rope), rope_k_shift=bool(rope),
        addressing=attn_plan.CacheAddressing(wide_offsets=wide, same_kv_strides=True))
    table = torch.zeros(16, d // 2) if rope else None
    spec = AttentionSpec(
        causal=causal, softcap=_SOFTCAP if softcap else None, deterministic=det,
        num_splits=None if short or det else (2 if split else 1),
        sink_logits=torch.zeros(group * _KV_HEADS) if sinks else None,
        rope_cos=table, rope_sin=table, rope_interleaved=rope == 2)
    return shape, spec


def _attention_desc(name: str, dt: str, d: int, group: int, cfg: dict, flags: tuple, meta: dict, fp8: bool,
                    rope: int, short: bool = False) -> str:
    """The config column of an attention row: the case, its tile, its flags and extras."""
    desc = (f"{name}: {dt} D{d} G{group} BM{cfg['BLOCK_M']} BN{cfg['BLOCK_N']} "
            f"w{cfg['num_warps']} s{cfg['num_stages']}")
    desc += " [" + ",".join(n for n, on in zip(_FLAG_NAMES, flags) if on) + "]"
    if meta["GUARD_NONFINITE"]:
        desc += " +nonfinite-guard"
    if meta["HAS_OWN"]:
        desc += " +own-k/v"
    if meta["HAS_SINK_LOGITS"]:
        desc += " +sink-logits"
    if fp8:
        desc += " +fp8-kv"
    if rope:
        desc += " +rope-on-read" + (" (interleaved)" if rope == 2 else "")
    if meta["WIDE_OFFSETS"] and not meta["LARGE_BLOCKS"]:
        desc += " +wide-offsets"
    if short:
        desc += " +short-context tile"
    return desc


def _bwd_launches(arch: Arch) -> list[_Launch]:
    """The backward's dQ and dK/dV kernels of every ``BWD_CASES`` entry."""
    from kvarena.kernels import paged_attention_bwd as bwd

    out = []
    for name, d, group, dt, placement in BWD_CASES:
        after = placement == OWN_AFTER_HISTORY
        cfg = bwd.pick_bwd_config(d, _elem_bytes(dt), arch)
        flags = dict(GROUP=group, HEAD_DIM=d, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_M=cfg["BLOCK_M"],
                     BLOCK_N=cfg["BLOCK_N"], CAUSAL=not after, HAS_KV_START=True, HAS_SOFTCAP=True, UPCAST=False)
        tile = f"{dt} D{d} G{group} BM{cfg['BLOCK_M']} BN{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
        floats = ("scale", "scale_log2", "softcap_inv", "softcap_log2")
        ptrs = {"q_ptr": dt, "do_ptr": dt, "lse_ptr": "fp32", "delta_ptr": "fp32", "dq_ptr": dt, "k_ptr": dt,
                "v_ptr": dt, "block_table_ptr": "i32", "seq_lens_ptr": "i32", "cu_q_ptr": "i32",
                "kv_start_ptr": "i32", "own_k_ptr": dt, "own_v_ptr": dt}
        out.append(_Launch("attention_bwd", f"{name} dQ: {tile}" + (" +own-k/v" if after else ""),
                           bwd._attn_bwd_dq_kernel, ptrs,
                           dict(flags, HAS_OWN=after, **({} if after else {"own_k_ptr": None, "own_v_ptr": None})),
                           cfg["num_warps"],
                           cfg["num_stages"], i64=("stride_kb", "stride_vb"), floats=floats,
                           maxnreg=cfg["maxnreg"]))
        ptrs = {"q_ptr": dt, "do_ptr": dt, "lse_ptr": "fp32", "delta_ptr": "fp32", "own_k_ptr": dt, "own_v_ptr": dt,
                "dk_ptr": dt, "dv_ptr": dt, "seq_lens_ptr": "i32", "cu_q_ptr": "i32", "kv_start_ptr": "i32"}
        out.append(_Launch("attention_bwd", f"{name} dK/dV: {tile}" + (" given after history" if after else ""),
                           bwd._attn_bwd_dkdv_kernel, ptrs, dict(flags, OWN_PLACEMENT=placement), cfg["num_warps"],
                           cfg["num_stages"], i64=("stride_own_b",), floats=floats, maxnreg=cfg["maxnreg"]))
    return out


def _reduce_launches() -> list[_Launch]:
    """The split-KV reduce of every ``REDUCE_CASES`` entry, at the tile its launch takes."""
    from kvarena.check.cases import SM_COUNT
    from kvarena.kernels import split_reduce
    from kvarena.kernels._common import ROW_TILE_WARPS

    out = []
    for name, d, dt, rows, splits, det in REDUCE_CASES:
        t = split_reduce._reduce_tile(rows, d, splits, SM_COUNT["sm_90a"], deterministic=det)
        meta = dict(HEAD_DIM=d, BLOCK_D=t.BLOCK_D, BLOCK_R=t.BLOCK_R, BLOCK_S=t.BLOCK_S, WRITE_LSE=True,
                    HAS_SINK_LOGITS=True, stride_od=1)
        ptrs = {"part_ptr": "fp32", "part_lse_ptr": "fp32", "o_ptr": dt, "lse_ptr": "fp32", "sink_ptr": "fp32"}
        out.append(_Launch("split_reduce",
                           f"{name}: {dt} BR{t.BLOCK_R} BS{t.BLOCK_S} BD{t.BLOCK_D} w{ROW_TILE_WARPS}",
                           split_reduce._split_reduce_kernel, ptrs, meta, ROW_TILE_WARPS, 1,
                           i64=("stride_ps",)))
    return out


def _store_launches() -> list[_Launch]:
    """The K/V store of every ``STORE_CASES`` entry."""
    from kvarena.kernels import store

    out = []
    for name, d, dt, fp8 in STORE_CASES:
        cfg = store._pick_config(d)
        meta = dict(HEAD_DIM=d, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_R=cfg["BLOCK_R"],
                    QUANT=store.QUANT_TOKEN if fp8 else store.QUANT_NONE)
        if fp8:
            meta.update(stride_sh=1, stride_wh=1)
        else:  # passed as None without scales
            meta.update(ks_ptr=None, vs_ptr=None)
        cache = "u8" if fp8 else dt
        ptrs = {"k_ptr": dt, "v_ptr": dt, "k_cache_ptr": cache, "v_cache_ptr": cache, "slot_ptr": "i64",
                "ks_ptr": "fp32", "vs_ptr": "fp32"}
        out.append(_Launch("store_kv", f"{name}: {dt} BR{cfg['BLOCK_R']} w{cfg['num_warps']}",
                           store._store_kv_kernel, ptrs, meta, cfg["num_warps"], 1,
                           i64=("stride_cb", "stride_db", "stride_sb", "stride_wb"), div16=("block_size",),
                           nodiv=("stride_st", "stride_wt")))
    return out


def _merge_launches() -> list[_Launch]:
    """The partial-attention merge of every ``MERGE_CASES`` entry."""
    from kvarena.kernels import merge

    out = []
    for name, d, dt in MERGE_CASES:
        cfg = merge._pick_config(d)
        meta = dict(HEAD_DIM=d, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_R=cfg["BLOCK_R"],
                    stride_oad=1, stride_obd=1, stride_od=1)
        ptrs = {"oa_ptr": dt, "ob_ptr": dt, "o_ptr": dt, "la_ptr": "fp32", "lb_ptr": "fp32", "l_ptr": "fp32"}
        out.append(_Launch("merge", f"{name}: {dt} BR{cfg['BLOCK_R']} w{cfg['num_warps']}",
                           merge._merge_states_kernel, ptrs, meta, cfg["num_warps"], 1))
    return out


def _signature(launch: _Launch) -> tuple[dict, dict]:
    """Triton signature and hints as the JIT would specialize a realistic launch.

    Pointers are 16-byte aligned and strides of D = 128/256 rows are multiples of 16, so
    both carry the ``tt.divisibility = 16`` hint the JIT would derive from real tensors.
    """
    sig, attrs = {}, {}
    for i, name in enumerate(launch.fn.arg_names):
        if name in launch.constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + launch.pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in launch.floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name in launch.i64 else "i32"
            if (name.startswith("stride_") and name not in launch.nodiv) or name in launch.div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs
