"""The GPU architectures kvarena plans launches for: one record per target.

Every launch decision that depends on the GPU (tile sizes, pipeline stages, occupancy,
the native fp8 path, the SM count a wave is sized with) reads an :class:`Arch`; nothing
compares compute capabilities. The records hold the per-target limits the configurations
were checked against (``kvarena check --target NAME`` compiles each launch for NAME with
no GPU, and its spill and shared-memory columns are the proof).

Where the record comes from:

* on a GPU, from the device (:func:`arch_for_device`): the CUDA capability, or on ROCm the
  ``gcnArchName`` of ``torch.cuda.get_device_properties``; its SM/CU count is the device's.
  An unknown device gets the closest conservative record and one warning, never an error;
* under the Triton interpreter (CPU), from ``KVARENA_ARCH`` (default ``sm_90a``), so a test
  or a census on a CPU sees what that GPU would launch (:func:`interpreter_arch`).

Importing this module imports neither torch nor triton (``kvarena check`` reads it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass

__all__ = ["ARCHS", "ARCH_ENV", "DEFAULT_ARCH", "Arch", "arch_for_device", "arch_named", "interpreter_arch",
           "launch_arch"]

#: The environment variable that names the target under the interpreter.
ARCH_ENV = "KVARENA_ARCH"
DEFAULT_ARCH = "sm_90a"

KIB = 1024


@dataclass(frozen=True)
class Arch:
    """One GPU target: its limits, its matrix unit and its native fp8 formats.

    ``smem_per_block`` is the most dynamic shared memory (LDS on AMD) one CTA may use;
    ``smem_per_sm`` what all CTAs of an SM (CU) share. ``regs_per_sm``: 32-bit registers per
    SM on NVIDIA; on AMD the VGPRs of one SIMD lane (a wave's registers live in one SIMD,
    four SIMDs per CU). ``sm_count`` sizes waves when no device is there to ask.
    """

    name: str  # "sm_90a", "gfx942": what KVARENA_ARCH and `kvarena check --target` take
    backend: str  # "cuda" or "hip"
    target: int | str  # Triton's GPUTarget arch: 90, "gfx942"
    gpus: str  # the GPUs of this target, for people
    warp_size: int
    smem_per_block: int
    smem_per_sm: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_ctas_per_sm: int
    sm_count: int
    mma: str  # "mma.sync" (sm_80..sm_89, sm_120a), "wgmma" (sm_90a), "tcgen05" (sm_100a), "mfma" (AMD)
    fp8_formats: tuple[str, ...] = ()  # torch float8 dtypes the hardware widens natively

    @property
    def is_amd(self) -> bool:
        return self.backend == "hip"

    def fp8_native(self, dtype_name: str = "float8_e4m3fn") -> bool:
        """Whether a cache of this float8 dtype loads as Triton's fp8 and is widened by the
        hardware (else its bytes are decoded in registers, which any target can run)."""
        return dtype_name in self.fp8_formats

    def gpu_target(self):
        """Triton's ``GPUTarget`` of this record (imports triton)."""
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.target, self.warp_size)

    def occupancy(self, registers: int, shared_bytes: int, num_warps: int) -> int:
        """CTAs of one kernel that fit on an SM (CU), 0 when one does not fit.

        NVIDIA: registers are allocated per warp in units of 256 (``ceil(regs * 32 / 256) *
        256``) from ``regs_per_sm``; each CTA also reserves 1 KiB of shared memory. AMD: a
        wave's VGPRs are allocated in granules of 8 from the 512 of a SIMD lane, at most 8
        waves per SIMD, four SIMDs per CU; no reserved LDS.
        """
        if shared_bytes > self.smem_per_block:
            return 0
        if self.is_amd:
            vgprs = -(-max(registers, 1) // 8) * 8
            waves_per_simd = min(8, self.regs_per_sm // vgprs)
            by_regs = 4 * waves_per_simd // num_warps
            by_smem = self.smem_per_sm // shared_bytes if shared_bytes else self.max_ctas_per_sm
        else:
            regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
            by_regs = self.regs_per_sm // (regs_per_warp * num_warps)
            by_smem = self.smem_per_sm // (shared_bytes + KIB)
        threads = self.warp_size * num_warps
        return max(0, min(by_regs, by_smem, self.max_threads_per_sm // threads, self.max_ctas_per_sm))


_OCP_FP8 = ("float8_e4m3fn", "float8_e5m2")

#: The eight targets, in the order `kvarena check` prints them.
ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("sm_80", "cuda", 80, "A100, A800, A30", 32, 163 * KIB, 164 * KIB, 65536, 2048, 32, 108, "mma.sync"),
    Arch("sm_86", "cuda", 86, "RTX 3090, RTX A6000, A40, A10", 32, 99 * KIB, 100 * KIB, 65536, 1536, 16, 84,
         "mma.sync"),
    Arch("sm_89", "cuda", 89, "RTX 4090, L40S, L4", 32, 99 * KIB, 100 * KIB, 65536, 1536, 24, 128, "mma.sync",
         _OCP_FP8),
    Arch("sm_90a", "cuda", 90, "H100, H200, H20", 32, 227 * KIB, 228 * KIB, 65536, 2048, 32, 132, "wgmma",
         _OCP_FP8),
    Arch("sm_100a", "cuda", 100, "B200, GB200", 32, 227 * KIB, 228 * KIB, 65536, 2048, 32, 148, "tcgen05",
         _OCP_FP8),
    Arch("sm_120a", "cuda", 120, "RTX 5090, RTX PRO 6000", 32, 99 * KIB, 100 * KIB, 65536, 1536, 32, 170,
         "mma.sync", _OCP_FP8),
    Arch("gfx942", "hip", "gfx942", "MI300X, MI325X", 64, 64 * KIB, 64 * KIB, 512, 2048, 32, 304, "mfma",
         ("float8_e4m3fnuz", "float8_e5m2fnuz")),
    Arch("gfx950", "hip", "gfx950", "MI350X, MI355X", 64, 160 * KIB, 160 * KIB, 512, 2048, 32, 256, "mfma",
         _OCP_FP8),
)}

# CUDA (major, minor) -> record. Capabilities of one family share the conservative record.
_CUDA = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 7): "sm_86", (8, 9): "sm_89", (9, 0): "sm_90a",
         (10, 0): "sm_100a", (10, 3): "sm_100a", (12, 0): "sm_120a", (12, 1): "sm_120a"}


