"""Tile configurations of the attention kernel, per GPU architecture: read top to bottom.

A configuration is ``BLOCK_M`` query rows x ``BLOCK_N`` keys per tile, ``HEAD_DIM_PAD``,
warps, pipeline stages and a register cap. :func:`pick_config` is a pure function of the
target's :class:`~kvarena.kernels.arch.Arch` record and the launch's shape and flags;
``kvarena check --target NAME`` compiles exactly what it returns for each target and
proves each fits (no spills, shared memory within the record's per-block limit).

The families, by the target's matrix unit and shared memory:

* **wgmma** (sm_90a, 227 KiB): q in shared memory, 128-row chunk tiles, 3 K/V buffers in
  lean chunks. The tiles kvarena was first tuned on (bench/RESULTS.md).
* **tcgen05** (sm_100a, 227 KiB): the wgmma tiles, except where the accumulator in tensor
  memory and the bigger MMA shapes change the budget (:func:`_blackwell`).
* **mma.sync** with 163 KiB (sm_80): q in registers, 128 x 16 chunk tiles.
* **mma.sync** with 99 KiB (sm_86, sm_89, sm_120a): the sm_80 tiles at fewer stages or
  smaller tiles where 99 KiB does not hold them (:func:`_small_smem`).
* **mfma** (gfx942 with 64 KiB of LDS, gfx950 with 160 KiB): wave64, 256-VGPR budget per
  lane, LDS pipelining with 1-2 stages (:func:`_amd`).
"""

from __future__ import annotations

import re

import triton

from kvarena.kernels._common import head_dim_pad
from kvarena.kernels.arch import Arch

__all__ = ["older_triton_config", "path_config", "pick_config", "rope_config", "short_context_config"]

_MAXNREG = 255
# The installed Triton as (major, minor): older compilers get a few other configs
# (older_triton_config).
TRITON_VERSION = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])


def _make(d_pad: int, bm: int, bn: int, warps: int, stages: int, maxnreg: int | None = _MAXNREG) -> dict:
    # maxnreg = 255 (the hardware ceiling) stated explicitly for the tensor-core configs:
    # without it ptxas may cap a 256-thread program at 128 registers to fit a second one per
    # SM and spill 8-12 bytes (BLOCK_M = 32/64, GQA 5-7, sm_80). AMD ignores it.
    return dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM_PAD=d_pad, num_warps=warps, num_stages=stages, maxnreg=maxnreg)


def pick_config(arch: Arch, head_dim: int, group: int, elem_bytes: int, q_len_max: int | None, *,
                lean: bool = False, rope: bool = False, kv_fp8: bool = False, own: bool = False) -> dict:
    """Tile sizes, warps and stages of one attention launch on ``arch``.

    ``q_len_max=None`` means "any": the deterministic mode pins one config per (head_dim,
    group, dtype, GPU) so a sequence's rounding never depends on its batch. ``lean``: the
    launch compiles neither the non-finite guard nor softcap (the slab pool's chunks), which
    leaves room for another K/V buffer. ``kv_fp8`` (a float8 cache), ``own`` (a denoising
    step's own keys as a second key source) and ``rope`` (RoPE on read) are the variants
    whose registers or shared memory differ enough to take other tiles.

    Register budget (255 per thread on NVIDIA, no spills): the fp32 accumulator alone takes
    ``BLOCK_M * HEAD_DIM_PAD / (32 * num_warps)`` registers, the score tile ``BLOCK_M *
    BLOCK_N / (32 * num_warps)``; with mma.sync the q tile (the A operand) also lives in
    registers, where wgmma reads it from shared memory.
    """
    d_pad = head_dim_pad(head_dim)
    rows = None if q_len_max is None else max(1, q_len_max) * group
    if arch.mma == "mfma":
        cfg = _amd(d_pad, rows, elem_bytes, lean=lean, rope=rope, kv_fp8=kv_fp8)
    else:
        cfg = _nvidia(arch, d_pad, rows, elem_bytes, lean=lean, rope=rope, kv_fp8=kv_fp8, own=own)
        if own and kv_fp8 and (rows is None or rows > 64) and d_pad <= 128:
            cfg = own_over_fp8_config(cfg, arch)
        if rope:
            cfg = rope_config(cfg)
        if arch.smem_per_block < 128 * 1024:
            cfg = _small_smem(cfg, rows, elem_bytes, rope=rope)
        if arch.mma == "tcgen05":
            cfg = _blackwell(cfg, lean, elem_bytes, own=own)
        if TRITON_VERSION < (3, 9):
            cfg = older_triton_config(cfg, arch, lean=lean, kv_fp8=kv_fp8, own=own)
    return cfg


