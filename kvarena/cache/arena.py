"""One device allocation carved into statically budgeted KV regions, plus block allocators.

A :class:`KVArena` makes exactly one ``torch.empty(total_bytes, dtype=torch.uint8)``
allocation and carves it into named regions (one per KV pool: ``"slab_kv"``,
``"paged_kv"``, ...). Each region has its own :class:`KVLayout` and block size and is
viewed, without copies, as::

    data : [num_blocks, num_layers, 2, block_tokens, H_kv, D]   (layout.dtype)
    scales : [num_blocks, num_layers, 2, block_tokens, H_kv]   (fp32; fp8 layouts only,
             a second section of the region after every block's K/V)

with the per-layer key/value caches the attention ops take as strided views::

    region.k(layer), region.v(layer) : [num_blocks, block_tokens, H_kv, D]

Region offsets are 256-byte aligned and regions never overlap. Each region owns a
:class:`BlockAllocator` (O(1) alloc/free from a stack, reference counts for forked
sequences, all-or-nothing multi-block allocation, thread-safe).

Construction::

    arena = KVArena(
        {"slab_kv": RegionSpec(layout_dit, block_tokens=4680, max_bytes=8 << 30),
         "paged_kv": RegionSpec(layout_lm, block_tokens=16, max_bytes=4 << 30)},
        device="cuda",
    )
    arena["paged_kv"].k(3)            # layer 3 keys, [num_blocks, 16, H_kv, D]

A region holds ``max_bytes // layout.block_bytes(block_tokens)`` blocks (whole
blocks only; the remainder of the budget is not allocated).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

# The dtype rules of the ops the arena feeds: fp8 storage, and what fp8 layouts take in.
from kvarena.attention.batch import CacheView
from kvarena.attention.dtypes import FP8_CACHE_DTYPES as FP8_DTYPES
from kvarena.attention.dtypes import KERNEL_DTYPES as _FP8_INPUT_DTYPES
from kvarena.attention.fp8 import as_bytes
from kvarena.attention.spec import check_int

__all__ = [
    "ALIGN_BYTES",
    "FP8_DTYPES",
    "ArenaRegion",
    "BlockAllocator",
    "CacheFullError",
    "KVArena",
    "KVLayout",
    "LayerGroup",
    "RegionSpec",
    "group_layers",
]

#: Byte alignment of every region's offset inside the arena.
ALIGN_BYTES = 256

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Bytes of one fp32 scale.
_SCALE_BYTES = 4
# torch sizes are int64; keep room for the alignment padding of a few regions.
_MAX_ARENA_BYTES = 2**62


class CacheFullError(RuntimeError):
    """An allocation the budget cannot hold. The pool is exactly as before the call."""


#: ``value`` itself if it is an int (not a bool) ``>= minimum``; else TypeError/ValueError.
#: Shared by the arena and the KV pools (and the rotary tables: its home is
#: ``kvarena.attention.spec``), so every count argument fails with one message.
_check_int = check_int


def _check_pos_int(name: str, value, minimum: int = 1) -> int:
    return int(_check_int(name, value, minimum))


def _check_index(name: str, value, size: int) -> int:
    """``value`` if it is an int in ``[0, size)``; else TypeError / ValueError naming ``name``.

    Shared by the layouts, the arena regions and the KV pools (a layer or group index)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= value < size:
        raise ValueError(f"{name}: expected 0 <= {name} < {size}, got {value}")
    return value


@dataclass(frozen=True)
class LayerGroup:
    """Layers of a :class:`KVLayout` that share blocks: one block of the group holds K/V of
    every layer in it, and a paged pool keeps one block list (and block table) per group.

    Parameters
    ----------
    layers : sequence of int
        Layer indices (sorted on construction; each layer in exactly one group).
    num_kv_heads, head_dim : int, optional
        This group's K/V shape; None: the layout's.
    """

    layers: tuple
    num_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Iterable):
            raise TypeError(f"layers: expected a sequence of layer indices, got {layers!r}")
        layers = tuple(layers)
        for x in layers:
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"layers: expected layer indices >= 0, got {x!r} in {layers!r}")
        if not layers or len(set(layers)) != len(layers):
            raise ValueError(f"layers: expected at least one layer and none twice, got {layers!r}")
        object.__setattr__(self, "layers", tuple(sorted(layers)))
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                _check_pos_int(name, getattr(self, name))


