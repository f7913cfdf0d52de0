"""The ``--perf`` tile cycle model: what one hot-loop iteration costs an SM, read from its SASS.

:func:`count_loop` counts one loop body (the SASS lines of one iteration, as
:func:`kvarena.check.sass._main_loop` finds them): tensor-core instructions and their shapes,
MUFU (SFU) instructions, shared-memory bytes, barriers, issue slots, and whether the exp2s
run while a warpgroup MMA of this warpgroup is still in flight. :func:`tile_model` turns
those counts into SM cycles per iteration for a target, with the CTAs resident per SM, and
the modelled tile time. docs/perf-model.md states the model, its numbers and what it
ignores.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Warp lanes, and the per-SM rates the model assumes (identical on A100 and H100/H200):
#: 16 MUFU results per clock (4 per sub-partition), 4 warp instructions issued per clock
#: (4 schedulers x 1), 128 bytes of shared memory per clock.
LANES = 32
SFU_PER_CLK = 16
ISSUE_PER_CLK = 4
SMEM_BYTES_PER_CLK = 128


@dataclass(frozen=True)
class Gpu:
    """A target's datasheet numbers: SMs, boost clock and dense tensor TFLOP/s per input type."""

    name: str
    sms: int
    clock_ghz: float
    dense_tflops: dict

    def fma_per_clk(self, dtype: str) -> int:
        """Dense tensor-core FMAs per clock per SM for ``dtype`` inputs (datasheet / SMs / clock)."""
        return round(self.dense_tflops[dtype] * 1e12 / (2 * self.sms * self.clock_ghz * 1e9))


#: A100 SXM (sm_80) and H100 SXM / H200 (sm_90a; same SMs, clock and tensor rates).
GPUS = {
    "sm_80": Gpu("A100", 108, 1.41, {"f16": 312.0, "tf32": 156.0, "i8": 624.0}),
    "sm_90a": Gpu("H100/H200", 132, 1.83, {"f16": 989.4, "tf32": 494.7, "f8": 1978.9, "i8": 1978.9}),
}
_ELEM_BYTES = {"f16": 2, "tf32": 4, "f8": 1, "i8": 1}


@dataclass(frozen=True)
class LoopCounts:
    """One loop iteration's SASS, per warp (a warpgroup MMA is in each of its 4 warps' code).

    ``group_mma_fma`` / ``warp_mma_fma``: FMAs of the warpgroup MMAs (HGMMA and kin, one
    operation per warpgroup) and of the per-warp MMAs (HMMA, mma.sync); ``mma_dtype`` their
    input type; ``mma_smem_bytes``: what the warpgroup MMAs read from shared memory (B
    always, A when it is a descriptor); ``shared_bytes``: LDS/STS/LDSM/STSM/LDGSTS bytes of
    the warp (32 lanes); ``ex2_under_mma``: the fraction of MUFU.EX2 issued while one of
    this warpgroup's MMA groups is in flight (issued, not yet waited for), and
    ``ex2_mma_fma`` the FMAs of the groups in flight then (the tensor work that can hide them).
    """

    instructions: int
    mma_shapes: str
    group_mma_fma: int
    warp_mma_fma: int
    mma_dtype: str
    mma_smem_bytes: int
    ex2: int
    mufu_other: int
    shared_bytes: int
    tma_copies: int
    cta_barriers: int
    named_barriers: int
    wg_arrives: int
    wg_waits: int
    ex2_under_mma: float
    ex2_mma_fma: int


@dataclass(frozen=True)
class TileModel:
    """SM cycles of one hot-loop iteration (all resident CTAs' warps) and the modelled time.

    ``overlap``: what runs beside the exp2s: ``"own MMA"`` (this warpgroup's own MMA
    groups are in flight: the next tile's Q.K^T, or a P.V not yet waited for; they hide
    up to their tensor cycles of SFU time), ``"other warps"`` (another CTA, or warpgroups
    not held in lockstep by a CTA barrier) or ``"none"`` (serialized: the SFU time adds to
    the tensor time). ``bound``: the term that sets ``tile`` (``tc+sfu`` when SFU time is
    exposed). ``useful``: the tensor cycles of the tile's own math (Q.K^T and P.V of
    ``BLOCK_M x BLOCK_N x HEAD_DIM``, per resident CTA; ``tc`` when not given): ``tc`` is
    more when warpgroups compute the same scores twice. ``peak = useful / tile``.
    """

    tc: int
    sfu: int
    issue: int
    smem: int
    overlap: str
    tile: int
    ratio: float
    peak: float
    bound: str
    useful: int


