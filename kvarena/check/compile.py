"""One ahead-of-time compile (``triton.compile`` on an ``ASTSource``, ptxas included) and
the :class:`Row` it gives, from the compile cache when it holds it."""

from __future__ import annotations

import contextlib
import io
import re
import time
from dataclasses import dataclass

from kvarena.check.cache import _cache_get, _cache_key, _cache_put
from kvarena.check.cases import SHARED_LIMIT
from kvarena.check.cycles import LoopCounts, tile_model
from kvarena.check.launches import _Launch, _signature
from kvarena.check.sass import _kv_buffers, _main_loop_counts, _mma_kind
from kvarena.kernels.arch import ARCHS


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


# The --perf fields of a row (left at their defaults by a plain run).
_PERF = ("ctas_per_sm", "mma", "kv_buffers", "loop_sass", "path_sass", "ref_loop_sass", "occupancy_key", "loop_counts",
         "tile_model")
# The fields of a row that come from the compile (the rest come from the launch table).
_COMPILED = ("registers", "spill_stores", "spill_loads", "shared_bytes", "fits", "error", "mma", "kv_buffers",
             "loop_sass", "path_sass", "loop_counts")


def _launch_key(launch: _Launch, target: str) -> str:
    sig, attrs = _signature(launch)
    return _cache_key(["launch", launch.kernel_name, launch.fn.cache_key, sorted(sig.items()),
                       sorted((list(k), v) for k, v in attrs.items()), sorted(launch.constexprs.items()),
                       launch.num_warps, launch.num_stages, launch.maxnreg, target])


def _compile_cached(launch: _Launch, target: str, perf: bool = False) -> Row:
    """:func:`_compile`, or its compile-derived fields from the cache. The cache holds the
    ``--perf`` metrics of every compile, so a plain run and a ``--perf`` run share it."""
    key = _launch_key(launch, target)
    hit = _cache_get(key)
    if hit is None:
        row = _compile(launch, target)
        if not row.error.startswith("no "):
            _cache_put(key, {k: getattr(row, k) for k in _COMPILED})
    else:
        # fits is the target's limit applied now (the record may have changed since).
        fits = _fits(hit["error"], hit["spill_stores"], hit["spill_loads"], hit["shared_bytes"], target)
        row = Row(launch.kernel_name, launch.config, target, hit["registers"], hit["spill_stores"],
                  hit["spill_loads"], hit["shared_bytes"], fits, 0.0, error=hit["error"],
                  variant=launch.variant, cached=True, mma=hit["mma"], kv_buffers=hit["kv_buffers"],
                  loop_sass=hit["loop_sass"], path_sass=hit["path_sass"])
        if launch.kernel_name == "attention" and not hit["error"]:
            _set_perf(row, launch, hit.get("loop_counts"))
    return row if perf else _without_perf(row)


def _without_perf(row: Row) -> Row:
    """``row`` as a plain (not ``--perf``) run reports it."""
    from dataclasses import fields, replace

    defaults = {f.name: f.default for f in fields(Row) if f.name in _PERF}
    return replace(row, **defaults)


def _set_perf(row: Row, launch: _Launch, counts: dict | None) -> None:
    """The row's occupancy on its target and, for a tensor-core loop, its tile model."""
    row.ctas_per_sm = ARCHS[row.target].occupancy(row.registers, row.shared_bytes, launch.num_warps)
    row.occupancy_key = list(launch.occupancy_key)
    _set_model(row, counts, launch, row.target)


def _set_model(row: Row, counts: dict | None, launch: _Launch, target: str) -> None:
    """The row's loop counts and, for a tensor-core loop, its tile cycle model."""
    from dataclasses import asdict

    row.loop_counts = counts
    k = launch.constexprs
    fma = 2 * k["BLOCK_M"] * k["BLOCK_N"] * k["HEAD_DIM_PAD"]  # Q.K^T and P.V of one tile
    model = tile_model(LoopCounts(**counts), target, launch.num_warps, row.ctas_per_sm, fma) if counts else None
    row.tile_model = asdict(model) if model else None


