"""One ahead-of-time compile (``triton.compile`` on an ``ASTSource``, ptxas included) and
the :class:`Row` it gives, from the compile cache when it holds it."""

from __future__ import annotations

import contextlib
import io
import re
import time
from dataclasses import dataclass

from kvarena.check.cache import _cache_get, _cache_key, _cache_put
from kvarena.check.cases import SHARED_LIMIT, TARGET_NAMES
from kvarena.check.cycles import LoopCounts, tile_model
from kvarena.check.launches import _Launch, _signature
from kvarena.check.sass import _kv_buffers, _main_loop_counts, _mma_kind


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
    # the main loop, SASS instructions per main-loop iteration, the interior tile's path
    # through it (the loop minus a forward-skipped edge block) and the SASS of the
    # contiguous reference loop at the same tile; the main loop's SASS counts
    # (cycles.LoopCounts) and its tile cycle model (cycles.TileModel) as dicts.
    ctas_per_sm: int = 0
    mma: str = ""
    kv_buffers: int = -1
    loop_sass: int = -1
    path_sass: int = -1
    ref_loop_sass: int = -1
    occupancy_key: list | None = None
    loop_counts: dict | None = None
    tile_model: dict | None = None


# The fields of a row that come from the compile (the rest come from the launch table).
_COMPILED = ("registers", "spill_stores", "spill_loads", "shared_bytes", "fits", "error", "mma", "kv_buffers",
             "loop_sass", "path_sass", "loop_counts")


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
        row.mma, row.kv_buffers = hit["mma"], hit["kv_buffers"]
        row.loop_sass, row.path_sass = hit["loop_sass"], hit["path_sass"]
        row.occupancy_key = list(launch.occupancy_key)
        _set_model(row, hit.get("loop_counts"), launch, capability)
    return row


def _set_model(row: Row, counts: dict | None, launch: _Launch, capability: int) -> None:
    """The row's loop counts and, for a tensor-core loop, its tile cycle model."""
    from dataclasses import asdict

    row.loop_counts = counts
    k = launch.constexprs
    fma = 2 * k["BLOCK_M"] * k["BLOCK_N"] * k["HEAD_DIM_PAD"]  # Q.K^T and P.V of one tile
    model = tile_model(LoopCounts(**counts), capability, launch.num_warps, row.ctas_per_sm, fma) if counts else None
    row.tile_model = asdict(model) if model else None


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
        row.loop_sass, row.path_sass, counts = _main_loop_counts(compiled.asm["cubin"])
        row.occupancy_key = list(launch.occupancy_key)
        _set_model(row, counts, launch, capability)
    return row
