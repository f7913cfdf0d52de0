"""CTAs per SM (CU) of each attention launch, from the compiled variant that launches:
what the split heuristic sizes a wave with.

Launchers never compile or warm up a kernel to learn this: the table below is written
by ``kvarena check --perf --write-occupancy`` from ahead-of-time compiles (every target of
:mod:`kvarena.kernels.arch`; each launch kind, its mask/flag variants keeping the fewest
CTAs) and ``tests/test_check.py`` fails when it no longer matches what the compiler
produces. The key holds the launch kind (``fp8``, ``rope``, ``own`` or ``plain``): an fp8
cache's decoded tiles or RoPE's tables take registers a bf16 launch of the same tile does
not, so each sizes its waves at its own occupancy. A key missing from the table counts as
1 CTA per SM, which can only make the heuristic split less. The rule per target is
:meth:`kvarena.kernels.arch.Arch.occupancy`.
"""

from __future__ import annotations

from kvarena.kernels.arch import Arch

__all__ = ["CTAS_PER_SM", "config_key", "ctas_per_sm", "launch_kind"]


def launch_kind(*, kv_fp8: bool, rope: bool, own: bool) -> str:
    """The occupancy table's name of a launch's variant."""
    kind = "+".join(name for name, on in (("own", own), ("fp8", kv_fp8), ("rope", rope)) if on)
    return kind or "plain"


def config_key(arch: Arch | str, cfg: dict, elem_bytes: int, kind: str = "plain") -> tuple:
    """The table key of a launch: target, tile, warps, stages, element size and kind."""
    name = arch if isinstance(arch, str) else arch.name
    return (name, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["HEAD_DIM_PAD"], cfg["num_warps"], cfg["num_stages"],
            elem_bytes, kind)


def ctas_per_sm(arch: Arch | str, cfg: dict, elem_bytes: int, kind: str = "plain") -> int:
    """CTAs per SM of a launch (1 when the table does not know it)."""
    return CTAS_PER_SM.get(config_key(arch, cfg, elem_bytes, kind), 1)


# (target, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, num_warps, num_stages, elem_bytes, kind) -> CTAs/SM
# Written by `kvarena check --perf --write-occupancy`.
CTAS_PER_SM: dict[tuple, int] = {
}