_GMMA = re.compile(r"\b([HQI])GMMA\.(\d+)x(\d+)x(\d+)\.(\S+)\s+(\S+),\s*(\S+)")
_WMMA = re.compile(r"\b([HI])MMA\.(16|8)(8)(\d+)\.(\S+)")
_SIZE = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "32": 4, "64": 8, "128": 16}


def _access_bytes(ins: str) -> int:
    """Bytes per lane of an LDS/STS/LDGSTS: the size suffix (``.64``, ``.128``, ``.U8`` ...), else 4."""
    op = ins.split()[0]
    for part in op.split(".")[1:]:
        if part in _SIZE:
            return _SIZE[part]
    return 4


def _op(ins: str) -> tuple[str, bool]:
    """(opcode, executed): the opcode after any predicate; ``@!PT`` (never true) is not executed."""
    parts = ins.split()
    if parts and parts[0].startswith("@"):
        return (parts[1] if len(parts) > 1 else ""), parts[0] != "@!PT"
    return (parts[0] if parts else ""), True


def _mma_dtype(kind: str, suffix: str) -> str:
    if kind == "Q":
        return "f8"
    if kind == "I":
        return "i8"
    return "tf32" if "TF32" in suffix else "f16"


def _ex2_under_mma(body: list[str]) -> tuple[float, int]:
    """(fraction of MUFU.EX2 issued while a warpgroup MMA group is in flight, the FMAs of the
    groups in flight then, averaged over those EX2s), from SASS order.

    A group opens at its first ``*GMMA`` and is committed by the one tagged ``gsb0``;
    ``WARPGROUP.DEPBAR.LE gsb0, N`` leaves the N most recent committed groups outstanding.
    The body is walked twice and the second pass counted, so a group issued at the end of
    an iteration (the next tile's Q.K^T, or a P.V not yet waited for) is in flight at the
    top of the next one.
    """
    committed: list[int] = []
    open_fma, under, ex2, fma = 0, 0, 0, 0
    for lap in range(2):
        for ins in body:
            op = _op(ins)[0]
            g = _GMMA.search(ins)
            if g:
                open_fma += int(g.group(2)) * int(g.group(3)) * int(g.group(4))
                if "gsb0" in ins:
                    committed, open_fma = committed + [open_fma], 0
            elif op.startswith("WARPGROUP.DEPBAR"):
                m = re.search(r"gsb0,\s*0x([0-9a-f]+)", ins)
                keep = int(m.group(1), 16) if m else 0
                committed = committed[len(committed) - keep:] if keep else []
            elif lap == 1 and op == "MUFU.EX2":
                ex2 += 1
                flying = sum(committed) + open_fma
                under += flying > 0
                fma += flying
    return (round(under / ex2, 3), round(fma / under)) if under else (0.0, 0)


def _mma_counts(body: list[str]) -> tuple[str, int, int, str, int]:
    """(shapes text, warpgroup-MMA FMAs, per-warp-MMA FMAs, input dtype, wgmma shared bytes)."""
    shapes: dict[str, int] = {}
    group_fma = warp_fma = smem = 0
    dtype = ""
    for ins in body:
        g = _GMMA.search(ins)
        w = None if g else _WMMA.search(ins)
        if g:
            kind, m, n, k, suffix, _dst, a = g.groups()
            m, n, k = int(m), int(n), int(k)
            dtype = _mma_dtype(kind, suffix)
            group_fma += m * n * k
            eb = _ELEM_BYTES[dtype]
            smem += n * k * eb + (m * k * eb if a.startswith("gdesc") else 0)
            name = f"{kind}GMMA {m}x{n}x{k}"
        elif w:
            kind, m, n, k, suffix = w.groups()
            m, n, k = int(m), int(n), int(k)
            dtype = _mma_dtype(kind, suffix)
            warp_fma += m * n * k
            name = f"{kind}MMA {m}x{n}x{k}"
        else:
            continue
        shapes[name] = shapes.get(name, 0) + 1
    text = ", ".join(f"{n} x{c}" for n, c in shapes.items())
    return text, group_fma, warp_fma, dtype, smem