def _nvidia(arch: Arch, d_pad: int, rows: int | None, elem_bytes: int, *, lean: bool, rope: bool,
            kv_fp8: bool, own: bool) -> dict:
    """The sm_80 (mma.sync) and sm_90a (wgmma) tiles; sm_100a starts from the wgmma ones."""
    decode = rows is not None and rows <= 16
    wide_mma = arch.mma in ("wgmma", "tcgen05")  # q tile read from shared memory
    if elem_bytes >= 4:
        # fp32 dots are IEEE FMA loops with both operands in registers (no tensor cores).
        # ptxas is erratic here: left alone it capped 256 threads at 64 registers and spilt
        # 8 bytes in two sm_80 flag variants (causal + lse without kv_start), and a 255 cap
        # makes it fill the cap and spill. Found by sweeping every flag variant on both
        # targets and both Tritons: 16 x 32 over 8 warps, capped at 128 at D <= 128 (84-100
        # registers), uncapped at D = 256 (76-153; 32 x 16 spilt 4-32 bytes there once the
        # page loop's loads lost their key masks, whatever the cap); no spills.
        return _make(d_pad, 16, 32, 8, 2, maxnreg=128 if d_pad <= 128 else None)
    if decode:
        # Decode: 16 rows is the smallest MMA tile (a 32q/8kv step fills 4 of them).
        # Memory-bound, so what matters is bytes in flight: the block-id gather takes a
        # pipeline stage of its own, and 3 stages left ONE shared K/V buffer (the copy of
        # tile i+1 issued after tile i's P.V). 5 stages give two K/V buffers (ttgir
        # memdesc<2x...>): 71 KiB shared, 206-214 registers, still 2 programs per SM.
        return _make(d_pad, 16, 64 if d_pad <= 128 else 32, 4, 5)
    if d_pad >= 256:
        return _d256_config(d_pad, rows, wide_mma, lean=lean, rope=rope, kv_fp8=kv_fp8, own=own)
    if wide_mma and (rows is None or rows > 64):
        # Chunk / prefill on sm_90a: 128 x 128 accumulator over 8 warps = 64 registers;
        # K+V 32 KiB per stage + the 32 KiB q tile. Lean launches (no guard, no softcap:
        # the slab pool) take 3 stages = 3 K/V buffers in flight (128 KiB); the others
        # keep 2 (96 KiB), where a third spills.
        return _make(d_pad, 128, 64, 8, 3 if lean else 2)
    if rows is not None and rows > 64 and d_pad <= 128:
        # Chunks and prefill on sm_80: 128 x 16 over 8 warps. Triton 3.9 lays mma.sync warps
        # along M only when a chained dot's M >= N, i.e. BLOCK_M >= HEAD_DIM_PAD for P.V:
        # 64-row tiles get warpsPerCTA [1, 8] (every row max / sum crosses warps through
        # shared memory, the tutorial kernel too), 128 rows get [8, 1]. 128 x 64 and 128 x 32
        # spill with GQA 3-5 (q lives in registers here); 16-key tiles leave 186-255
        # registers, no spills, and lean launches a third stage = 2 K/V buffers (49-64 KiB).
        # Main loop 230-236 SASS per warp per 16-key tile, 1.04x the contiguous flash loop.
        return _make(d_pad, 128, 16, 8, 3 if lean else 2)
    # Short chunks (<= 64 rows) and the deterministic pin on sm_80: 64 x 64, 8 warps,
    # ~175-235 registers (4 warps spill 16-24 bytes there).
    return _make(d_pad, 64, 64, 8, 2)