def group_layers(kinds: Sequence[Hashable], *, group_size: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Split layers into groups of equal size, each of one kind (for ``KVLayout(groups=)``).

    Every block of a grouped layout has the bytes of its largest group, so groups of equal
    layer counts (and equal heads / head_dim) waste nothing. Layers of a kind go, in layer
    order, into groups of ``group_size`` layers.

    Parameters
    ----------
    kinds : sequence of hashable
        One entry per layer (a window, ``"sliding_attention"`` / ``"full_attention"``, ...).
    group_size : int, optional
        Layers per group. None: the greatest common divisor of the kinds' layer counts
        (no waste: Gemma-3's 5 sliding : 1 full over 6 layers gives 6 groups of 1, gpt-oss's
        12 : 12 gives 2 groups of 12). A size that does not divide a kind's count leaves
        that kind a smaller last group, whose blocks carry unused bytes (vLLM's padding):
        fewer groups, so less host work per plan, at that memory cost.

    Returns
    -------
    tuple of tuple of int
        The groups' layers, ordered by their first layer.

    Examples
    --------
    >>> from kvarena.cache.arena import group_layers
    >>> group_layers(["sliding"] * 5 + ["full"])
    ((0,), (1,), (2,), (3,), (4,), (5,))
    >>> group_layers(["s", "f", "s", "f"])
    ((0, 2), (1, 3))
    """
    if isinstance(kinds, (str, bytes, Mapping)) or not isinstance(kinds, Iterable):
        raise TypeError(f"kinds: expected a sequence with one hashable entry per layer, got {kinds!r}")
    kinds = list(kinds)
    if not kinds:
        raise ValueError("kinds: expected one entry per layer, got none")
    by_kind: dict = {}
    for i, kind in enumerate(kinds):
        if not isinstance(kind, Hashable):
            raise TypeError(f"kinds[{i}]: expected a hashable kind (a window, a layer type), got {kind!r}")
        by_kind.setdefault(kind, []).append(i)
    if group_size is None:
        size = math.gcd(*(len(v) for v in by_kind.values()))
    else:
        size = _check_pos_int("group_size", group_size)
    groups = [tuple(v[i : i + size]) for v in by_kind.values() for i in range(0, len(v), size)]
    return tuple(sorted(groups))


@dataclass(frozen=True)
class KVLayout:
    """Shape of the K/V one model writes per token.

    Parameters
    ----------
    num_layers : int
        Attention layers that write K/V, ``>= 1``.
    num_kv_heads : int
        KV heads per layer (``H_kv``), ``>= 1``.
    head_dim : int
        Head dimension ``D``, ``>= 1`` (the attention ops take multiples of 8 up to 256).
    dtype : torch.dtype
        Storage dtype: float16, bfloat16, float32, float64, or ``torch.float8_e4m3fn``
        (quantized K/V: half the bytes of bf16 per token, dequantized in registers by the
        attention kernels).
    input_dtype : torch.dtype, optional
        dtype of the q/k/v a pool takes and of its outputs. ``None``: ``dtype`` for a
        float layout (which takes no other), bfloat16 for fp8. An fp8 layout takes
        float16, bfloat16 or float32.
    scales : "token" or float or sequence, default "token"
        fp8 only. ``"token"``: one fp32 scale per (token, kv head) for K and for V,
        ``amax / 448`` of that row, stored in the arena beside the blocks (4 bytes per
        ``head_dim`` bytes of K/V; a decode step writes one token into a partly filled
        block without touching the tokens already stored). Static scales given by the
        user: one float for every layer's K and V, or one per layer (a float, or a
        ``(k_scale, v_scale)`` pair); values beyond +-448 scales saturate. Normalized to
        a tuple of ``(k_scale, v_scale)`` pairs, one per layer.
    groups : sequence of LayerGroup (or of layer-index sequences), optional
        Layers that share blocks (see :class:`LayerGroup` and :func:`group_layers`): a
        paged pool keeps a block list per group, so a sliding-window group returns its
        old blocks while a full-attention group keeps its history (Gemma 2/3, gpt-oss).
        A group may have its own ``num_kv_heads`` / ``head_dim``; ``num_kv_heads`` and
        ``head_dim`` above are the default. The groups must cover every layer once.
        A block has the bytes of the largest group's block (:meth:`block_bytes`);
        :meth:`group_block_bytes` is what a group's block holds. None: one group.

    Raises
    ------
    TypeError, ValueError
        For a field of the wrong type or value (the message names the field).

    Examples
    --------
    >>> import torch
    >>> from kvarena import KVLayout
    >>> layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    >>> layout.token_bytes, layout.block_bytes(4)     # token: 2 layers x (K, V) x 1 x 8 x 4 B
    (128, 512)
    >>> KVLayout.from_kv(torch.zeros(2, 5, 1, 8)) == layout   # [num_layers, T, H_kv, D]
    True
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    input_dtype: torch.dtype | None = None
    scales: str | float | tuple = "token"
    groups: tuple | None = None

    def __post_init__(self) -> None:
        _check_pos_int("num_layers", self.num_layers)
        _check_pos_int("num_kv_heads", self.num_kv_heads)
        _check_pos_int("head_dim", self.head_dim)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {self.dtype!r}")
        if self.dtype not in _FLOAT_DTYPES + FP8_DTYPES:
            raise ValueError(
                f"dtype: expected float16, bfloat16, float32, float64 or float8_e4m3fn, got {self.dtype}"
            )
        fp8 = self.dtype in FP8_DTYPES
        inp = self.input_dtype
        if inp is None:
            inp = torch.bfloat16 if fp8 else self.dtype
        elif not isinstance(inp, torch.dtype):
            raise TypeError(f"input_dtype: expected None or a torch.dtype, got {inp!r}")
        elif fp8 and inp not in _FP8_INPUT_DTYPES:
            raise ValueError(f"input_dtype: an fp8 layout takes float16, bfloat16 or float32 inputs, got {inp}")
        elif not fp8 and inp != self.dtype:
            raise ValueError(f"input_dtype: a {self.dtype} layout takes {self.dtype} inputs (only fp8 storage "
                             f"converts), got {inp}")
        object.__setattr__(self, "input_dtype", inp)
        object.__setattr__(self, "scales", self._norm_scales(fp8))
        self._norm_groups(fp8)

    def _norm_groups(self, fp8: bool) -> None:
        groups = self.groups
        if groups is None:
            resolved = (LayerGroup(tuple(range(self.num_layers)), self.num_kv_heads, self.head_dim),)
        else:
            if isinstance(groups, (str, bytes, Mapping, LayerGroup)) or not isinstance(groups, Iterable):
                raise TypeError(f"groups: expected a sequence of LayerGroup or of layer-index sequences, got {groups!r}")
            resolved = []
            for i, grp in enumerate(groups):
                if not isinstance(grp, LayerGroup):
                    try:
                        grp = LayerGroup(grp)
                    except (TypeError, ValueError) as exc:
                        raise type(exc)(f"groups[{i}]: {exc}") from None
                resolved.append(LayerGroup(grp.layers, grp.num_kv_heads or self.num_kv_heads,
                                           grp.head_dim or self.head_dim))
            resolved = tuple(resolved)
            seen = sorted(x for grp in resolved for x in grp.layers)
            if seen != list(range(self.num_layers)):
                raise ValueError(f"groups: must cover layers 0..{self.num_layers - 1} once each, got "
                                 f"{[grp.layers for grp in resolved]}")
            object.__setattr__(self, "groups", resolved)
        for grp in resolved:
            if fp8 and grp.head_dim % 4:
                raise ValueError(f"head_dim: an fp8 layout needs a multiple of 4 (fp32 scale alignment), got "
                                 f"{grp.head_dim}")
        where = [None] * self.num_layers
        for g, grp in enumerate(resolved):
            for slot, layer in enumerate(grp.layers):
                where[layer] = (g, slot)
        # Not fields (eq / hash / repr come from the fields): derived lookups.
        object.__setattr__(self, "_groups", resolved)
        object.__setattr__(self, "_where", tuple(where))

    def _norm_scales(self, fp8: bool):
        sc = self.scales
        if isinstance(sc, str):
            if sc != "token":
                raise ValueError(f"scales: expected 'token', a float or one float / (k, v) pair per layer, got {sc!r}")
            return sc
        if not fp8:
            raise ValueError(f"scales: static scales are for fp8 layouts, not {self.dtype}")

        def one(x, where):
            # Checked as the fp32 the arena keeps: 1e39 would become inf there, 1e-46 zero.
            f32 = float(torch.tensor(float(x), dtype=torch.float32)) if isinstance(x, (int, float)) else 0.0
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < f32 < float("inf"):
                raise ValueError(f"scales{where}: expected a float > 0 that is finite and nonzero in float32, got {x!r}")
            return float(x)

        if isinstance(sc, (int, float)) and not isinstance(sc, bool):
            s = one(sc, "")
            return ((s, s),) * self.num_layers
        if not isinstance(sc, (tuple, list)) or len(sc) != self.num_layers:
            raise ValueError(f"scales: expected 'token', a float, or {self.num_layers} entries (one per layer), "
                             f"got {sc!r}")
        out = []
        for i, x in enumerate(sc):
            if isinstance(x, (tuple, list)):
                if len(x) != 2:
                    raise ValueError(f"scales[{i}]: expected a float or a (k_scale, v_scale) pair, got {x!r}")
                out.append((one(x[0], f"[{i}][0]"), one(x[1], f"[{i}][1]")))
            else:
                s = one(x, f"[{i}]")
                out.append((s, s))
        return tuple(out)

    @property
    def is_fp8(self) -> bool:
        """bool: K/V are stored quantized (fp8 with fp32 scales)."""
        return self.dtype in FP8_DTYPES

    @property
    def token_scales(self) -> bool:
        """bool: an fp8 layout with one stored scale per (token, kv head)."""
        return self.is_fp8 and self.scales == "token"

    @property
    def element_size(self) -> int:
        """int: bytes per element of ``dtype``."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """tuple of LayerGroup: the groups with their heads / head_dim resolved (one group of
        every layer for an ungrouped layout)."""
        return self._groups

    def group_of(self, layer: int) -> tuple[int, int]:
        """``(group, slot)``: the group holding ``layer`` and its index inside the group."""
        return self._where[_check_index("layer", layer, self.num_layers)]

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """``(num_kv_heads, head_dim)`` of ``layer``."""
        grp = self._groups[self._where[_check_index("layer", layer, self.num_layers)][0]]
        return grp.num_kv_heads, grp.head_dim

    def _section_bytes(self, grp: LayerGroup) -> tuple[int, int]:
        """Per token: ``(K/V bytes, scale bytes)`` of one group."""
        rows = len(grp.layers) * 2 * grp.num_kv_heads
        return rows * grp.head_dim * self.element_size, rows * _SCALE_BYTES if self.token_scales else 0

    @property
    def token_bytes(self) -> int:
        """int: bytes of K and V of one token over all layers (``L * 2 * H_kv * D * elsize``,
        plus ``L * 2 * H_kv * 4`` of scales for per-token fp8 scales). Grouped: the largest
        group's K/V bytes plus its largest scale bytes (what one block slot costs per token)."""
        sections = [self._section_bytes(grp) for grp in self._groups]
        return max(d for d, _s in sections) + max(s for _d, s in sections)

    def group_block_bytes(self, group: int, block_tokens: int) -> int:
        """Bytes group ``group`` stores in one block of ``block_tokens`` tokens (<= :meth:`block_bytes`)."""
        _check_pos_int("block_tokens", block_tokens)
        return block_tokens * sum(self._section_bytes(self._groups[_check_index("group", group, len(self._groups))]))

    def block_bytes(self, block_tokens: int) -> int:
        """Bytes of one block of ``block_tokens`` tokens (all layers, K and V).

        Parameters
        ----------
        block_tokens : int
            Tokens per block, ``>= 1``.

        Returns
        -------
        int
            ``block_tokens * token_bytes``.
        """
        _check_pos_int("block_tokens", block_tokens)
        return block_tokens * self.token_bytes

    @classmethod
    def from_kv(cls, k: torch.Tensor) -> KVLayout:
        """The layout of a ``[num_layers, T, H_kv, D]`` K (or V) tensor."""
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            shape = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
            raise ValueError(f"k: expected a [num_layers, T, H_kv, D] tensor, got {shape}")
        return cls(int(k.shape[0]), int(k.shape[2]), int(k.shape[3]), k.dtype)


@dataclass(frozen=True)
class RegionSpec:
    """Static budget of one arena region.

    Parameters
    ----------
    layout : KVLayout
        What one token of this region holds.
    block_tokens : int
        Tokens per block (a paged pool's ``block_size``, a slab pool's ``slab_tokens``).
    max_bytes : int
        Byte budget; the region holds ``max_bytes // layout.block_bytes(block_tokens)``
        whole blocks.
    """

    layout: KVLayout
    block_tokens: int
    max_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise TypeError(f"layout: expected a KVLayout, got {type(self.layout).__name__}")
        _check_pos_int("block_tokens", self.block_tokens)
        _check_pos_int("max_bytes", self.max_bytes, 0)
        if self.num_blocks * self.block_bytes > _MAX_ARENA_BYTES:
            raise ValueError(
                f"max_bytes: {self.max_bytes} is more than one device allocation can address "
                f"(at most {_MAX_ARENA_BYTES} bytes)"
            )

    @property
    def block_bytes(self) -> int:
        """int: bytes per block."""
        return self.layout.block_bytes(self.block_tokens)

    @property
    def num_blocks(self) -> int:
        """int: whole blocks the budget holds."""
        return self.max_bytes // self.block_bytes


class BlockAllocator:
    """Reference-counted allocator of ``num_blocks`` block ids ``0 .. num_blocks-1``.

    Freed ids sit on a stack (O(1) alloc and free; a freed id is the next one handed
    out, which keeps re-planned rollouts on the same blocks); ids never handed out yet
    come from a counter, so the allocator's memory grows with the blocks in use, not
    with ``num_blocks`` (a budget of 2**60 one-byte blocks costs nothing up front).
    Every call is all-or-nothing and thread-safe.

    Parameters
    ----------
    num_blocks : int
        Number of blocks, ``>= 0``.

    Examples
    --------
    >>> from kvarena.cache.arena import BlockAllocator
    >>> alloc = BlockAllocator(4)
    >>> blocks = alloc.alloc(2)
    >>> blocks, alloc.num_free
    ([0, 1], 2)
    >>> alloc.incref([0])                       # a fork shares block 0
    >>> alloc.decref(blocks), alloc.refcount(0)  # block 1 is free again, block 0 still held
    ([1], 1)
    >>> alloc.alloc(1)                          # the freed id is handed out first
    [1]
    >>> alloc.alloc(3)
    Traceback (most recent call last):
        ...
    kvarena.cache.arena.CacheFullError: need 3 blocks, only 2 of 4 are free
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = _check_pos_int("num_blocks", num_blocks, 0)
        self._lock = threading.Lock()
        self._free: list[int] = []  # freed ids, reused first (LIFO)
        self._fresh = 0  # ids >= _fresh were never handed out
        self._ref: dict[int, int] = {}  # allocated id -> reference count

    @property
    def num_free(self) -> int:
        """int: blocks not allocated."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_used(self) -> int:
        """int: blocks allocated (refcount >= 1)."""
        return len(self._ref)

    def refcount(self, block: int) -> int:
        """Reference count of ``block`` (0 when free)."""
        self._check_id(block)
        return self._ref.get(block, 0)

    def alloc(self, n: int = 1) -> list[int]:
        """Allocate ``n`` blocks, each with refcount 1.

        Returns
        -------
        list of int
            The block ids (``[]`` for ``n = 0``).

        Raises
        ------
        CacheFullError
            Fewer than ``n`` blocks are free (nothing is allocated).
        ValueError
            ``n < 0``.
        """
        n = _check_pos_int("n", n, 0)
        with self._lock:
            if n > self.num_free:
                raise CacheFullError(
                    f"need {n} blocks, only {self.num_free} of {self.num_blocks} are free"
                )
            reused = min(n, len(self._free))
            out = [self._free.pop() for _ in range(reused)]
            out += range(self._fresh, self._fresh + n - reused)
            self._fresh += n - reused
            for b in out:
                self._ref[b] = 1
            return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each allocated block (a fork). All-or-nothing.

        Raises
        ------
        ValueError
            A block id out of range or not allocated (the message names it).
        """
        blocks = list(blocks)
        with self._lock:
            for b in blocks:
                self._check_id(b)
                if b not in self._ref:
                    raise ValueError(f"block {b} is not allocated (incref of a free block)")
            for b in blocks:
                self._ref[b] += 1

    def decref(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference per listed id (an id may repeat); free blocks reaching 0.

        Validated before anything changes: a double free, or more drops than
        references, raises and leaves every refcount as it was.

        Returns
        -------
        list of int
            The ids that became free, in the order they were pushed on the free stack.

        Raises
        ------
        ValueError
            An id out of range, or freed more often than it is referenced.
        """
        blocks = list(blocks)
        with self._lock:
            drops: dict[int, int] = {}
            for b in blocks:
                self._check_id(b)
                drops[b] = drops.get(b, 0) + 1
                if drops[b] > self._ref.get(b, 0):
                    raise ValueError(
                        f"block {b} freed more often than referenced (refcount "
                        f"{self._ref.get(b, 0)}): double free or foreign block id"
                    )
            freed = []
            for b in blocks:
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    del self._ref[b]
                    self._free.append(b)
                    freed.append(b)
            return freed

    free = decref

    def _check_id(self, block) -> None:
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"block id: expected an int, got {block!r}")
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} out of range [0, {self.num_blocks})")


