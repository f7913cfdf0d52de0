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

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvarena.attention.batch import CacheView
from kvarena.attention.fp8 import as_bytes
from kvarena.cache.allocator import BlockAllocator, CacheFullError
from kvarena.cache.layout import (
    FP8_DTYPES,
    KVLayout,
    LayerGroup,
    _check_index,
    _check_int,  # noqa: F401 (the KV pools import the shared checks from here)
    _check_pos_int,
    group_layers,
)

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

# torch sizes are int64; keep room for the alignment padding of a few regions.
_MAX_ARENA_BYTES = 2**62


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
