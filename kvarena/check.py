"""``kvarena check``: compile every kernel configuration the package launches, with no GPU.

For each kernel and each configuration that the launchers' pure config pickers return for
the heaviest realistic shapes (head_dim 256 and 128, GQA groups, fp16/bf16/fp32, split
and unsplit, decode and chunk prefill), this compiles ahead of time for sm_80 and sm_90a
(``triton.compile`` on an ``ASTSource``, ptxas included) and prints one row per
kernel/config/target: registers, spill bytes, shared memory and whether it fits (no
spills; shared memory <= 163 KiB on sm_80, 227 KiB on sm_90a). The exit code is 1 when
any row does not fit.

It needs the real compiler, so it refuses to run under TRITON_INTERPRET=1. Importing this
module imports neither torch nor triton (``kvarena.cli`` imports it to build its parser).

Compiles are cached on disk by content (``KVARENA_CHECK_CACHE``, default
``~/.cache/kvarena/check``; ``--no-cache`` or ``KVARENA_CHECK_CACHE=0`` to compile
everything): the key holds the kernel's Triton ``cache_key`` (its source and every jitted
function and global it reads), the signature, hints, constexprs and options, the target,
the Triton version, ``TRITON_PTXAS_PATH`` and this module's own source (the parsing), so a
cached row is the row that compile gives; tests/test_check.py checks cached == fresh.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass

from kvarena.cli import UsageError, nonempty, output_file

# Opt-in shared memory per block: 163 KiB on A100 (sm_80), 227 KiB on H100/H200 (sm_90a).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
TARGET_NAMES = {80: "sm_80", 90: "sm_90a"}

# Realistic heaviest launches: (name, head_dim, group, dtype, q_len_max, block_size, split,
# deterministic, flags as launched). q_len_max is what the pool passes as max_seqlen_q: 1 for
# decode, the chunk for slabs; block_size selects the block layout specialization (16:
# power-of-two pages, 48: pages divided at run time, >= BLOCK_N: slabs, the contiguous
# large-block path). Flags (causal, kv_start, lse, softcap): the slab pool's chunks run
# non-causal with kv_start and lse, decode and prefill causal. Each case also compiles with
# every flag on (the most code), since spills must not depend on the options.
_DECODE, _PREFILL, _SLAB = (True, False, False, False), (True, False, False, False), (False, True, True, False)
ATTENTION_CASES = [
    ("decode 32q/8kv", 128, 4, "bf16", 1, 16, False, False, _DECODE),
    ("decode 32q/8kv split", 128, 4, "bf16", 1, 16, True, False, _DECODE),
    ("decode D256 GQA8 split", 256, 8, "fp16", 1, 16, True, False, _DECODE),
    ("prefill 32q/8kv page48", 128, 4, "bf16", 2048, 48, False, False, _PREFILL),
    ("chunk MAGI 24q/8kv", 128, 3, "bf16", 12150, 12150, False, False, _SLAB),
    ("chunk Wan split", 128, 1, "fp16", 4680, 4680, True, False, _SLAB),
    ("chunk GQA5 split", 128, 5, "bf16", 4096, 4096, True, False, _SLAB),
    ("chunk D256 GQA7 split", 256, 7, "bf16", 4096, 4096, True, False, _SLAB),
    ("spec-decode 4x8 split", 128, 8, "bf16", 4, 16, True, False, _PREFILL),
    ("deterministic 32q/8kv", 128, 4, "bf16", 1, 16, True, True, _DECODE),
    ("decode fp32", 128, 4, "fp32", 1, 16, False, False, _DECODE),
    ("chunk fp32 split", 128, 1, "fp32", 4680, 4680, True, False, _SLAB),
    ("chunk fp32 D256 GQA5", 256, 5, "fp32", 4680, 4680, False, False, _SLAB),
]
_FLAG_NAMES = ("causal", "kv_start", "lse", "softcap")
# Slab cases also compiled as a denoising step launches them: the cached history and the
# step's own k/v as two key sources of one launch (commit=False).
OWN_KV_CASES = ("chunk MAGI 24q/8kv", "chunk Wan split")
# Cases also compiled with a float8_e4m3fn cache (bytes decoded in registers, per-key fp32
# scales on the score and probability columns): decode (paged), prefill through the guarded
# page path, and a slab chunk on the large-block path with the step's own k/v (never fp8).
FP8_CASES = ("decode 32q/8kv split", "prefill 32q/8kv page48", "chunk Wan split")
# Cases also compiled with RoPE on read (queries and keys rotated by table rows as loaded,
# per-block position shifts): decode with half-split pairs, the slab chunk (own k/v,
# interleaved pairs as Wan's); with an fp8 cache too under --all-variants.
ROPE_CASES = ("decode 32q/8kv split", "chunk Wan split")
# The contract's workloads for --perf (sinks 1 + window 3 for slab chunks): the launch
# plan each gets, its grid and its wave efficiency. (name, head_dim, group, num_kv_heads,
# num_seqs, q_len, k_len (cached keys), block_size, causal, own_len (the step's own keys,
# attended in the same launch: a denoising step)).
WORKLOADS = [
    ("decode B=1 ctx=128K", 128, 4, 8, 1, 1, 131072, 16, True, 0),
    ("decode B=16 ctx=16K", 128, 4, 8, 16, 1, 16384, 16, True, 0),
    ("decode B=16 ctx=128K", 128, 4, 8, 16, 1, 131072, 16, True, 0),
    ("decode B=64 ctx=8K", 128, 4, 8, 64, 1, 8192, 16, True, 0),
    ("decode B=256 ctx=8K", 128, 4, 8, 256, 1, 8192, 16, True, 0),
    ("Wan-1.3B chunk, commit=True", 128, 1, 12, 1, 4680, 4 * 4680, 4680, False, 0),
    ("Wan-1.3B chunk, commit=False", 128, 1, 12, 1, 4680, 3 * 4680, 4680, False, 4680),
    ("Wan-14B chunk, commit=True", 128, 1, 40, 1, 4680, 4 * 4680, 4680, False, 0),
    ("Wan-14B chunk, commit=False", 128, 1, 40, 1, 4680, 3 * 4680, 4680, False, 4680),
    ("MAGI-1 chunk, commit=True", 128, 3, 8, 1, 12150, 4 * 12150, 12150, False, 0),
    ("MAGI-1 chunk, commit=False", 128, 3, 8, 1, 12150, 3 * 12150, 12150, False, 12150),
]
SM_COUNT = {80: 108, 90: 132}
REDUCE_CASES = [("reduce D128", 128, "bf16"), ("reduce D256", 256, "fp16")]
# The backward kernels (dQ and dK/dV), every mask flag on: (name, head_dim, group, dtype,
# how the given keys sit: 0 = at the query rows (paged / commit), 1 = after the history).
BWD_CASES = [
    ("bwd 32q/8kv", 128, 4, "bf16", 0),
    ("bwd Wan denoise", 128, 1, "bf16", 1),
    ("bwd D256 GQA2", 256, 2, "fp16", 0),
    ("bwd fp32", 128, 1, "fp32", 1),
]
# (name, head_dim, input dtype, quantize to fp8 with per-token scales).
STORE_CASES = [("store D256", 256, "bf16", False), ("store D256 fp32", 256, "fp32", False),
               ("store D128 fp8", 128, "bf16", True)]
MERGE_CASES = [("merge D256", 256, "bf16"), ("merge D256 fp32", 256, "fp32")]


@dataclass
class Row:
    kernel: str
    config: str
    target: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    fits: bool
    seconds: float
    error: str = ""
    variant: str = ""
    cached: bool = False  # read from the compile cache (same values as compiling)
    # --perf metrics (attention rows): CTAs per SM, MMA kind, K/V shared-memory buffers in
    # the main loop, SASS instructions per main-loop iteration and the same for the
    # contiguous reference loop at the same tile.
    ctas_per_sm: int = 0
    mma: str = ""
    kv_buffers: int = -1
    loop_sass: int = -1
    ref_loop_sass: int = -1
    occupancy_key: list | None = None


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
    ref_tile: tuple | None = None  # (BLOCK_M, BLOCK_N, HEAD_DIM_PAD, warps, stages, dtype)


def add_arguments(parser) -> None:
    parser.add_argument("--target", type=int, action="append", choices=sorted(SHARED_LIMIT),
                        help="compute capability to compile for (repeatable; default: 80 and 90)")
    parser.add_argument("--only", type=nonempty, default=None,
                        help="only configurations whose name contains this text")
    # Checked when parsed (a writable file in an existing directory): the compiles take minutes.
    parser.add_argument("--json", dest="json_path", type=output_file, default=None,
                        help="also write the rows as JSON to this file")
    parser.add_argument("--all-variants", "--all", dest="all_variants", action="store_true",
                        help="also compile every mask/output flag variant of each attention config "
                             "(causal x kv_start x lse x softcap; ~280 compiles, ~10 min)")
    parser.add_argument("--perf", action="store_true",
                        help="also report the metrics that decide speed: CTAs per SM, MMA kind, K/V "
                             "buffers in flight, SASS instructions per main-loop iteration next to a "
                             "contiguous flash loop at the same tile, and the workloads' grids and waves")
    parser.add_argument("--wide", action="store_true",
                        help=f"print the full table, one line per compile (the default fits {TABLE_COLUMNS} columns)")
    parser.add_argument("--no-cache", action="store_true",
                        help="compile everything, ignoring and not writing the on-disk cache of compile results "
                             "(KVARENA_CHECK_CACHE, default ~/.cache/kvarena/check)")
    parser.add_argument("--write-occupancy", action="store_true",
                        help="with --perf: rewrite the CTAs-per-SM table of kvarena/kernels/occupancy.py "
                             "from these compiles (run it with --all-variants)")


def _elem_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def _launches(only: str | None, capability: int, all_variants: bool = False) -> list[_Launch]:
    """What the launchers would launch on a GPU of this capability, one per case.

    By default each attention config is compiled with every flag on (causal, kv_start,
    lse): the most code. ``all_variants`` adds the other flag combinations, since
    ptxas's register allocation is not monotone in the amount of code.
    """
    from kvarena.kernels import merge, store
    from kvarena.kernels import paged_attention as pa
    from kvarena.kernels import paged_attention_bwd as bwd
    from kvarena.kernels._common import ROW_TILE_WARPS, head_dim_pad
    from kvarena.kernels.occupancy import config_key

    out = []
    for name, d, group, dt, q_len, block, split, det, launched in ATTENTION_CASES:
        if split:  # a split always writes its lse
            launched = (launched[0], launched[1], True, launched[3])
        variants = {(launched, False, False): "as launched"}
        if name in OWN_KV_CASES:
            variants[(launched, True, False)] = "as launched"
        if name in FP8_CASES:
            variants[(launched, name in OWN_KV_CASES, True)] = "as launched"
        if name in ROPE_CASES:
            variants[(launched, name in OWN_KV_CASES, "rope")] = "as launched"
            if name in FP8_CASES and all_variants:  # both at once: --all only (CI time)
                variants[(launched, name in OWN_KV_CASES, "rope+fp8")] = "variant"
        variants.setdefault(((True, True, True, True), False, False), "all flags")
        if all_variants:  # a split always writes its lse
            for f in itertools.product((True, False), repeat=4):
                if f[2] or not split:
                    variants.setdefault((f, False, False), "variant")
        for (flags, own, kv), label in variants.items():
            fp8 = kv in (True, "rope+fp8")
            rope = (2 if own else 1) if kv in ("rope", "rope+fp8") else 0
            causal, has_kv_start, write_lse, softcap = flags
            guard = pa._needs_guard(q_len, causal, None)
            eb = _elem_bytes(dt)
            cfg = pa._pick_config(d, group, eb, None if det else q_len, capability,
                                  lean=not det and not guard and not softcap, rope=bool(rope), kv_fp8=fp8,
                                  own_kv=own)
            meta = pa._attn_constexprs(cfg, group, d, causal=causal, has_kv_start=has_kv_start,
                                       write_lse=write_lse, split=split, upcast=False, guard=guard,
                                       softcap=softcap, block_size=block, elem_bytes=eb, own_kv=own,
                                       sink_logits=label == "all flags", kv_fp8=fp8,  # the most code: with sinks
                                       capability=capability, rope=rope, rope_q_pos=True, rope_k_shift=True)
            meta.update(stride_qd=1, stride_od=1)  # unit strides: the JIT specializes them too
            kv = ("fp8e4nv" if meta["FP8_NATIVE"] else "u8") if fp8 else dt
            ptrs = {"q_ptr": dt, "k_ptr": kv, "v_ptr": kv, "o_ptr": "fp32" if split else dt, "lse_ptr": "fp32",
                    "block_table_ptr": "i32", "seq_lens_ptr": "i32", "cu_q_ptr": "i32", "kv_start_ptr": "i32",
                    "k2_ptr": dt, "v2_ptr": dt, "sink_ptr": "fp32", "ks_ptr": "fp32", "vs_ptr": "fp32",
                    "cos_ptr": "fp32", "sin_ptr": "fp32", "qpos_ptr": "i32", "kshift_ptr": "i32"}
            if fp8:  # per-token scales [blocks, block_size, H_kv]: unit head stride, token stride H_kv
                meta.update(stride_ksh=1, stride_vsh=1)
            desc = (f"{name}: {dt} D{d} G{group} BM{cfg['BLOCK_M']} BN{cfg['BLOCK_N']} "
                    f"w{cfg['num_warps']} s{cfg['num_stages']}")
            desc += " [" + ",".join(n for n, on in zip(_FLAG_NAMES, flags) if on) + "]"
            if meta["GUARD_NONFINITE"]:
                desc += " +nonfinite-guard"
            if meta["OWN_KV"]:
                desc += " +own-k/v"
            if meta["HAS_SINK_LOGITS"]:
                desc += " +sink-logits"
            if fp8:
                desc += " +fp8-kv"
            if rope:
                desc += " +rope-on-read" + (" (interleaved)" if rope == 2 else "")
            out.append(_Launch("attention", desc, pa._paged_attn_kernel, ptrs, meta, cfg["num_warps"],
                               cfg["num_stages"], i64=("stride_kb", "stride_vb"),
                               floats=("scale_log2", "softcap_inv", "softcap_log2"), maxnreg=cfg.get("maxnreg"),
                               div16=("block_size",) if block % 16 == 0 else (), variant=label,
                               nodiv=("stride_kst", "stride_vst"),
                               occupancy_key=config_key(capability, cfg, eb),
                               ref_tile=(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["HEAD_DIM_PAD"], cfg["num_warps"],
                                         cfg["num_stages"], dt)))
    for name, d, group, dt, given in BWD_CASES:
        cfg = bwd.pick_bwd_config(d, _elem_bytes(dt))
        flags = dict(GROUP=group, HEAD_DIM=d, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_M=cfg["BLOCK_M"],
                     BLOCK_N=cfg["BLOCK_N"], CAUSAL=given == 0, HAS_KV_START=True, HAS_SOFTCAP=True, UPCAST=False)
        tile = f"{dt} D{d} G{group} BM{cfg['BLOCK_M']} BN{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
        floats = ("scale", "scale_log2", "softcap_inv", "softcap_log2")
        ptrs = {"q_ptr": dt, "do_ptr": dt, "lse_ptr": "fp32", "delta_ptr": "fp32", "dq_ptr": dt, "k_ptr": dt,
                "v_ptr": dt, "block_table_ptr": "i32", "seq_lens_ptr": "i32", "cu_q_ptr": "i32",
                "kv_start_ptr": "i32", "k2_ptr": dt, "v2_ptr": dt}
        out.append(_Launch("attention_bwd", f"{name} dQ: {tile}" + (" +own-k/v" if given else ""),
                           bwd._attn_bwd_dq_kernel, ptrs, dict(flags, OWN_KV=given == 1), cfg["num_warps"],
                           cfg["num_stages"], i64=("stride_kb", "stride_vb"), floats=floats,
                           maxnreg=cfg["maxnreg"]))
        ptrs = {"q_ptr": dt, "do_ptr": dt, "lse_ptr": "fp32", "delta_ptr": "fp32", "kn_ptr": dt, "vn_ptr": dt,
                "dk_ptr": dt, "dv_ptr": dt, "seq_lens_ptr": "i32", "cu_q_ptr": "i32", "kv_start_ptr": "i32"}
        out.append(_Launch("attention_bwd", f"{name} dK/dV: {tile}" + (" given after history" if given else ""),
                           bwd._attn_bwd_dkdv_kernel, ptrs, dict(flags, GIVEN=given), cfg["num_warps"],
                           cfg["num_stages"], i64=("stride_nb",), floats=floats, maxnreg=cfg["maxnreg"]))
    for name, d, dt in REDUCE_CASES:
        d_pad = head_dim_pad(d)
        block_r = pa._reduce_block_rows(d_pad)
        meta = dict(HEAD_DIM=d, HEAD_DIM_PAD=d_pad, BLOCK_R=block_r, WRITE_LSE=True, HAS_SINK_LOGITS=True,
                    stride_od=1)
        ptrs = {"part_ptr": "fp32", "part_lse_ptr": "fp32", "o_ptr": dt, "lse_ptr": "fp32", "sink_ptr": "fp32"}
        out.append(_Launch("split_reduce", f"{name}: {dt} BR{block_r} w{ROW_TILE_WARPS}",
                           pa._split_reduce_kernel, ptrs, meta, ROW_TILE_WARPS, 1,
                           i64=("stride_ps",)))
    for name, d, dt, fp8 in STORE_CASES:
        cfg = store._pick_config(d)
        meta = dict(HEAD_DIM=d, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_R=cfg["BLOCK_R"],
                    QUANT=store.QUANT_TOKEN if fp8 else store.QUANT_NONE)
        if fp8:
            meta.update(stride_sh=1, stride_wh=1)
        cache = "u8" if fp8 else dt
        ptrs = {"k_ptr": dt, "v_ptr": dt, "k_cache_ptr": cache, "v_cache_ptr": cache, "slot_ptr": "i64",
                "ks_ptr": "fp32", "vs_ptr": "fp32"}
        out.append(_Launch("store_kv", f"{name}: {dt} BR{cfg['BLOCK_R']} w{cfg['num_warps']}",
                           store._store_kv_kernel, ptrs, meta, cfg["num_warps"], 1,
                           i64=("stride_cb", "stride_db", "stride_sb", "stride_wb"), div16=("block_size",),
                           nodiv=("stride_st", "stride_wt")))
    for name, d, dt in MERGE_CASES:
        cfg = merge._pick_config(d)
        meta = dict(HEAD_DIM=d, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_R=cfg["BLOCK_R"],
                    stride_oad=1, stride_obd=1, stride_od=1)
        ptrs = {"oa_ptr": dt, "ob_ptr": dt, "o_ptr": dt, "la_ptr": "fp32", "lb_ptr": "fp32", "l_ptr": "fp32"}
        out.append(_Launch("merge", f"{name}: {dt} BR{cfg['BLOCK_R']} w{cfg['num_warps']}",
                           merge._merge_states_kernel, ptrs, meta, cfg["num_warps"], 1))
    if only:
        out = [x for x in out if only in x.config or only in x.kernel_name]
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


# ----------------------------------------------------------------------------- compile cache

# The fields of a row that come from the compile (the rest come from the launch table).
_COMPILED = ("registers", "spill_stores", "spill_loads", "shared_bytes", "fits", "error", "mma", "kv_buffers",
             "loop_sass")


def _cache_dir() -> str | None:
    where = os.environ.get("KVARENA_CHECK_CACHE", "")
    if where in ("0", "off"):
        return None
    return where or os.path.join(os.path.expanduser("~"), ".cache", "kvarena", "check")


@functools.lru_cache(maxsize=1)
def _own_source_hash() -> str:
    import hashlib

    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _cache_key(parts: list) -> str:
    import hashlib

    import triton

    payload = [_own_source_hash(), triton.__version__, os.environ.get("TRITON_PTXAS_PATH", ""), *parts]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode()).hexdigest()


def _cache_get(key: str) -> dict | None:
    where = _cache_dir()
    path = where and os.path.join(where, key[:2], key + ".json")
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # a torn or foreign file: compile again


def _cache_put(key: str, value: dict) -> None:
    where = _cache_dir()
    if not where:
        return
    path = os.path.join(where, key[:2], key + ".json")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)  # atomic: a reader sees the old file, the new one, or none
    except OSError:
        pass  # a read-only home: the check still runs, uncached


def _launch_key(launch: _Launch, capability: int, perf: bool) -> str:
    sig, attrs = _signature(launch)
    return _cache_key(["launch", launch.kernel_name, launch.fn.cache_key, sorted(sig.items()),
                       sorted((list(k), v) for k, v in attrs.items()), sorted(launch.constexprs.items()),
                       launch.num_warps, launch.num_stages, launch.maxnreg, capability, perf])


def _compile_cached(launch: _Launch, capability: int, perf: bool = False) -> Row:
    """:func:`_compile`, or its compile-derived fields from the cache."""
    key = _launch_key(launch, capability, perf)
    hit = _cache_get(key)
    if hit is None:
        row = _compile(launch, capability, perf)
        if not row.error.startswith("no ptxas log"):
            _cache_put(key, {k: getattr(row, k) for k in _COMPILED})
        return row
    row = Row(launch.kernel_name, launch.config, TARGET_NAMES[capability], hit["registers"], hit["spill_stores"],
              hit["spill_loads"], hit["shared_bytes"], hit["fits"], 0.0, error=hit["error"], variant=launch.variant,
              cached=True)
    if perf and launch.kernel_name == "attention" and not hit["error"]:
        from kvarena.kernels.occupancy import occupancy

        row.ctas_per_sm = occupancy(capability, row.registers, row.shared_bytes, launch.num_warps)
        row.mma, row.kv_buffers, row.loop_sass = hit["mma"], hit["kv_buffers"], hit["loop_sass"]
        row.occupancy_key = list(launch.occupancy_key)
    return row


def _compile(launch: _Launch, capability: int, perf: bool = False) -> Row:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = _signature(launch)
    src = ASTSource(fn=launch.fn, signature=sig, constexprs=dict(launch.constexprs), attrs=attrs)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    if launch.maxnreg is not None:
        options["maxnreg"] = launch.maxnreg
    buf = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf):
            compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
    except Exception as exc:  # a failed compile is a failed row, not a crash of the report
        return Row(launch.kernel_name, launch.config, TARGET_NAMES[capability], -1, -1, -1, -1, False,
                   time.perf_counter() - t0, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    log = buf.getvalue()
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spills = [(int(a), int(b)) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    shared = int(compiled.metadata.shared)
    if not regs or not spills:
        return Row(launch.kernel_name, launch.config, TARGET_NAMES[capability], -1, -1, -1, shared, False,
                   time.perf_counter() - t0, error="no ptxas log (was the compile cached?)")
    st, ld = max(s for s, _ in spills), max(x for _, x in spills)
    fits = st == 0 and ld == 0 and shared <= SHARED_LIMIT[capability]
    row = Row(launch.kernel_name, launch.config, TARGET_NAMES[capability], max(regs), st, ld, shared, fits,
              time.perf_counter() - t0, variant=launch.variant)
    if perf and launch.kernel_name == "attention":
        from kvarena.kernels.occupancy import occupancy

        row.ctas_per_sm = occupancy(capability, row.registers, shared, launch.num_warps)
        row.mma = _mma_kind(compiled.asm["ptx"])
        row.kv_buffers = _kv_buffers(compiled.asm["ttgir"], launch.constexprs["BLOCK_N"],
                                     launch.constexprs["HEAD_DIM_PAD"])
        row.loop_sass = _main_loop_sass(compiled.asm["cubin"])
        row.occupancy_key = list(launch.occupancy_key)
    return row


# ----------------------------------------------------------------------------- --perf metrics


def _mma_kind(ptx: str) -> str:
    """The tensor-core instruction family of a kernel: wgmma (sm_90a), mma.sync, or none."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    return "mma.sync" if "mma.sync" in ptx else "fma"