class ArenaRegion:
    """One named region of a :class:`KVArena` (create through the arena).

    Attributes
    ----------
    name : str
    layout : KVLayout
    block_tokens : int
    num_blocks : int
    block_bytes : int
    offset : int
        Byte offset inside the arena buffer (multiple of 256).
    data : torch.Tensor or None
        ``[num_blocks, num_layers, 2, block_tokens, H_kv, D]`` view of the arena (None for
        a grouped layout: see ``group_data``).
    scales : torch.Tensor or None
        fp8 with per-token scales: ``[num_blocks, num_layers, 2, block_tokens, H_kv]`` fp32
        view of the region's scale section (after all blocks' K/V); else None.
    group_data, group_scales : list of torch.Tensor
        Per layer group (one for an ungrouped layout: ``data`` / ``scales``):
        ``[num_blocks, group_layers, 2, block_tokens, H_kv, D]`` (and its scales).
    allocator : BlockAllocator
    """

    def __init__(self, name: str, spec: RegionSpec, buffer: torch.Tensor, offset: int) -> None:
        self.name = name
        self.layout = spec.layout
        self.block_tokens = spec.block_tokens
        self.block_bytes = spec.block_bytes
        self.num_blocks = spec.num_blocks
        self.offset = offset
        self.nbytes = self.num_blocks * self.block_bytes
        lay = spec.layout
        nb, st = self.num_blocks, self.block_tokens
        # The region is [all blocks' K/V | all blocks' fp32 scales] (scales: fp8 with
        # per-token scales only), so the K/V section keeps the float layout's contiguous
        # block shape (slab page views, block strides) and the scales are a second array
        # indexed by the same block id. A block of a grouped layout is a row of the largest
        # group's bytes; each group views the front of the row in its own shape.
        sections = [lay._section_bytes(grp) for grp in lay.layer_groups]
        data_row = st * max(d for d, _s in sections)
        scale_row = st * max(s for _d, s in sections)
        self._raw = buffer[offset : offset + nb * data_row].view(nb, data_row)  # uint8 [nb, block K/V bytes]
        self._raw_scales = None
        if scale_row:
            sbase = offset + nb * data_row
            self._raw_scales = buffer[sbase : sbase + nb * scale_row].view(nb, scale_row)
        self.group_data = []  # per group: [num_blocks, group layers, 2, block_tokens, H_kv, D]
        self.group_scales = []  # per group: [num_blocks, group layers, 2, block_tokens, H_kv] fp32, or None
        for grp, (d_bytes, s_bytes) in zip(lay.layer_groups, sections):
            shape = (nb, len(grp.layers), 2, st, grp.num_kv_heads)
            self.group_data.append(self._raw[:, : st * d_bytes].view(lay.dtype).view(*shape, grp.head_dim))
            self.group_scales.append(
                self._raw_scales[:, : st * s_bytes].view(torch.float32).view(shape) if s_bytes else None)
        grouped = lay.groups is not None
        #: Ungrouped layouts: ``[num_blocks, num_layers, 2, block_tokens, H_kv, D]`` (None when grouped).
        self.data = None if grouped else self.group_data[0]
        self.scales = None if grouped else self.group_scales[0]
        # Per-layer views are made once: forward() runs per layer and should not re-slice.
        where = [lay.group_of(layer) for layer in range(lay.num_layers)]
        self._k = [self.group_data[g][:, i, 0] for g, i in where]
        self._v = [self.group_data[g][:, i, 1] for g, i in where]
        self._ks = self._vs = [None] * lay.num_layers
        if lay.token_scales:
            self._ks = [self.group_scales[g][:, i, 0] for g, i in where]
            self._vs = [self.group_scales[g][:, i, 1] for g, i in where]
        elif lay.is_fp8:
            # Static scales: a [L, 2] fp32 device tensor beside the arena (not per block).
            static = torch.tensor(lay.scales, dtype=torch.float32, device=buffer.device)
            self._ks = [static[layer, 0] for layer in range(lay.num_layers)]
            self._vs = [static[layer, 1] for layer in range(lay.num_layers)]
        # What the pools hand the ops: fp8 bytes and per-token scales as uint8 views, so a
        # compiled graph never sees two dtypes of views of the one arena buffer.
        self._op = [CacheView(self._k[i], self._v[i]) for i in range(lay.num_layers)]
        if lay.is_fp8:
            self._op = [CacheView(as_bytes(self._k[i]), as_bytes(self._v[i]),
                                  (as_bytes(self._ks[i]), as_bytes(self._vs[i])))
                        for i in range(lay.num_layers)]
        self.allocator = BlockAllocator(self.num_blocks)

    def _layer(self, layer) -> int:
        return _check_index("layer", layer, self.layout.num_layers)

    def k(self, layer: int) -> torch.Tensor:
        """Keys of ``layer``: strided view ``[num_blocks, block_tokens, H_kv, D]``."""
        return self._k[self._layer(layer)]

    def v(self, layer: int) -> torch.Tensor:
        """Values of ``layer``: strided view ``[num_blocks, block_tokens, H_kv, D]``."""
        return self._v[self._layer(layer)]

    def kv_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp8 scales of ``layer``'s K and V, or None for a float layout.

        Per-token scales: fp32 views ``[num_blocks, block_tokens, H_kv]`` of the arena
        (block ids as for :meth:`k`). Static scales: 0-dim fp32 tensors.
        """
        layer = self._layer(layer)
        ks = self._ks[layer]
        return None if ks is None else (ks, self._vs[layer])

    def op_views(self, layer: int) -> CacheView:
        """``layer``'s :class:`~kvarena.attention.batch.CacheView` as the pools pass it to the ops (trusted index).

        Float layouts: :meth:`k`, :meth:`v` and None. fp8: the same memory as uint8 views
        (per-token scales ``[num_blocks, block_tokens, H_kv * 4]``; static ones 0-dim fp32),
        which the dispatcher views back.
        """
        return self._op[layer]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` (int64 device tensors): K/V and scales."""
        # As bytes: every group's layout at once, and no fp8 index_copy_ on CPU.
        self._raw.index_copy_(0, dst, self._raw.index_select(0, src))
        if self._raw_scales is not None:
            self._raw_scales.index_copy_(0, dst, self._raw_scales.index_select(0, src))

    @property
    def reserved_bytes(self) -> int:
        """int: bytes of all blocks of the region."""
        return self.nbytes

    @property
    def used_bytes(self) -> int:
        """int: bytes of allocated blocks."""
        return self.allocator.num_used * self.block_bytes

    @property
    def free_bytes(self) -> int:
        """int: bytes of free blocks."""
        return self.allocator.num_free * self.block_bytes

    def __repr__(self) -> str:
        return (
            f"ArenaRegion({self.name!r}, blocks={self.num_blocks}, block_tokens="
            f"{self.block_tokens}, offset={self.offset}, layout={self.layout})"
        )


