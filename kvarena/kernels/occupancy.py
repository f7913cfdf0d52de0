"""CTAs per SM of each attention launch configuration, from its compiled registers and
shared memory: what the split heuristic sizes a wave with.

Launchers never compile or warm up a kernel to learn this: the table below is written
by ``kvarena check --perf --write-occupancy`` from ahead-of-time compiles (sm_80 and
sm_90a, every mask/flag variant of a configuration, keeping the fewest CTAs) and
``tests/test_check.py`` fails when it no longer matches what the compiler produces. A
configuration missing from the table counts as 1 CTA per SM, which can only make the
heuristic split less. Under the interpreter the launchers use the sm_90a entries, so
CPU tests pick the grids an H100/H200 would run.

The rule (CUDA occupancy for one kernel): registers are allocated per warp in units of
256 (``ceil(regs * 32 / 256) * 256``) from 65536 per SM; each CTA also reserves 1 KiB of
shared memory next to its own; at most 2048 threads and 32 CTAs per SM.
"""

from __future__ import annotations

__all__ = ["CTAS_PER_SM", "SMEM_PER_SM", "config_key", "ctas_per_sm", "occupancy"]

#: Shared memory per SM usable by CTAs: A100 164 KiB, H100/H200 228 KiB.
SMEM_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
_REGS_PER_SM = 65536
_THREADS_PER_SM = 2048
_MAX_CTAS = 32
_SMEM_RESERVED_PER_CTA = 1024


def occupancy(capability: int, registers: int, shared_bytes: int, num_warps: int) -> int:
    """CTAs of one kernel that fit on an SM (0 when one does not fit)."""
    threads = 32 * num_warps
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = _REGS_PER_SM // (regs_per_warp * num_warps)
    by_smem = SMEM_PER_SM[capability] // (shared_bytes + _SMEM_RESERVED_PER_CTA)
    return max(0, min(by_regs, by_smem, _THREADS_PER_SM // threads, _MAX_CTAS))


def config_key(capability: int, cfg: dict, elem_bytes: int) -> tuple:
    """The table key of a launch: target, tile, warps, stages and element size."""
    return (capability, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["HEAD_DIM_PAD"], cfg["num_warps"],
            cfg["num_stages"], elem_bytes)


def ctas_per_sm(capability: int, cfg: dict, elem_bytes: int) -> int:
    """CTAs per SM of a launch configuration (1 when the table does not know it)."""
    return CTAS_PER_SM.get(config_key(capability, cfg, elem_bytes), 1)


# (capability, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, num_warps, num_stages, elem_bytes) -> CTAs/SM
# Written by `kvarena check --perf --write-occupancy` (triton 3.9.0), plus by hand the keys
# that only Triton < 3.9 launches (paged_attention._older_triton_config:
# fp8 prefill on sm_90a with 32-key tiles), from triton 3.6.0 compiles: 1 CTA/SM each, the
# value a missing key gets, so a rewrite under 3.9 that drops them changes nothing. The
# short-context tile over 64-token pages ((cap, 16, 32, 128, 4, 3, 2), 2 CTAs/SM: the fp8
# variant's 200-208 registers) was added by hand from the `--perf` rows, the value the writer
# gives it. The D256 decode tile on sm_90a ((90, 16, 32, 256, 4, 5, 2)) went from 3 to 2 by hand
# when the page loop's interior loop took it to 178-200 registers (3.9 / 3.6).
CTAS_PER_SM: dict[tuple, int] = {
    (80, 16, 32, 128, 4, 3, 2): 2,
    (80, 16, 32, 128, 4, 5, 2): 2,
    (80, 16, 32, 128, 8, 2, 4): 2,
    (80, 16, 32, 256, 4, 5, 2): 2,
    (80, 16, 32, 256, 8, 2, 4): 1,
    (80, 16, 64, 128, 4, 2, 2): 1,
    (80, 16, 64, 128, 4, 3, 2): 2,
    (80, 16, 64, 128, 4, 5, 2): 2,
    (80, 32, 32, 256, 8, 2, 2): 1,
    (80, 32, 32, 256, 8, 3, 2): 1,
    (80, 64, 64, 128, 8, 2, 2): 1,
    (80, 128, 16, 128, 8, 2, 2): 1,
    (80, 128, 16, 128, 8, 3, 2): 1,
    (90, 16, 32, 128, 4, 3, 2): 2,
    (90, 16, 32, 128, 4, 5, 2): 2,
    (90, 16, 32, 128, 8, 2, 4): 2,
    (90, 16, 32, 256, 4, 5, 2): 2,
    (90, 16, 32, 256, 8, 2, 4): 1,
    (90, 16, 64, 128, 4, 2, 2): 1,
    (90, 16, 64, 128, 4, 3, 2): 2,
    (90, 16, 64, 128, 4, 5, 2): 2,
    (90, 32, 32, 256, 4, 2, 2): 2,
    (90, 32, 32, 256, 8, 2, 2): 1,
    (90, 64, 32, 256, 8, 2, 2): 1,
    (90, 64, 32, 256, 8, 3, 2): 1,
    (90, 64, 64, 128, 8, 2, 2): 1,
    (90, 128, 32, 256, 8, 3, 2): 1,
    (90, 128, 64, 128, 8, 2, 2): 1,
    (90, 128, 64, 128, 8, 3, 2): 1,
}