@dataclass(frozen=True)
class _Resources:
    """What a compile uses: registers (VGPRs on AMD), spilled bytes, shared memory (LDS)."""

    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    error: str = ""


def _ptxas_resources(log: str, shared: int) -> _Resources:
    """NVIDIA: registers and spills from the ptxas -v log."""
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spills = [(int(a), int(b)) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    if not regs or not spills:
        return _Resources(-1, -1, -1, shared, error="no ptxas log (was the compile cached?)")
    return _Resources(max(regs), max(s for s, _ in spills), max(x for _, x in spills), shared)


def _amdgcn_resources(asm: str, shared: int) -> _Resources:
    """AMD: VGPRs (architected + accumulation) and spills from the amdgcn kernel metadata.
    A VGPR spill or any scratch is a spill (stores = bytes of scratch, loads = spilled VGPRs);
    SGPRs spilled into VGPR lanes are not (they cost no memory traffic)."""
    def field(name: str) -> int:
        found = re.findall(rf"^\s*;\s*{name}:\s*(\d+)", asm, flags=re.M)
        return max(int(x) for x in found) if found else -1

    vgprs, spilled = field("TotalNumVgprs"), re.findall(r"\.vgpr_spill_count:\s*(\d+)", asm)
    scratch = field("ScratchSize")
    if vgprs < 0 or scratch < 0 or not spilled:
        return _Resources(-1, -1, -1, shared, error="no amdgcn metadata")
    return _Resources(vgprs, scratch, max(int(x) for x in spilled), shared)


def _fits(error: str, spill_stores: int, spill_loads: int, shared: int, target: str) -> bool:
    """A compile fits its target: it compiled, spilt nothing and its shared memory (LDS) is
    within what one block may use there."""
    return not error and spill_stores == 0 and spill_loads == 0 and shared <= SHARED_LIMIT[target]


def _compile(launch: _Launch, target: str) -> Row:
    """One compile's row, with its ``--perf`` metrics (attention kernels)."""
    import triton
    from triton.compiler import ASTSource

    arch = ARCHS[target]
    sig, attrs = _signature(launch)
    src = ASTSource(fn=launch.fn, signature=sig, constexprs=dict(launch.constexprs), attrs=attrs)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    if launch.maxnreg is not None and not arch.is_amd:
        options["maxnreg"] = launch.maxnreg
    buf = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf):
            compiled = triton.compile(src, target=arch.gpu_target(), options=options)
    except Exception as exc:  # a failed compile is a failed row, not a crash of the report
        return Row(launch.kernel_name, launch.config, target, -1, -1, -1, -1, False,
                   time.perf_counter() - t0, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    shared = int(compiled.metadata.shared)
    res = _amdgcn_resources(compiled.asm["amdgcn"], shared) if arch.is_amd else \
        _ptxas_resources(buf.getvalue(), shared)
    fits = _fits(res.error, res.spill_stores, res.spill_loads, shared, target)
    row = Row(launch.kernel_name, launch.config, target, res.registers, res.spill_stores, res.spill_loads, shared,
              fits, time.perf_counter() - t0, error=res.error, variant=launch.variant)
    if launch.kernel_name == "attention" and not res.error:
        row.kv_buffers = _kv_buffers(compiled.asm["ttgir"], launch.constexprs["BLOCK_N"],
                                     launch.constexprs["HEAD_DIM_PAD"])
        counts = None
        if arch.is_amd:
            row.mma = "mfma" if re.search(r"\bv_mfma_", compiled.asm["amdgcn"]) else "fma"
        else:
            row.mma = _mma_kind(compiled.asm["ptx"])
            row.loop_sass, row.path_sass, counts = _main_loop_counts(compiled.asm["cubin"])
        _set_perf(row, launch, counts)
    return row
