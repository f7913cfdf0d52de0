"""What one token of a KV pool holds: :class:`KVLayout` and its layer groups.

:class:`LayerGroup` names layers that share blocks, :func:`group_layers` splits layers of
a few kinds into equal groups, and :class:`KVLayout` is the per-token shape, dtype, fp8
scales and groups a pool stores. The argument checks here (``_check_int``,
``_check_pos_int``, ``_check_index``, built on :mod:`kvarena.argcheck`) are the ones the
arena and the KV pools share, so every count or index argument fails with one message.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvarena.argcheck import check_int, is_int

# The dtype rules of the ops the arena feeds: fp8 storage, and what fp8 layouts take in.
from kvarena.attention.dtypes import FP8_CACHE_DTYPES as FP8_DTYPES
from kvarena.attention.dtypes import KERNEL_DTYPES as _FP8_INPUT_DTYPES

__all__ = ["FP8_DTYPES", "KVLayout", "LayerGroup", "group_layers"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Bytes of one fp32 scale.
_SCALE_BYTES = 4

#: ``value`` itself if it is an int (not a bool) ``>= minimum``; else TypeError/ValueError.
#: Shared by the arena and the KV pools (its home is :mod:`kvarena.argcheck`), so every
#: count argument fails with one message.
_check_int = check_int


def _check_pos_int(name: str, value, minimum: int = 1) -> int:
    return int(_check_int(name, value, minimum))


def _check_index(name: str, value, size: int) -> int:
    """``value`` if it is an int in ``[0, size)``; else TypeError / ValueError naming ``name``.

    Shared by the layouts, the arena regions and the KV pools (a layer or group index)."""
    if not is_int(value):
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
            if not is_int(x) or x < 0:
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