def _d256_config(d_pad: int, rows: int | None, wide_mma: bool, *, lean: bool, rope: bool, kv_fp8: bool,
                 own: bool) -> dict:
    """Head dim 256 past decode.

    Swept with ``kvarena check`` under triton 3.6.0 and 3.9.0 over every flag variant (causal,
    kv_start, lse, softcap) with and without own keys, fp8 and RoPE (bench/RESULTS.md, issue
    25 item 3); each rule below is the fastest modelled tile without spills under both:

    * sm_90a, lean chunks (the slab pool's) with a bf16/fp16 history, no own keys, no RoPE:
      128 x 32 over 8 warps, 3 stages (3 K/V buffers, 160 KiB), 241-255 registers. Each
      warpgroup owns 64 query rows; 64 x 32 split the score columns across the two
      warpgroups, each re-reading q from shared memory per wgmma (smem-bound: the modelled
      tile 2.17x its tensor cycles; 1.28x here). Guarded 128 x 32 spills 112-288 B.
    * sm_90a, own keys (two more key loops): 128 x 32 spills 36-84 B under 3.9 and 64 x 32 at
      3 stages 16 B: 64 x 32 at 2 stages.
    * sm_90a, a float8 cache: every 64- and 128-row tile spills 32-600 B (the decoded K/V
      tiles beside the accumulator); 32 x 32 over 4 warps (236-239 registers), over 8 warps
      when guarded (4 warps spill 4 B there).
    * sm_90a, RoPE on read: 64 x 32 spills 12-264 B; 32 x 32 over 8 warps (230-254).
    * sm_80 (q in registers too): 32 x 32 over 8 warps, lean launches at 3 stages (2 K/V
      buffers, 82 KiB).
    * Guarded RoPE, or RoPE over an fp8 cache (both targets): 32 x 32 spills 4-460 B; 16 x 32
      over 8 warps (160-254).
    * Otherwise (short chunks of <= 64 rows, guarded or softcapped launches): 64 x 32.
    """
    stages = 3 if lean else 2
    if rope and (kv_fp8 or not lean):
        return _make(d_pad, 16, 32, 8, 2)
    if not wide_mma:
        return _make(d_pad, 32, 32, 8, stages)
    if kv_fp8:
        return _make(d_pad, 32, 32, 4 if lean else 8, 2)
    if rope:
        return _make(d_pad, 32, 32, 8, 2)
    if own:
        return _make(d_pad, 64, 32, 8, 2)
    if lean and (rows is None or rows > 64):
        return _make(d_pad, 128, 32, 8, 3)
    return _make(d_pad, 64, 32, 8, stages)


def older_triton_config(cfg: dict, arch: Arch, *, lean: bool, kv_fp8: bool, own: bool) -> dict:
    """The config of a launch under Triton < 3.9 where the newest's spills there.

    Measured with ``kvarena check`` under triton 3.6.0 (ptxas 12.8) and 3.9.0 (ptxas 12.9), D =
    128; every other config fits under both, and 3.9 keeps :func:`pick_config`'s:

    * guarded fp8 prefill on sm_90a (128 x 64, 2 stages, page path): 255 registers and 160 B
      spilled (3.9: 251, none); 32-key tiles: 240 (244 with softcap, sinks and kv_start).
    * own keys (two more pipelined loops after the history's) at 3 stages: MAGI 24q/8kv spills
      16 B on sm_90a and 8 B on sm_80 (groups 2-7 spill 16-20 B on sm_90a), Wan with an fp8
      history 4 B on each. 2 stages: MAGI 240 / 255 registers (sm_90a / sm_80), Wan fp8 248 /
      255, groups 4 and 7 239-255; one K/V buffer fewer.
    * lean D = 256 chunks on sm_100a (64 x 32, 2 stages): 16-20 B; 32 x 32 at 3 stages (117).
    * own keys over fp8 on sm_100a (128 x 32 at 2 stages, the unsplit Wan step): 60-120 B;
      128 x 16 (242-246).
    """
    if kv_fp8 and arch.mma in ("wgmma", "tcgen05") and cfg["BLOCK_M"] == 128 and not lean:
        cfg = dict(cfg, BLOCK_N=32)
    if own:
        cfg = dict(cfg, num_stages=min(cfg["num_stages"], 2))
    if own and kv_fp8 and arch.mma == "tcgen05" and cfg["BLOCK_M"] == 128 and cfg["HEAD_DIM_PAD"] <= 128:
        cfg = dict(cfg, BLOCK_N=16)
    if arch.mma == "tcgen05" and lean and not own and cfg["HEAD_DIM_PAD"] >= 256 and cfg["BLOCK_M"] == 64:
        cfg = dict(cfg, BLOCK_M=32, num_stages=3)
    return cfg