def count_loop(body: list[str]) -> LoopCounts:
    """The counts of one loop iteration; ``body`` holds SASS instruction texts in address order."""
    shapes, group_fma, warp_fma, dtype, mma_smem = _mma_counts(body)
    ex2 = mufu = shared = tma = cta_bar = named_bar = arrives = waits = 0
    for ins in body:
        op, live = _op(ins)  # a never-true predicate (@!PT): issued, never executed
        if op.startswith("MUFU."):
            ex2 += op == "MUFU.EX2"
            mufu += op != "MUFU.EX2"
        elif live and op.split(".")[0] in ("LDS", "STS", "LDGSTS"):
            shared += LANES * _access_bytes(ins)
        elif live and op.split(".")[0] in ("LDSM", "STSM"):
            shared += {"4": 4, "2": 2}.get(op.rsplit(".", 1)[-1], 1) * 128  # 8x8 16-bit matrices
        elif op.startswith(("UTMALDG", "UBLKCP", "UTMASTG")):
            tma += 1
        elif op.startswith("BAR."):
            if re.search(r"\bBAR\.SYNC(\.DEFER_BLOCKING)?\s+0x0\s*;", ins):
                cta_bar += 1
            else:
                named_bar += 1
        elif op == "WARPGROUP.ARRIVE":
            arrives += 1
        elif op.startswith("WARPGROUP.DEPBAR"):
            waits += 1
    return LoopCounts(len(body), shapes, group_fma, warp_fma, dtype, mma_smem, ex2, mufu, shared, tma, cta_bar,
                      named_bar, arrives, waits, *_ex2_under_mma(body))


def tile_model(c: LoopCounts, target: str, num_warps: int, ctas_per_sm: int,
               tile_fma: int | None = None) -> TileModel | None:
    """The modelled SM time of one iteration with ``ctas_per_sm`` CTAs of ``num_warps`` warps.

    tensor cycles = resident MMA FMAs / the dense FMA rate; SFU = MUFU lanes / 16; issue =
    warp instructions / 4; shared = bytes / 128 (LDGSTS writes, LDS/STS/LDSM, wgmma operand
    reads). The exp2s overlap the tensor cores fully when other warps can run MMAs meanwhile
    (two or more CTAs per SM, or several warpgroups / warps per scheduler with no CTA
    barrier in the loop); up to the tensor cycles of this warpgroup's own MMA groups in
    flight during them when that covers at least half of them (``own MMA``); else not at
    all (``none``). ``tile = max(tc + exposed SFU cycles, sfu, issue, smem)``. ``tile_fma``:
    the FMAs of one tile's Q.K^T and P.V (for ``useful``). None when the loop has no
    tensor-core MMA.
    """
    if not c.mma_dtype or target not in GPUS:
        return None
    gpu = GPUS[target]
    ctas = max(1, ctas_per_sm)
    groups = max(1, num_warps // 4)
    tc = round(ctas * (groups * c.group_mma_fma + num_warps * c.warp_mma_fma) / gpu.fma_per_clk(c.mma_dtype))
    sfu = round(ctas * num_warps * LANES * (c.ex2 + c.mufu_other) / SFU_PER_CLK)
    issue = round(ctas * num_warps * c.instructions / ISSUE_PER_CLK)
    smem = round(ctas * (num_warps * c.shared_bytes + groups * c.mma_smem_bytes) / SMEM_BYTES_PER_CLK)
    parallel = groups if c.group_mma_fma else num_warps // ISSUE_PER_CLK  # MMA streams per CTA (per scheduler)
    exposed = sfu  # SFU cycles that add to the tensor time
    if ctas >= 2 or (parallel >= 2 and c.cta_barriers == 0):
        overlap, exposed = "other warps", 0
    elif c.ex2_under_mma >= 0.5:
        hidden = round(ctas * groups * c.ex2_mma_fma / gpu.fma_per_clk(c.mma_dtype))
        overlap, exposed = "own MMA", max(0, sfu - hidden)
    else:
        overlap = "none"
    terms = {"tc": tc, "sfu": sfu, "issue": issue, "smem": smem}
    if exposed:
        terms["tc+sfu"] = tc + exposed
    bound = max(terms, key=lambda k: (terms[k], k == "tc+sfu"))
    tile = terms[bound]
    useful = tc if tile_fma is None else round(ctas * tile_fma / gpu.fma_per_clk(c.mma_dtype))
    return TileModel(tc, sfu, issue, smem, overlap, tile, round(tile / tc, 3) if tc else 0.0,
                     round(useful / tile, 3) if tile else 0.0, bound, useful)