def arch_named(name: str) -> Arch:
    """The record called ``name``; a ValueError listing the known names otherwise."""
    if name not in ARCHS:
        raise ValueError(f"unknown GPU architecture {name!r}: expected one of {', '.join(ARCHS)}")
    return ARCHS[name]


def interpreter_arch() -> Arch:
    """The record the launchers plan for under the interpreter: ``KVARENA_ARCH`` (default
    ``sm_90a``). Read per call, so a test may set it; an unknown name is a ValueError."""
    name = os.environ.get(ARCH_ENV, "").strip() or DEFAULT_ARCH
    try:
        return arch_named(name)
    except ValueError as exc:
        raise ValueError(f"{ARCH_ENV}={name!r}: {exc}") from None


def _closest_cuda(major: int, minor: int) -> str:
    """The conservative record for a capability kvarena has no record of: the newest known
    one below it with at most 99 KiB of shared memory per block and mma.sync (what every
    CUDA GPU since sm_80 runs), or sm_90a/sm_100a for later minors of those majors."""
    if major == 9:
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    return "sm_86"


@functools.lru_cache(maxsize=16)
def _record(key: tuple) -> Arch:
    """The record of a device key (memoized: one warning per unknown device)."""
    kind, ident, sm_count = key
    if kind == "hip":
        base = ident.split(":")[0]
        name = base if base in ARCHS and ARCHS[base].is_amd else None
        closest = "gfx942"
    else:
        name = _CUDA.get(ident)
        closest = _closest_cuda(*ident)
    if name is None:
        name = closest
        warnings.warn(f"kvarena: no launch plans for GPU {ident!r}; planning for the closest conservative "
                      f"record, {closest} ({ARCHS[closest].gpus}). Set nothing: this warning is printed once.",
                      RuntimeWarning, stacklevel=3)
    arch = ARCHS[name]
    return dataclasses.replace(arch, sm_count=sm_count) if sm_count else arch


def arch_for_device(device_index: int | None) -> Arch:
    """The record of CUDA/ROCm device ``device_index`` (None: the interpreter's,
    :func:`interpreter_arch`), read from its properties (the launchers memoize it per device)."""
    if device_index is None:
        return interpreter_arch()
    import torch

    props = torch.cuda.get_device_properties(device_index)
    if getattr(torch.version, "hip", None):
        key = ("hip", getattr(props, "gcnArchName", ""), props.multi_processor_count)
    else:
        key = ("cuda", (props.major, props.minor), props.multi_processor_count)
    return _record(key)


def launch_arch(t) -> Arch:
    """The record a launch on tensor ``t``'s device plans for: a CUDA/ROCm device's, read
    from its properties once per device (launches run per layer), or on CPU the
    interpreter's (``KVARENA_ARCH``, read per launch so a test may set it)."""
    if t.device.type != "cuda":
        return interpreter_arch()
    index = t.device.index
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return _device_arch(index)


@functools.lru_cache(maxsize=16)
def _device_arch(device_index: int) -> Arch:
    return arch_for_device(device_index)
