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
"""

from __future__ import annotations

import contextlib
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

# Realistic heaviest launches: (name, head_dim, group, dtype, q_len_max, split, deterministic).
# q_len_max is what the pool passes as max_seqlen_q: 1 for decode, the chunk for slabs.
ATTENTION_CASES = [
    ("decode 32q/8kv", 128, 4, "bf16", 1, False, False),
    ("decode 32q/8kv split", 128, 4, "bf16", 1, True, False),
    ("decode D256 GQA8 split", 256, 8, "fp16", 1, True, False),
    ("chunk MAGI 24q/8kv", 128, 3, "bf16", 12150, False, False),
    ("chunk Wan split", 128, 1, "fp16", 4680, True, False),
    ("chunk GQA5 split", 128, 5, "bf16", 4096, True, False),
    ("chunk D256 GQA7 split", 256, 7, "bf16", 4096, True, False),
    ("spec-decode 4x8 split", 128, 8, "bf16", 4, True, False),
    ("deterministic 32q/8kv", 128, 4, "bf16", 1, True, True),
    ("decode fp32", 128, 4, "fp32", 1, False, False),
    ("chunk fp32 split", 128, 1, "fp32", 4680, True, False),
    ("chunk fp32 D256 GQA5", 256, 5, "fp32", 4680, False, False),
]
REDUCE_CASES = [("reduce D128", 128, "bf16"), ("reduce D256", 256, "fp16")]
STORE_CASES = [("store D256", 256, "bf16"), ("store D256 fp32", 256, "fp32")]
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


def add_arguments(parser) -> None:
    parser.add_argument("--target", type=int, action="append", choices=sorted(SHARED_LIMIT),
                        help="compute capability to compile for (repeatable; default: 80 and 90)")
    parser.add_argument("--only", type=nonempty, default=None,
                        help="only configurations whose name contains this text")
    # Checked when parsed (a writable file in an existing directory): the compiles take minutes.
    parser.add_argument("--json", dest="json_path", type=output_file, default=None,
                        help="also write the rows as JSON to this file")
    parser.add_argument("--all-variants", action="store_true",
                        help="also compile every mask/output flag variant of each attention config "
                             "(causal x kv_start x lse; ~200 compiles, ~4 min) instead of the all-on one")


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
    from kvarena.kernels._common import ROW_TILE_WARPS, head_dim_pad

    out = []
    for name, d, group, dt, q_len, split, det in ATTENTION_CASES:
        cfg = pa._pick_config(d, group, _elem_bytes(dt), None if det else q_len, capability)
        flag_sets = [(True, True, True)]
        if all_variants:  # a split always writes its lse
            flag_sets = [f for f in itertools.product((True, False), repeat=3) if f[2] or not split]
        for causal, has_kv_start, write_lse in flag_sets:
            meta = pa._attn_constexprs(cfg, group, d, causal=causal, has_kv_start=has_kv_start,
                                       write_lse=write_lse, split=split, upcast=False,
                                       guard=pa._needs_guard(q_len, causal, None))
            meta.update(stride_qd=1, stride_od=1)  # unit strides: the JIT specializes them too
            ptrs = {"q_ptr": dt, "k_ptr": dt, "v_ptr": dt, "o_ptr": "fp32" if split else dt, "lse_ptr": "fp32",
                    "block_table_ptr": "i32", "seq_lens_ptr": "i32", "cu_q_ptr": "i32", "kv_start_ptr": "i32"}
            desc = (f"{name}: {dt} D{d} G{group} BM{cfg['BLOCK_M']} BN{cfg['BLOCK_N']} "
                    f"w{cfg['num_warps']} s{cfg['num_stages']}")
            if (causal, has_kv_start, write_lse) != (True, True, True):
                desc += " [" + ",".join(n for n, on in zip(("causal", "kv_start", "lse"),
                                                           (causal, has_kv_start, write_lse)) if on) + "]"
            if meta["GUARD_NONFINITE"]:
                desc += " +nonfinite-guard"
            out.append(_Launch("attention", desc, pa._paged_attn_kernel, ptrs, meta, cfg["num_warps"],
                               cfg["num_stages"], i64=("stride_kb", "stride_vb"),
                               floats=("scale_log2", "softcap_inv", "softcap_log2"), maxnreg=cfg.get("maxnreg")))
    for name, d, dt in REDUCE_CASES:
        d_pad = head_dim_pad(d)
        block_r = pa._reduce_block_rows(d_pad)
        meta = dict(HEAD_DIM=d, HEAD_DIM_PAD=d_pad, BLOCK_R=block_r, WRITE_LSE=True, stride_od=1)
        ptrs = {"part_ptr": "fp32", "part_lse_ptr": "fp32", "o_ptr": dt, "lse_ptr": "fp32"}
        out.append(_Launch("split_reduce", f"{name}: {dt} BR{block_r} w{ROW_TILE_WARPS}",
                           pa._split_reduce_kernel, ptrs, meta, ROW_TILE_WARPS, 1,
                           i64=("stride_ps",)))
    for name, d, dt in STORE_CASES:
        cfg = store._pick_config(d)
        meta = dict(HEAD_DIM=d, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_R=cfg["BLOCK_R"])
        ptrs = {"k_ptr": dt, "v_ptr": dt, "k_cache_ptr": dt, "v_cache_ptr": dt, "slot_ptr": "i64"}
        out.append(_Launch("store_kv", f"{name}: {dt} BR{cfg['BLOCK_R']} w{cfg['num_warps']}",
                           store._store_kv_kernel, ptrs, meta, cfg["num_warps"], 1,
                           i64=("stride_cb", "stride_db")))
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
            if name.startswith("stride_") or name == "block_size":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _compile(launch: _Launch, capability: int) -> Row:
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
    return Row(launch.kernel_name, launch.config, TARGET_NAMES[capability], max(regs), st, ld, shared, fits,
               time.perf_counter() - t0)


def _print_table(rows: list[Row]) -> None:
    head = ("kernel", "config", "target", "regs", "spill st/ld", "shared KiB", "fits")
    body = [
        (r.kernel, r.config, r.target, str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
         f"{r.shared_bytes / 1024:.1f}", "yes" if r.fits else ("NO: " + r.error if r.error else "NO"))
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    for line in [head, tuple("-" * w for w in widths), *body]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip())


def run(args) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("kvarena check: TRITON_INTERPRET=1 is set, which swaps the compiler for the interpreter; "
              "run it in an environment without TRITON_INTERPRET", file=sys.stderr)
        return 2
    # ptxas prints its -v log only when asked, and only for a compile that really runs.
    saved = {k: os.environ.get(k) for k in ("TRITON_DUMP_PTXAS_LOG", "TRITON_ALWAYS_COMPILE", "TRITON_DEFAULT_FP_FUSION")}
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
        rows = [_compile(per_target[cap][i], cap) for i in range(n) for cap in targets]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _print_table(rows)
    bad = [r for r in rows if not r.fits]
    print(f"{len(rows)} compiles in {time.perf_counter() - t0:.0f} s; "
          + ("all fit (no spills, shared memory within limits)" if not bad else f"{len(bad)} do NOT fit"))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 1 if bad or not rows else 0
