"""The forward attention's launch plan: (target, spec, shapes) -> one :class:`AttentionLaunch`.

Host values only (no tensor data, no compile, no device read): the tile config
(:mod:`attn_configs`), the path (large blocks or pages), the split-KV count, the kernel's
constexprs and which of its optional pointers the launch passes. The launcher
(:mod:`paged_attention`), ``kvarena check`` and the tests read the plan; nothing re-derives it.
Whether a launch can take the step's own keys beside the history is the pure predicate
:func:`takes_own_keys`: a caller asks it before launching, and attends to them separately
(two launches, merged) when it says no.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import triton

from kvarena.kernels._common import I32_MAX, LOG2E, interpreting
from kvarena.kernels.arch import DEFAULT_ARCH, Arch, arch_named
from kvarena.kernels.attn_configs import path_config as _path_config
from kvarena.kernels.attn_configs import pick_config
from kvarena.kernels.attn_configs import short_context_config as _short_context_config
from kvarena.kernels.occupancy import ctas_per_sm, launch_kind

# ----------------------------------------------------------------------------- constants

# Split-KV: from 1K keys on each split covers at least 32 keys (and one key tile), so that
# B = 1 fills a wave; the per-split fixed cost (q tile load, epilogue, 2 * D * 4 bytes of
# fp32 partial per row, read back by the reduce) is then the price of SMs not left idle.
# Shorter contexts split only into splits of at least 256 keys: there the fixed cost is
# not worth it (and the interpreter lane keeps its tiny cases' grids small).
_FULL_WAVE_MIN_KEYS = 1024
_FULL_WAVE_SPLIT_KEYS = 32
_MIN_SPLIT_KEYS = 256
# At most 64 splits: 132 SMs are filled by 64 splits of just 3 programs (e.g. B = 1, 3 kv
# heads); the fp32 scratch then holds 64 partial rows per query row.
_MAX_SPLITS = 64
# Split when the grid's last wave leaves more than 10% of the CTA slots idle.
_TARGET_WAVE_EFFICIENCY = 0.9
# Deterministic mode: fixed 4096 keys per split, whatever the batch, so a sequence's
# result never depends on which other sequences share the launch. 4096 keys keep the
# scratch at 1/16 of K/V bytes per query row at D = 128 ... and 32 splits at 128K keys.
_DET_SPLIT_KEYS = 4096
# The window passed for "no sliding window", and the cap of any window: row_lo = p - 2**30
# stays in int32 for every position p of a row, negative ones included (a row with more
# queries than keys, e.g. seq_len-0 padding), where p - (2**31 - 1) would wrap. A window of
# 2**30 keys or more selects every key of any sequence shorter than 2**30 tokens.
_NO_WINDOW = 1 << 30


def _pick_config(head_dim: int, group: int, elem_bytes: int, q_len_max: int | None, arch: Arch | str = DEFAULT_ARCH,
                 *, lean: bool = False, rope: bool = False, kv_fp8: bool = False, own: bool = False) -> dict:
    """:func:`kvarena.kernels.attn_configs.pick_config` on ``arch`` (a record or its name).
    The launch plan calls it through this module's global, so a test can pin a tile."""
    if isinstance(arch, str):
        arch = arch_named(arch)
    return pick_config(arch, head_dim, group, elem_bytes, q_len_max, lean=lean, rope=rope, kv_fp8=kv_fp8, own=own)


def _key_tiles(max_seqlen_k: int, block_n: int, has_sinks: bool) -> int:
    """Most key tiles one program visits on the page path: the sink and window phases may
    share a tile."""
    return triton.cdiv(max(max_seqlen_k, 1), block_n) + (1 if has_sinks else 0)


def _wants_short_tiles(cfg: dict, programs: int, max_seqlen_k: int, has_sinks: bool, sm_count: int,
                       ctas: int) -> bool:
    """Whether a decode launch (16-row tile over 64-key tiles) from 1K keys on cannot reach
    the target wave efficiency even at one split per key tile, so that 32-key tiles would."""
    if cfg["BLOCK_M"] != 16 or cfg["BLOCK_N"] != 64 or max_seqlen_k < _FULL_WAVE_MIN_KEYS:
        return False
    wave = sm_count * max(1, ctas)
    return programs * _key_tiles(max_seqlen_k, cfg["BLOCK_N"], has_sinks) < _TARGET_WAVE_EFFICIENCY * wave