def _kv_buffers(ttgir: str, block_n: int, d_pad: int) -> int:
    """Shared-memory buffers of the K/V tiles in the main loop(s), from the ttgir.

    The software pipeliner stages a loop's loads in mutable ``memdesc<N x ...>`` allocations;
    the K and V tiles are the ones shaped ``[D, BLOCK_N]`` or ``[BLOCK_N, D]``. The fewest
    over them is reported (0: the tiles are not staged through shared memory at all).
    """
    counts = []
    for n, a, b in re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x(\d+)x(\d+)x", ttgir):
        if {int(a), int(b)} == {block_n, d_pad}:
            counts.append(int(n))
    return min(counts, default=0)


def _nvdisasm() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def _main_loop_sass(cubin: bytes) -> int:
    """SASS instructions of the main loop: the smallest innermost loop that runs the dots.

    Loops are found from backward branches in ``nvdisasm`` output; innermost ones contain
    no other loop. On the large-block path the smallest such loop is the interior loop
    (no mask code), elsewhere there is one. -1 when nvdisasm is missing or finds none.
    """
    import subprocess
    import tempfile

    tool = _nvdisasm()
    if not os.path.exists(tool):
        return -1
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, timeout=120).stdout
    labels, instrs, pending = {}, [], []
    for line in text.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*)", line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append((addr, m.group(2)))
    loops = []
    for addr, ins in instrs:
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ins)
        if m and labels.get(m.group(1), addr + 1) < addr:
            loops.append((labels[m.group(1)], addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    sizes = []
    for lo, hi in inner:
        body = [ins for a, ins in instrs if lo <= a <= hi]
        if any("MMA" in ins or "FFMA" in ins for ins in body):
            sizes.append(len(body))
    return min(sizes, default=-1)


def _reference_loop_sass_cached(tile: tuple, capability: int) -> int:
    """:func:`_reference_loop_sass`, from the compile cache when it holds it."""
    from kvarena.kernels.flash_reference import _flash_reference_kernel as fn

    key = _cache_key(["reference", fn.cache_key, list(tile), capability])
    hit = _cache_get(key)
    if hit is not None:
        return hit["loop_sass"]
    sass = _reference_loop_sass(tile, capability)
    _cache_put(key, {"loop_sass": sass})
    return sass


def _reference_loop_sass(tile: tuple, capability: int) -> int:
    """Main-loop SASS of the contiguous flash reference compiled at ``tile``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvarena.kernels.flash_reference import _flash_reference_kernel as fn

    block_m, block_n, d_pad, warps, stages, dt = tile
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ("HEAD_DIM", "BLOCK_M", "BLOCK_N"):
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name], attrs[(i,)] = "*" + dt, [["tt.divisibility", 16]]
        elif name == "scale_log2":
            sig[name] = "fp32"
        else:
            sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(HEAD_DIM=d_pad, BLOCK_M=block_m, BLOCK_N=block_n),
                    attrs=attrs)
    with contextlib.redirect_stdout(io.StringIO()):
        compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": warps, "num_stages": stages})
    return _main_loop_sass(compiled.asm["cubin"])


def _workload_rows(targets) -> list[dict]:
    """The launch plans of the contract's workloads (pure host math, no compile)."""
    from kvarena.kernels.paged_attention import plan_launch

    rows = []
    for cap in targets:
        for name, d, group, h_kv, b, q_len, k_len, block, causal, own in WORKLOADS:
            plan = plan_launch(head_dim=d, group=group, elem_bytes=2, num_seqs=b, num_kv_heads=h_kv,
                               max_seqlen_q=q_len, max_seqlen_k=k_len, block_size=block, causal=causal,
                               window_left=None, sink_tokens=0, softcap=False, num_splits=None,
                               deterministic=False, capability=cap, sm_count=SM_COUNT[cap], own_len=own)
            if own and not plan.own_kv:
                name += " (NOT one launch)"
            ctas = plan.programs * plan.num_splits
            slots = SM_COUNT[cap] * max(1, plan.ctas_per_sm)
            rows.append(dict(workload=name, target=TARGET_NAMES[cap], tile=f"{plan.cfg['BLOCK_M']}x{plan.cfg['BLOCK_N']}",
                             programs=plan.programs, splits=plan.num_splits, ctas_per_sm=plan.ctas_per_sm,
                             waves=round(ctas / slots, 2), efficiency=round(plan.wave_efficiency(SM_COUNT[cap]), 3)))
    return rows


def _write_occupancy(rows: list[Row]) -> str:
    """Rewrite occupancy.CTAS_PER_SM from attention rows: the fewest CTAs per key."""
    from kvarena.kernels import occupancy

    table: dict[tuple, int] = {}
    for r in rows:
        if r.kernel == "attention" and r.occupancy_key and r.fits:
            key = tuple(r.occupancy_key)
            table[key] = min(table.get(key, r.ctas_per_sm), r.ctas_per_sm)
    path = occupancy.__file__
    with open(path) as f:
        text = f.read()
    head, sep, _ = text.partition("CTAS_PER_SM: dict[tuple, int] = {")
    if not sep:
        raise RuntimeError(f"{path}: no CTAS_PER_SM table to rewrite")
    body = "".join(f"    {k!r}: {v},\n" for k, v in sorted(table.items()))
    with open(path, "w") as f:
        f.write(head + sep + "\n" + body + "}\n")
    return path



#: Compiles finished so far, shared with the worker processes (forked, so they inherit it);
#: set by ``run`` while it compiles, read by its progress line.
_DONE = None


class _Progress:
    """``compiles done / total, ETA`` on stderr: redrawn in place on a terminal, else a line
    every 10% (so a log gets a dozen lines, not one per compile)."""

    def __init__(self, total: int) -> None:
        self.total, self.t0, self.tty = max(1, total), time.perf_counter(), sys.stderr.isatty()
        self.last_decile = -1

    def show(self, done: int, final: bool = False) -> None:
        elapsed = time.perf_counter() - self.t0
        eta = f", about {elapsed / done * (self.total - done):.0f} s left" if 0 < done < self.total else ""
        line = f"kvarena check: {done}/{self.total} compiles, {elapsed:.0f} s{eta}"
        if self.tty:
            sys.stderr.write(f"\r{line:<78}" + ("\n" if final else ""))
        elif final or done * 10 // self.total > self.last_decile:
            self.last_decile = done * 10 // self.total
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _compile_target(job: tuple) -> list[Row]:
    """Every launch of one target, in ``_launches`` order (with ``--perf``: its metrics and
    the reference loop of each tile)."""
    only, cap, all_variants, perf = job
    rows = []
    ref: dict[tuple, int] = {}
    for launch in _launches(only, cap, all_variants):
        row = _compile_cached(launch, cap, perf)
        if perf and launch.ref_tile is not None and row.mma:
            if launch.ref_tile not in ref:
                ref[launch.ref_tile] = _reference_loop_sass_cached(launch.ref_tile, cap)
            row.ref_loop_sass = ref[launch.ref_tile]
        rows.append(row)
        if _DONE is not None:
            with _DONE.get_lock():
                _DONE.value += 1
    return rows


#: The default table's width: wider configs wrap onto continuation lines (``--wide``: one line each).
TABLE_COLUMNS = 120


def _print_table(rows: list[Row], wide: bool = False) -> None:
    """One line per compile (plus continuation lines for a long config unless ``wide``).

    The default form fits :data:`TABLE_COLUMNS`: no kernel column (the config names its
    kind), short headers, the config wrapped, compile errors listed under the table.
    ``wide``: every column on one line, errors inline.
    """
    import textwrap

    perf = any(r.mma for r in rows)
    if wide:
        head = ("kernel", "config", "target", "regs", "spill st/ld", "shared KiB", "fits")
    else:
        head = ("config", "target", "regs", "spills", "smem KiB", "fits")
    if perf:
        head += ("CTAs/SM", "MMA", "K/V bufs", "loop SASS", "ref SASS", "ratio") if wide else \
            ("CTA/SM", "MMA", "K/V", "loop", "ref", "ratio")

    def perf_cols(r: Row) -> tuple:
        if not r.mma:
            return ("",) * 6
        ratio = f"{r.loop_sass / r.ref_loop_sass:.2f}" if r.loop_sass > 0 and r.ref_loop_sass > 0 else "-"
        return (str(r.ctas_per_sm), r.mma, str(r.kv_buffers), str(r.loop_sass), str(r.ref_loop_sass), ratio)

    def fits(r: Row) -> str:
        if r.fits:
            return "yes"
        return "NO: " + r.error if r.error and wide else "NO"

    body = [
        ((r.kernel,) if wide else ()) + (r.config, r.target, str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
                                         f"{r.shared_bytes / 1024:.1f}", fits(r))
        + (perf_cols(r) if perf else ())
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    cfg = 1 if wide else 0  # the config column
    if not wide:
        others = sum(w for i, w in enumerate(widths) if i != cfg) + 2 * (len(widths) - 1)
        widths[cfg] = max(len(head[cfg]), min(widths[cfg], TABLE_COLUMNS - others))
    for line in [head, tuple("-" * w for w in widths), *body]:
        parts = [line[cfg]]
        if len(line[cfg]) > widths[cfg]:  # only in the default form: --wide sized the column to fit
            parts = textwrap.wrap(line[cfg], widths[cfg], subsequent_indent="  ", break_on_hyphens=False)
        first = line[:cfg] + (parts[0],) + line[cfg + 1:]
        print("  ".join(x.ljust(w) for x, w in zip(first, widths)).rstrip())
        for more in parts[1:]:
            print(more.rstrip())
    errors = [r for r in rows if not r.fits and r.error]
    if errors and not wide:
        print("compile errors:")
        for r in errors:
            print(textwrap.fill(f"{r.config} [{r.target}]: {r.error}", TABLE_COLUMNS, initial_indent="  ",
                                subsequent_indent="    "))


def run(args) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("kvarena check: TRITON_INTERPRET=1 is set, which swaps the compiler for the interpreter; "
              "run it in an environment without TRITON_INTERPRET", file=sys.stderr)
        return 2
    # ptxas prints its -v log only when asked, and only for a compile that really runs.
    saved = {k: os.environ.get(k) for k in ("TRITON_DUMP_PTXAS_LOG", "TRITON_ALWAYS_COMPILE", "TRITON_DEFAULT_FP_FUSION",
                                            "KVARENA_CHECK_CACHE")}
    if args.no_cache:
        os.environ["KVARENA_CHECK_CACHE"] = "0"
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default launches use
    try:
        import triton

        targets = args.target or sorted(SHARED_LIMIT)
        per_target = {cap: _launches(args.only, cap, args.all_variants) for cap in targets}
        n = len(per_target[targets[0]])
        if n == 0:  # nothing to compile must not read as "all fit"
            raise UsageError("--only", f"{args.only!r} matches no kernel configuration")
        print(f"kvarena check: {n} configurations x {len(targets)} targets, triton {triton.__version__}")
        t0 = time.perf_counter()
        # One process per target: compiles are CPU-bound (MLIR passes, ptxas), so two
        # targets on a 2-core machine take about half the wall time.
        jobs = [(args.only, cap, args.all_variants, args.perf) for cap in targets]
        workers = min(len(targets), os.cpu_count() or 1)
        import concurrent.futures
        import multiprocessing

        global _DONE
        ctx = multiprocessing.get_context("fork")
        _DONE = ctx.Value("i", 0)
        progress = _Progress(n * len(targets))
        progress.show(0)
        try:
            if workers > 1:
                with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                    futures = [pool.submit(_compile_target, job) for job in jobs]
                    while concurrent.futures.wait(futures, timeout=1.0).not_done:
                        progress.show(_DONE.value)
                    per_rows = [f.result() for f in futures]
            else:
                per_rows = []
                for job in jobs:  # the counter moves in this process: show it per target
                    per_rows.append(_compile_target(job))
                    progress.show(_DONE.value)
            progress.show(_DONE.value, final=True)
        finally:
            _DONE = None
        rows = [per_rows[t][i] for i in range(n) for t in range(len(targets))]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _print_table(rows, wide=args.wide)
    bad = [r for r in rows if not r.fits]
    hits = sum(r.cached for r in rows)
    cache_note = f" ({hits} from the compile cache; --no-cache compiles all)" if hits else ""
    print(f"{len(rows)} compiles in {time.perf_counter() - t0:.0f} s{cache_note}; "
          + ("all fit (no spills, shared memory within limits)" if not bad else f"{len(bad)} do NOT fit"))
    workloads = _workload_rows(targets) if args.perf else []
    if workloads:
        print()
        _print_workloads(workloads)
    if args.perf and args.write_occupancy:
        print(f"wrote the CTAs-per-SM table to {_write_occupancy(rows)}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            payload = [asdict(r) for r in rows]
            json.dump({"rows": payload, "workloads": workloads} if args.perf else payload, f, indent=1)
    return 1 if bad or not rows else 0


def _print_workloads(rows: list[dict]) -> None:
    head = ("workload", "target", "tile", "programs", "splits", "CTAs/SM", "waves", "wave eff.")
    body = [(r["workload"], r["target"], r["tile"], str(r["programs"]), str(r["splits"]), str(r["ctas_per_sm"]),
             f"{r['waves']:.2f}", f"{r['efficiency']:.3f}") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    for line in [head, tuple("-" * w for w in widths), *body]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip())