def own_over_fp8_config(cfg: dict, arch: Arch) -> dict:
    """A denoising step's own keys over an fp8 history (three key loops, the fp8 one
    widening in registers). The chunk tiles sit at 255 registers there and spill as soon as
    the flags change the code a little: the unsplit Wan launch (the Wan-14B grid) spilt
    12-36 B on sm_90a (128 x 64) and 284-360 B on sm_80 (128 x 16) under Triton 3.9, where
    the split form fitted, and 2 stages do not cure it (8 B on sm_90a, 272-308 B on sm_80).
    Half the keys per tile with wgmma / tcgen05 (128 x 32: 225-238 registers) and half the
    rows with mma.sync (64 x 16: 162-200) keep the stages and the 2 fp8 K/V buffers."""
    if arch.mma in ("wgmma", "tcgen05"):
        return dict(cfg, BLOCK_N=min(cfg["BLOCK_N"], 32))
    return dict(cfg, BLOCK_M=min(cfg["BLOCK_M"], 64))


def rope_config(cfg: dict) -> dict:
    """RoPE on read: each key tile also gathers its partner rows and two fp32 table tiles
    ``[D, BLOCK_N]``; pipelined over the plain config's stages those fill shared memory
    (245 KiB for decode at 5 stages, 256 KiB for chunks at 3). Two stages keep one tile's
    gathers in flight while the previous one computes."""
    return dict(cfg, num_stages=2)


def _small_smem(cfg: dict, rows: int | None, elem_bytes: int, *, rope: bool) -> dict:
    """sm_86, sm_89 and sm_120a: 99 KiB of shared memory per block, mma.sync; the sm_80 tiles
    except where they need more (``kvarena check --target sm_89``, Triton 3.9):

    * RoPE decode: 16 x 64 at 2 stages takes 132 KiB (the partner rows and the two fp32
      table tiles); 16 x 32 takes 68 KiB (16 x 16 at D = 256).
    * RoPE at D = 256 (32 x 32, 2 stages, 128 KiB): one stage, 34 KiB.
    * fp32 at D = 256 (16 x 32, 2 stages: 114 KiB guarded): 16-key tiles, 65 KiB.
    """
    d_pad = cfg["HEAD_DIM_PAD"]
    if rope and rows is not None and rows <= 16:
        return dict(cfg, BLOCK_N=32 if d_pad <= 128 else 16)
    if rope and d_pad >= 256:
        return dict(cfg, num_stages=1)
    if elem_bytes >= 4 and d_pad >= 256:
        return dict(cfg, BLOCK_N=16)
    return cfg


def _blackwell(cfg: dict, lean: bool, elem_bytes: int, *, own: bool) -> dict:
    """sm_100a: the wgmma tiles, except where ptxas for sm_100a spills them (Triton 3.9 emits
    mma.sync / wgmma-class code with 255 registers per thread there, and the bigger
    per-thread fragments of some tiles do not fit):

    * Lean chunks at D <= 128 (128 x 64, 3 stages): MAGI spills 48-60 B, the Wan step with
      own keys over fp8 96 B; 128 x 32 at the same stages fits (226-255 registers, 88-96 KiB;
      RoPE's 2 stages kept: its third spilt 4 B).
    * Lean chunks at D = 256 (128 x 32, 3 stages: 420 B spilled): 64 x 32 at 2 stages
      (239 registers); with own keys (64 x 32 spills 116 B) 32 x 32 at 2 stages.
    * fp32 tiles: capped at 128 registers at D <= 128 and at 255 at D = 256 (ptxas's own
      choice, 64, spilt 4-20 B; 128 spilt 8 B in the guarded D = 256 chunk).
    """
    d_pad = cfg["HEAD_DIM_PAD"]
    if elem_bytes >= 4:
        return dict(cfg, maxnreg=128 if d_pad <= 128 else _MAXNREG)
    if lean and cfg["BLOCK_M"] == 128 and d_pad <= 128:
        return dict(cfg, BLOCK_N=32)
    if d_pad >= 256 and cfg["BLOCK_M"] == 128:
        return dict(cfg, BLOCK_M=64, num_stages=2)
    if d_pad >= 256 and own and cfg["BLOCK_M"] == 64:
        return dict(cfg, BLOCK_M=32)
    return cfg