class KVArena:
    """A single device allocation carved into named, statically budgeted KV regions.

    Parameters
    ----------
    regions : mapping of str to RegionSpec
        Region name -> budget, laid out in the mapping's order at 256-byte aligned
        offsets.
    device : torch.device or str, optional
        Where the arena lives (default CPU).

    Attributes
    ----------
    buffer : torch.Tensor
        The one ``uint8 [nbytes]`` allocation.
    regions : dict of str to ArenaRegion
    device : torch.device

    Examples
    --------
    >>> import torch
    >>> from kvarena import KVArena, KVLayout
    >>> from kvarena.cache.arena import RegionSpec
    >>> layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    >>> arena = KVArena({"slab_kv": RegionSpec(layout, block_tokens=6, max_bytes=2048),
    ...                  "paged_kv": RegionSpec(layout, block_tokens=4, max_bytes=2048)})
    >>> paged = arena.regions["paged_kv"]
    >>> paged.block_bytes, paged.num_blocks, paged.offset, tuple(paged.k(1).shape)
    (512, 4, 1536, (4, 4, 1, 8))
    >>> paged.allocator.alloc(2)
    [0, 1]
    >>> paged.used_bytes, arena.regions["slab_kv"].used_bytes, arena.used_bytes
    (1024, 0, 1024)
    """

    def __init__(self, regions: Mapping[str, RegionSpec], *, device=None) -> None:
        if not isinstance(regions, Mapping):
            raise TypeError(
                f"regions: expected a mapping of name -> RegionSpec, got {type(regions).__name__}"
            )
        offsets: list[tuple[str, RegionSpec, int]] = []
        total = 0
        for name, spec in regions.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"regions: names must be non-empty str, got {name!r}")
            if not isinstance(spec, RegionSpec):
                raise TypeError(
                    f"regions[{name!r}]: expected a RegionSpec, got {type(spec).__name__}"
                )
            total = -(-total // ALIGN_BYTES) * ALIGN_BYTES
            offsets.append((name, spec, total))
            total += spec.num_blocks * spec.block_bytes
        self.nbytes = -(-total // ALIGN_BYTES) * ALIGN_BYTES
        if self.nbytes > _MAX_ARENA_BYTES:
            raise ValueError(f"regions: {self.nbytes} bytes in all, over one allocation's {_MAX_ARENA_BYTES}")
        try:
            dev = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"device: expected a torch.device or a device string, got {device!r}") from exc
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=dev)
        # The allocation's own device: "cuda" normalizes to "cuda:0", as on the views.
        self.device = self.buffer.device
        self.regions: dict[str, ArenaRegion] = {
            name: ArenaRegion(name, spec, self.buffer, off) for name, spec, off in offsets
        }

    @classmethod
    def single(
        cls, name: str, layout: KVLayout, block_tokens: int, max_bytes: int, *, device=None
    ) -> KVArena:
        """An arena with one region (what a pool makes when given no arena)."""
        return cls({name: RegionSpec(layout, block_tokens, max_bytes)}, device=device)

    def __getitem__(self, name: str) -> ArenaRegion:
        try:
            return self.regions[name]
        except KeyError:
            raise KeyError(f"region {name!r} not in this arena (have {list(self.regions)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self.regions

    def data_ptr(self) -> int:
        """int: address of the arena buffer (constant for the arena's life)."""
        return self.buffer.data_ptr()

    @property
    def reserved_bytes(self) -> int:
        """int: bytes of all regions' blocks (excludes alignment padding)."""
        return sum(r.reserved_bytes for r in self.regions.values())

    @property
    def used_bytes(self) -> int:
        """int: bytes of allocated blocks over all regions."""
        return sum(r.used_bytes for r in self.regions.values())

    @property
    def free_bytes(self) -> int:
        """int: bytes of free blocks over all regions."""
        return sum(r.free_bytes for r in self.regions.values())

    def __repr__(self) -> str:
        return f"KVArena({self.nbytes} bytes on {self.device}, regions={list(self.regions)})"