def _pick_num_splits(programs: int, max_seqlen_k: int, sm_count: int, ctas: int = 1, tiles: int | None = None) -> int:
    """Split-KV count for an unsplit grid of ``programs`` (= B * H_kv * q tiles).

    A wave is ``sm_count * ctas`` programs, the CTAs per SM that the compiled
    kernel's registers and shared memory allow (``kvarena.kernels.occupancy``). Each split
    count s gives ``w = programs * s / wave`` waves with efficiency ``w / ceil(w)``. At most
    64 splits, ``tiles`` (the key tiles of the longest sequence) and one per 32 keys from 1K
    keys on (one per 256 keys below). An unsplit grid under one wave takes
    ``floor(wave / programs)`` splits, one full wave (as FA4's ``min(SMs / q-blocks, 128,
    kv-blocks)``), when that reaches 0.9; otherwise s = 1
    when it is already >= 0.9, else the smallest s that reaches 0.9 (else the best). A split
    costs an fp32 partial write and a reduce launch, small next to an idle tail. Examples on
    132 SMs at 2 CTAs/SM (decode, 8 kv heads, 64-key tiles): B=1 at 128K or 4K -> 8 programs
    -> 33 splits (1.0 of a wave), at 2K -> 32 (0.97, one per tile); B=16 -> 128 programs ->
    2 splits (0.97); B=64 -> 512 programs -> 1 (1.94 waves, 0.97). Wan-1.3B chunks at 1
    CTA/SM: 444 programs = 3.36 waves (0.84) -> 2 splits (6.73 waves, 0.96).
    """
    if programs <= 0:
        return 1
    wave = max(1, sm_count * max(1, ctas))
    per_split = _FULL_WAVE_SPLIT_KEYS if max_seqlen_k >= _FULL_WAVE_MIN_KEYS else _MIN_SPLIT_KEYS
    s_max = max(1, min(_MAX_SPLITS, max_seqlen_k // per_split, tiles if tiles is not None else _MAX_SPLITS))

    def efficiency(s: int) -> float:
        waves = programs * s / wave
        return waves / math.ceil(waves)

    full = min(s_max, wave // programs)
    if full > 1 and efficiency(full) >= _TARGET_WAVE_EFFICIENCY:
        return full
    if efficiency(1) >= _TARGET_WAVE_EFFICIENCY:
        return 1
    best = 1
    for s in range(2, s_max + 1):
        if efficiency(s) >= _TARGET_WAVE_EFFICIENCY:
            return s
        if efficiency(s) > efficiency(best):
            best = s
    return best


# ----------------------------------------------------------------------------- pointers

#: The kernel's optional pointers (the others are read by every launch).
OPTIONAL_POINTERS = frozenset({"lse_ptr", "kv_start_ptr", "own_k_ptr", "own_v_ptr", "sink_ptr", "ks_ptr", "vs_ptr",
                               "cos_ptr", "sin_ptr", "qpos_ptr", "kshift_ptr"})
#: The kernel's flags that only say "this pointer is given": each is derived from whether the
#: launch passes its pointer (:func:`_attn_constexprs`), never passed on its own.
POINTER_FLAGS = {"HAS_KV_START": "kv_start_ptr", "WRITE_LSE": "lse_ptr", "HAS_OWN": "own_k_ptr",
                 "ROPE_Q_POS": "qpos_ptr", "ROPE_K_SHIFT": "kshift_ptr"}


def _pointers_given(shape: LaunchShape, spec, own: bool, split: bool) -> frozenset[str]:
    """The optional pointers a launch passes (the rest go as None, constexprs): the call's
    operands the plan reads. A split launch writes its lse partials whatever the caller asked,
    and leaves the learned sink to the reduce."""
    rope = bool(spec.rope_mode)
    return _given(shape.has_kv_start, shape.write_lse or split, own, spec.sink_logits is not None and not split,
                  shape.kv_fp8, rope, shape.rope_q_pos and rope, shape.rope_k_shift and rope)


@functools.lru_cache(maxsize=128)
def _given(kv_start: bool, lse: bool, own: bool, sink: bool, fp8: bool, rope: bool, rope_q_pos: bool,
           rope_k_shift: bool) -> frozenset[str]:
    read = {
        "lse_ptr": lse, "kv_start_ptr": kv_start, "own_k_ptr": own, "own_v_ptr": own, "sink_ptr": sink,
        "ks_ptr": fp8, "vs_ptr": fp8, "cos_ptr": rope, "sin_ptr": rope, "qpos_ptr": rope_q_pos,
        "kshift_ptr": rope_k_shift,
    }
    return frozenset(name for name, on in read.items() if on)


def _attn_constexprs(cfg: dict, group: int, head_dim: int, *, given: frozenset[str], causal: bool, split: bool,
                     upcast: bool, guard: bool, softcap: bool, block_size: int, elem_bytes: int,
                     large_ok: bool = True, sink_logits: bool = False, kv_fp8: bool = False, arch: Arch,
                     rope: int = 0, wide_offsets: bool = False, same_kv_strides: bool = True,
                     wide_rows: bool = False) -> dict:
    """The constexpr arguments of ``_paged_attn_kernel`` (shared with ``kvarena check``).

    ``given``: the optional pointers the launch passes (:func:`_pointers_given`); the flags
    of :data:`POINTER_FLAGS` are read off it.

    The block layout is specialized three ways: blocks of at least ``BLOCK_N`` rows
    (slabs) take the two-block contiguous path; smaller power-of-two pages pass their size
    as ``PAGE_SIZE`` (shifts, not divides); other page sizes divide at run time. The page
    path addresses keys with int32 offsets unless ``wide_offsets`` (a cache spanning more
    than 2**31 elements, :func:`_cache_addressing`: then a 64-bit block pointer per key and int32
    row offsets), and computes one offset per key for K and V when ``same_kv_strides``.
    Blocks whose own rows span 2**31 elements (``wide_rows``) take the run-time divide with
    64-bit rows. ``PAGE_INTERIOR``: the page path runs the tiles every row sees whole in an
    unmasked loop of their own.
    """
    large = _use_large_blocks(block_size, cfg["BLOCK_N"], large_ok, guard, elem_bytes)
    # The constexpr page path keeps a key's row offset in its block int32: blocks whose rows
    # span 2**31 elements (``wide_rows``) divide at run time, with 64-bit rows.
    page = block_size if not large and not wide_rows and block_size & (block_size - 1) == 0 else 0
    # The page loop's unmasked interior loop is a second copy of the loop body. It spills
    # with RoPE on read (96 B, decode on sm_80) and past the decode tile at head dim 256
    # (8 B for a guarded 64 x 32 chunk on sm_90a; 40 B for fp32 under Triton 3.6): those
    # launches run every tile through the masked loop.
    d256_ok = cfg["BLOCK_M"] <= 16 and elem_bytes < 4
    interior = not large and rope == 0 and (cfg["HEAD_DIM_PAD"] <= 128 or d256_ok)
    flag = {name: ptr in given for name, ptr in POINTER_FLAGS.items()}
    return dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, HAS_KV_START=flag["HAS_KV_START"], WRITE_LSE=flag["WRITE_LSE"],
        SPLIT=split, UPCAST=upcast, GUARD_NONFINITE=guard, HAS_SOFTCAP=softcap, PAGE_SIZE=page,
        WIDE_OFFSETS=wide_offsets, SAME_KV_STRIDES=same_kv_strides,
        LARGE_BLOCKS=large, HAS_OWN=flag["HAS_OWN"], HAS_SINK_LOGITS=sink_logits, KV_FP8=kv_fp8,
        FP8_NATIVE=kv_fp8 and fp8_native(arch), ROPE=rope, ROPE_Q_POS=flag["ROPE_Q_POS"],
        ROPE_K_SHIFT=flag["ROPE_K_SHIFT"], PAGE_INTERIOR=interior,
    )


@dataclass(frozen=True)
class CacheAddressing:
    """How the page path addresses a K/V cache pair (host values: shapes and strides)."""

    wide_offsets: bool  # some key's offset from its head's base passes int32
    same_kv_strides: bool  # K and V (and their fp8 scales) share block and token strides: one offset per key
    wide_rows: bool = False  # a block's rows alone span 2**31 elements (its row offsets pass int32)


def _span(shape: tuple, stride: tuple) -> int:
    """Largest element offset within one head of a ``[blocks, block_size, H, D]`` cache view,
    plus one."""
    return (shape[0] - 1) * stride[0] + (shape[1] - 1) * stride[1] + (shape[3] - 1) * stride[3] + 1


def _cache_addressing(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales=None) -> CacheAddressing:
    """:class:`CacheAddressing` of a cache pair and its fp8 scales (``[blocks, block_size, H]``
    or 0-dim; they span fewer elements than their K). Memoized on shapes and strides: it
    runs per launch."""
    sc = (kv_scales[0].stride()[:2], kv_scales[1].stride()[:2]) if kv_scales is not None else ((), ())
    return _addressing(k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(), sc[0] == sc[1])


@functools.lru_cache(maxsize=64)
def _addressing(k_shape: tuple, k_stride: tuple, v_shape: tuple, v_stride: tuple,
                same_scale_strides: bool) -> CacheAddressing:
    return CacheAddressing(
        wide_offsets=max(_span(k_shape, k_stride), _span(v_shape, v_stride)) > I32_MAX,
        same_kv_strides=k_stride[:2] == v_stride[:2] and same_scale_strides,
        wide_rows=k_shape[1] * max(k_stride[1], v_stride[1]) >= I32_MAX,
    )


def fp8_native(arch: Arch) -> bool:
    """Whether float8_e4m3fn K/V are loaded as Triton's float8e4nv and widened by the hardware
    (targets with OCP fp8: sm_89+, gfx950) rather than decoded from uint8 (sm_80, sm_86,
    gfx942, whose native fp8 is e4m3fnuz: the decode serves OCP e4m3fn caches there). The interpreter takes the decode too: its own
    widening reads the NaN byte 0x7F as 480, where the GPU's conversion and the decode give
    NaN (the native path runs there in tests that monkeypatch this, on finite data)."""
    return arch.fp8_native("float8_e4m3fn") and not interpreting()


def _use_large_blocks(block_size: int, block_n: int, large_ok: bool, guard: bool, elem_bytes: int) -> bool:
    """Whether a launch takes the contiguous large-block path.

    Blocks of at least one key tile (slabs, big pages) of fp16/bf16 qualify, unless the
    non-finite guard is compiled in: on this path it spills (8-20 bytes at 128 x 64 on
    sm_90a, since the sanitized V takes a register round trip in a loop that already holds
    ~234 registers), so guarded launches (multi-row tiles with causal or window masks) keep
    the page path. fp32 (IEEE FMA dots, no tensor cores, not a speed target) keeps it too:
    its D = 256 tile spilt 32-36 bytes here.
    """
    return large_ok and block_size >= block_n and not guard and elem_bytes < 4


def _needs_guard(max_seqlen_q: int, causal: bool, window_left: int | None) -> bool:
    """Whether rows of one tile can see different keys of one key tile.

    Only then can an invisible key share a tile with a visible one for some row and leak
    a non-finite value through ``0 * NaN``. With one query position per sequence
    (decode) every row of a tile sees the same keys, and the tile-level key range masks
    the loads exactly; without causal masks or a window (the slab pool) every row sees
    every loaded key. The guard costs registers and a V register round trip on boundary
    tiles, so it is compiled in only where it can matter.
    """
    return max_seqlen_q > 1 and (causal or window_left is not None)


@dataclass(frozen=True)
class LaunchPlan:
    """What one attention launch runs: tile config, grid and split (pure host data)."""

    cfg: dict
    num_q_tiles: int
    programs: int  # unsplit grid: q tiles x sequences x kv heads
    num_splits: int
    tiles_per_split: int
    ctas_per_sm: int
    guard: bool
    large_ok: bool
    own: bool  # the step's own keys are a second key source of this launch
    arch: Arch  # the target it was planned for (its SM count sizes the waves)

    def wave_efficiency(self) -> float:
        """CTAs / (ceil(waves) x SMs x CTAs per SM) of the split grid."""
        ctas = self.programs * self.num_splits
        slots = self.arch.sm_count * max(1, self.ctas_per_sm)
        return ctas / (math.ceil(ctas / slots) * slots)


def plan_launch(*, head_dim: int, group: int, elem_bytes: int, num_seqs: int, num_kv_heads: int,
                max_seqlen_q: int, max_seqlen_k: int, block_size: int, causal: bool, window_left, sink_tokens: int,
                softcap: bool, num_splits, deterministic: bool, arch: Arch | str = DEFAULT_ARCH,
                large_ok: bool = True, own_len: int = 0, rope: bool = False, kv_fp8: bool = False) -> LaunchPlan:
    """The launch a call gets, from host values only (no tensor, no compile, no device read).

    The launcher runs it for every call; ``kvarena check --perf`` runs it for the
    contract's workloads to report grids and waves, per target. ``arch`` is the target's
    record (or its name): on a GPU the device's, under the interpreter ``KVARENA_ARCH``'s
    (default sm_90a), so CPU tests get the grid that GPU would run.

    ``own_len > 0`` asks for a second key source of ``own_len`` rows per sequence (a
    denoising step's own keys, every query sees them): ``plan.own`` says whether this
    launch can take it (the large-block path, no causal mask, no window); else the caller
    attends to it in a launch of its own and merges.
    """
    if isinstance(arch, str):
        arch = arch_named(arch)
    sm_count = arch.sm_count
    guard = _needs_guard(max_seqlen_q, causal, window_left)
    # The deterministic pin ignores the batch: its config must not depend on max_seqlen_q,
    # and neither may its path (the guard, which depends on the batch's query lengths, keeps
    # a launch off the large-block path, whose tiles start at block starts): page path only.
    lean = not deterministic and not guard and not softcap
    large_ok = large_ok and not deterministic
    # own: the config of a launch that may take the own keys (the tile decides the path).
    own_ok = own_len > 0 and not causal and window_left is None
    cfg = _pick_config(head_dim, group, elem_bytes, None if deterministic else max_seqlen_q, arch, lean=lean,
                       rope=rope, kv_fp8=kv_fp8, own=own_ok)
    num_q_tiles = triton.cdiv(max_seqlen_q * group, cfg["BLOCK_M"])
    programs = num_q_tiles * num_seqs * num_kv_heads
    has_sinks = window_left is not None and sink_tokens > 0
    if num_splits is None and not deterministic and not rope and _wants_short_tiles(
            cfg, programs, max_seqlen_k, has_sinks, sm_count,
            ctas_per_sm(arch, cfg, elem_bytes, launch_kind(kv_fp8=kv_fp8, rope=rope, own=False))):
        cfg = _short_context_config(cfg)
    block_n = cfg["BLOCK_N"]
    # On the large-block path tiles restart at every block start (below).
    max_tiles = _key_tiles(max_seqlen_k, block_n, has_sinks)
    large = _use_large_blocks(block_size, block_n, large_ok, guard, elem_bytes)
    cfg = _path_config(cfg, large, arch, kv_fp8)
    if large:
        max_tiles = (triton.cdiv(max(max_seqlen_k, 1), block_size) + 1) * triton.cdiv(block_size, block_n)
    own = own_len > 0 and large and not causal and window_left is None
    if own:
        max_tiles += triton.cdiv(own_len, block_n)
        max_seqlen_k += own_len
    ctas = ctas_per_sm(arch, cfg, elem_bytes, launch_kind(kv_fp8=kv_fp8, rope=rope, own=own))
    tiles_per_split = 0  # 0: each program divides its own key tiles evenly over the splits
    if deterministic and num_splits != 1:
        # Fixed 4096 keys per split whatever the batch (an explicit count other than 1,
        # which would make the split size depend on max_seqlen_k, is not honoured).
        tiles_per_split = max(1, _DET_SPLIT_KEYS // block_n)
        num_splits = triton.cdiv(max_tiles, tiles_per_split)
    elif num_splits is None:
        num_splits = _pick_num_splits(programs, max_seqlen_k, sm_count, ctas, max_tiles)
    # More splits than key tiles would only add empty partials; 65535 is grid axis 1's cap.
    num_splits = max(1, min(num_splits, max_tiles, 65535))
    return LaunchPlan(cfg, num_q_tiles, programs, num_splits, tiles_per_split, ctas, guard, large_ok, own, arch)


@dataclass(frozen=True)
class LaunchShape:
    """The host values an attention launch is planned from: shapes and which optional
    operands it reads (no tensor; :func:`launch_shape` reads them off the call's tensors)."""

    head_dim: int
    group: int  # query heads per kv head
    elem_bytes: int  # of q (the dots' dtype)
    num_seqs: int
    num_kv_heads: int
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    own_len: int | None = None  # the step's own keys per sequence (None: none)
    has_kv_start: bool = False
    write_lse: bool = False
    kv_fp8: bool = False
    rope_q_pos: bool = False
    rope_k_shift: bool = False
    addressing: CacheAddressing = CacheAddressing(wide_offsets=False, same_kv_strides=True)


@dataclass(frozen=True)
class AttentionLaunch:
    """One ``_paged_attn_kernel`` launch, planned before any tensor is touched: the
    :class:`LaunchPlan` (target, tile, grid, splits), the kernel's constexprs, the optional
    pointers the launch does not pass (None) and the scalar mask arguments. The
    launcher, ``kvarena check`` and the tests read this object; nothing re-derives it."""

    plan: LaunchPlan
    meta: dict  # the constexprs of _paged_attn_kernel (_attn_constexprs)
    unused: frozenset[str]  # optional pointers not passed (None): OPTIONAL_POINTERS - _pointers_given
    scale_log2: float
    softcap_inv: float
    softcap_log2: float
    causal_chunk: int  # chunk_size of the causal rule (1: plain causal or no causal mask)
    window: int  # window_left, capped at _NO_WINDOW (the cap when there is no window)
    sinks: int  # sink_tokens when there is a window, else 0
    #: The launcher's argument records of this launch, one per call layout (filled by
    #: ``paged_attention.launch_planned``; not part of the plan): a plan made once per step
    #: lets every layer after the first reuse its strides and step metadata.
    layouts: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def arch(self) -> Arch:
        return self.plan.arch

    @property
    def split(self) -> bool:
        return self.plan.num_splits > 1

    @property
    def grid(self) -> tuple[int, int]:
        return (self.plan.programs, self.plan.num_splits)


def launch_shape(q, k_cache, v_cache, *, num_seqs: int, max_seqlen_q: int, max_seqlen_k: int,
                 own_len: int | None, has_kv_start: bool, write_lse: bool, kv_scales, rope_q_pos: bool,
                 rope_k_shift: bool) -> LaunchShape:
    """The :class:`LaunchShape` of a call, read off its tensors' shapes and strides."""
    h_kv = k_cache.shape[2]
    return LaunchShape(
        head_dim=q.shape[2], group=q.shape[1] // h_kv, elem_bytes=q.element_size(), num_seqs=num_seqs,
        num_kv_heads=h_kv, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_size=k_cache.shape[1],
        own_len=own_len, has_kv_start=has_kv_start, write_lse=write_lse, kv_fp8=kv_scales is not None,
        rope_q_pos=rope_q_pos, rope_k_shift=rope_k_shift, addressing=_cache_addressing(k_cache, v_cache, kv_scales))


def _causal(spec, max_seqlen_k: int) -> bool:
    """Whether a launch applies a causal rule: block-causal with every position in chunk 0 is
    full attention (and the chunk end ``(p // C + 1) * C`` could pass int32 for a huge C)."""
    return spec.causal and not (spec.chunk_size is not None and spec.chunk_size >= max_seqlen_k)


def _launch_plan(shape: LaunchShape, spec, arch: Arch) -> LaunchPlan:
    """:func:`plan_launch` for a call of ``shape`` and ``spec`` (the one place both meet)."""
    return plan_launch(
        head_dim=shape.head_dim, group=shape.group, elem_bytes=shape.elem_bytes, num_seqs=shape.num_seqs,
        num_kv_heads=shape.num_kv_heads, max_seqlen_q=shape.max_seqlen_q, max_seqlen_k=shape.max_seqlen_k,
        block_size=shape.block_size, causal=_causal(spec, shape.max_seqlen_k), window_left=spec.window_left,
        sink_tokens=spec.sink_tokens, softcap=bool(spec.softcap), num_splits=spec.num_splits,
        deterministic=spec.deterministic, arch=arch, large_ok=not shape.addressing.wide_rows,
        own_len=shape.own_len or 0, rope=bool(spec.rope_mode), kv_fp8=shape.kv_fp8,
    )


def takes_own_keys(shape: LaunchShape, spec, arch: Arch | str) -> bool:
    """Whether one launch of ``shape`` takes its ``shape.own_len`` own keys per sequence after
    the history, in the same online softmax (see :func:`plan_launch`): a pure function of host
    values, for the caller to ask before it launches. When it says no, the caller attends to
    the own keys in a launch of their own and merges the two by lse."""
    if isinstance(arch, str):
        arch = arch_named(arch)
    return shape.own_len is not None and _launch_plan(shape, spec, arch).own


def plan_attention(shape: LaunchShape, spec, arch: Arch | str, *, upcast: bool | None = None) -> AttentionLaunch:
    """The one launch plan: (target, spec, shapes) -> :class:`AttentionLaunch`, a pure
    function of host values. A shape with own keys must be one that :func:`takes_own_keys`
    (ValueError otherwise). ``upcast``: widen bf16/fp16 inside the kernel (the interpreter's
    need; default: whether the interpreter runs)."""
    if isinstance(arch, str):
        arch = arch_named(arch)
    chunk_size, window_left, softcap = spec.chunk_size, spec.window_left, spec.softcap
    causal = _causal(spec, shape.max_seqlen_k)
    addressing = shape.addressing
    plan = _launch_plan(shape, spec, arch)
    if shape.own_len is not None and not plan.own:
        raise ValueError("own_k/own_v: this launch cannot take the own keys beside the history "
                         "(ask takes_own_keys first; attend to them separately and merge)")
    split = plan.num_splits > 1
    given = _pointers_given(shape, spec, plan.own, split)
    meta = _attn_constexprs(plan.cfg, shape.group, shape.head_dim, given=given, causal=causal, split=split,
                            upcast=interpreting() if upcast is None else upcast,
                            guard=plan.guard, softcap=bool(softcap), block_size=shape.block_size,
                            elem_bytes=shape.elem_bytes, large_ok=plan.large_ok,
                            sink_logits=spec.sink_logits is not None, kv_fp8=shape.kv_fp8,
                            arch=arch, rope=spec.rope_mode, wide_offsets=addressing.wide_offsets,
                            same_kv_strides=addressing.same_kv_strides, wide_rows=addressing.wide_rows)
    scale = spec.scale_for(shape.head_dim)
    return AttentionLaunch(
        plan, meta, OPTIONAL_POINTERS - given, scale * LOG2E,
        softcap_inv=scale / softcap if softcap else 0.0, softcap_log2=softcap * LOG2E if softcap else 0.0,
        causal_chunk=(chunk_size if chunk_size is not None else 1) if causal else 1,
        window=_NO_WINDOW if window_left is None else min(window_left, _NO_WINDOW),
        sinks=spec.sink_tokens if window_left is not None else 0,
    )
