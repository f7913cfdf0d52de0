"""The ``--perf`` metrics read from a compile: MMA kind (PTX), K/V buffers in flight
(ttgir), SASS instructions per main-loop iteration and that loop's counts for the tile
cycle model (``nvdisasm``, :mod:`.cycles`), and the same for the contiguous flash
reference at the same tile."""

from __future__ import annotations

import contextlib
import io
import os
import re

from kvarena.check.cache import _cache_get, _cache_key, _cache_put


def _mma_kind(ptx: str) -> str:
    """The tensor-core instruction family of a kernel: tcgen05 (sm_100a), wgmma (sm_90a),
    mma.sync, or none (fma)."""
    if "tcgen05.mma" in ptx:
        return "tcgen05"
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


def _disassemble(cubin: bytes) -> str | None:
    """``nvdisasm -c`` of a cubin; None when the tool is missing."""
    import subprocess
    import tempfile

    tool = _nvdisasm()
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, timeout=120).stdout


def _parse(text: str) -> tuple[dict[str, int], list[tuple[int, str]]]:
    """``nvdisasm`` text as (label -> address, [(address, instruction)] in address order)."""
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
    return labels, instrs


#: A branch and its target label; a predicated branch may carry a second predicate
#: (``@P1 BRA P5, `(.L_x_1)``, Triton 3.6's decode loop).
_BRANCH = re.compile(r"BRA (?:!?U?P\w+, )?`\((\.L_x_\d+)\)")


def _main_loop_span(text: str) -> tuple[dict[str, int], list[tuple[int, str]]] | None:
    """The main loop as (labels, [(address, instruction)]): the smallest innermost loop that
    runs the dots.

    Loops are found from backward branches in ``nvdisasm`` output; innermost ones contain
    no other loop. On the large-block path the smallest such loop is the interior loop
    (no mask code), elsewhere there is one. None when there is none.
    """
    labels, instrs = _parse(text)
    loops = []
    for addr, ins in instrs:
        m = _BRANCH.search(ins)
        if m and labels.get(m.group(1), addr + 1) < addr:
            loops.append((labels[m.group(1)], addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    bodies = []
    for lo, hi in inner:
        body = [(a, ins) for a, ins in instrs if lo <= a <= hi]
        if any("MMA" in ins or "FFMA" in ins for _, ins in body):
            bodies.append(body)
    body = min(bodies, key=len, default=None)
    return (labels, body) if body else None


def _main_loop(text: str) -> list[str] | None:
    """The SASS lines of the main loop (:func:`_main_loop_span`); None when there is none."""
    span = _main_loop_span(text)
    return [ins for _, ins in span[1]] if span else None


def _interior_path(labels: dict[str, int], body: list[tuple[int, str]]) -> int:
    """SASS instructions of the loop minus its largest forward-skipped block.

    A loop whose tiles differ at the edges (the page loop's mask block, run by a
    boundary tile and jumped over by an interior one) has one block that a forward
    branch inside the loop skips; the interior tile runs the rest. The loop length
    when no branch skips anything.
    """
    hi = body[-1][0]
    skipped = 0
    for addr, ins in body:
        m = _BRANCH.search(ins)
        target = labels.get(m.group(1), -1) if m else -1
        if addr < target <= hi:
            skipped = max(skipped, sum(1 for a, _ in body if addr < a < target))
    return len(body) - skipped


def _main_loop_sass(cubin: bytes) -> int:
    """SASS instructions of the main loop (:func:`_main_loop`); -1 when nvdisasm is missing
    or finds none."""
    text = _disassemble(cubin)
    body = _main_loop(text) if text is not None else None
    return len(body) if body else -1


def _main_loop_counts(cubin: bytes) -> tuple[int, int, dict | None]:
    """(main-loop SASS, its interior path (:func:`_interior_path`), its
    :class:`~kvarena.check.cycles.LoopCounts` as a dict); (-1, -1, None) when nvdisasm is
    missing or finds no loop."""
    from dataclasses import asdict

    from kvarena.check.cycles import count_loop

    text = _disassemble(cubin)
    span = _main_loop_span(text) if text is not None else None
    if span is None:
        return -1, -1, None
    labels, body = span
    return len(body), _interior_path(labels, body), asdict(count_loop([ins for _, ins in body]))


def _reference_loop_sass_cached(tile: tuple, target: str) -> int:
    """:func:`_reference_loop_sass`, from the compile cache when it holds it."""
    from kvarena.kernels.flash_reference import _flash_reference_kernel as fn

    key = _cache_key(["reference", fn.cache_key, list(tile), target])
    hit = _cache_get(key)
    if hit is not None:
        return hit["loop_sass"]
    sass = _reference_loop_sass(tile, target)
    _cache_put(key, {"loop_sass": sass})
    return sass


def _reference_loop_sass(tile: tuple, target: str) -> int:
    """Main-loop SASS of the contiguous flash reference compiled at ``tile``."""
    import triton
    from triton.compiler import ASTSource

    from kvarena.kernels.arch import ARCHS
    from kvarena.kernels.flash_reference import _flash_reference_kernel as fn

    block_m, block_n, d_pad, warps, stages, dt, kv_dt = tile
    fp8 = kv_dt != dt
    consts = dict(HEAD_DIM=d_pad, BLOCK_M=block_m, BLOCK_N=block_n, KV_FP8=fp8, FP8_NATIVE=kv_dt == "fp8e4nv")
    ptr_types = {"k_ptr": kv_dt, "v_ptr": kv_dt, "ks_ptr": "fp32", "vs_ptr": "fp32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("ks_ptr", "vs_ptr") and not fp8:
            sig[name] = "constexpr"  # never read: None
            consts[name] = None
        elif name.endswith("_ptr"):
            sig[name], attrs[(i,)] = "*" + ptr_types.get(name, dt), [["tt.divisibility", 16]]
        elif name == "scale_log2":
            sig[name] = "fp32"
        else:
            sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    with contextlib.redirect_stdout(io.StringIO()):
        compiled = triton.compile(src, target=ARCHS[target].gpu_target(),
                                  options={"num_warps": warps, "num_stages": stages})
    return _main_loop_sass(compiled.asm["cubin"])