def _amd(d_pad: int, rows: int | None, elem_bytes: int, *, lean: bool, rope: bool, kv_fp8: bool) -> dict:
    """gfx942 (64 KiB LDS) and gfx950 (160 KiB): wave64, 4 waves per CTA (256 threads).

    A lane of a 4-wave CTA has 512 VGPRs (256 architected + 256 accumulation registers,
    which the MFMA results use; 8-wave CTAs get 256 in all and spill 48-800 B on these
    tiles), so the register budget is about twice an NVIDIA thread's, and LDS is the
    limit. The AMD pipeliner stages the K/V loads through LDS at 2 stages and through
    registers at 1. Swept with ``kvarena check --target gfx942 --target gfx950`` (Triton
    3.9), every rule free of VGPR spills and scratch on both:

    * Decode: 16 x 64 at 2 stages, 32-34 KiB of LDS (5 stages: 98 KiB, over gfx942's 64).
    * Chunks (> 64 rows) at D <= 128: 128 x 64, lean at 2 stages (32 KiB, 341-372 VGPRs),
      guarded or softcapped at 1. Lean chunks with an fp8 cache or RoPE take 32-key tiles:
      at 64 the Wan step with own keys spilt 60 B over fp8 (512 VGPRs), 5 B with RoPE.
    * Head dim 256: 64 x 32 at 1 stage; 32 x 32 over an fp8 cache, 16 x 32 with RoPE (32 x
      32 spilt 1 VGPR).
    * Short chunks and the deterministic pin: 64 x 64 at 1 stage.
    * fp32 (no MFMA for IEEE fp32 dots): 16 x 32 at 1 stage.
    """
    decode = rows is not None and rows <= 16
    if elem_bytes >= 4:
        return _make(d_pad, 16, 32, 4, 1, maxnreg=None)
    if decode:
        return _make(d_pad, 16, 64 if d_pad <= 128 else 32, 4, 2, maxnreg=None)
    if d_pad >= 256:
        return _make(d_pad, 16 if rope else 32 if kv_fp8 else 64, 32, 4, 1, maxnreg=None)
    if rows is None or rows <= 64:
        return _make(d_pad, 64, 64, 4, 1, maxnreg=None)
    if not lean:
        return _make(d_pad, 128, 64, 4, 1, maxnreg=None)
    return _make(d_pad, 128, 32 if (kv_fp8 or rope) else 64, 4, 2, maxnreg=None)


def path_config(cfg: dict, large: bool, arch: Arch, kv_fp8: bool = False) -> dict:
    """``cfg`` as the block path it runs on needs it: a decode tile (16 rows, 5 stages: the
    page loop's block-id gather takes a stage of its own) over large blocks takes 3 stages,
    which keep the two K/V buffers in flight (4 spilt 8-12 bytes at 255 registers). Over an
    fp8 cache on the 99 KiB mma.sync targets that tile spills 4 B at 255 registers (sm_89
    under Triton 3.9, sm_86 under 3.6): 32-key tiles (198-242 registers, still 2 buffers)."""
    if large and cfg["BLOCK_M"] == 16 and cfg["num_stages"] == 5:
        cfg = dict(cfg, num_stages=3)
        if kv_fp8 and arch.mma == "mma.sync" and arch.smem_per_block < 128 * 1024:
            cfg = dict(cfg, BLOCK_N=32)
    return cfg


def short_context_config(cfg: dict) -> dict:
    """The decode tile over 32-key tiles (item 2 of issue 25): at B = 1 and 1K-2K keys a
    64-key tile leaves too few tiles to fill a wave with one split per tile (1K keys, 8 kv
    heads: 8 x 16 programs = 0.49 of 264 slots); 32-key tiles double them."""
    return dict(cfg, BLOCK_N=32)
