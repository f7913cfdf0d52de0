"""Helpers shared by the KV pools: host->device metadata uploads and argument checks."""

from __future__ import annotations

import itertools
import struct

import torch

from kvarena.cache.arena import ArenaRegion, KVArena, KVLayout

__all__ = [
    "StaleMetadataError",
    "as_device",
    "check_forward_tensor",
    "next_version",
    "pick_region",
    "region_of_arena",
    "upload",
]


class StaleMetadataError(RuntimeError):
    """Metadata used after one of its namespaces was planned again, truncated, forked or freed."""


_versions = itertools.count(1)


def next_version() -> int:
    """A process-wide increasing stamp (never reused, so a freed and re-made namespace differs)."""
    return next(_versions)


#: The ``struct`` codes of the dtypes a flat list of ints is packed with (a few times
#: faster than ``torch.tensor`` of a list).
_STRUCT_CODES = {torch.int32: "i", torch.int64: "q"}


def _host_tensor(data, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)``, packed by ``struct`` for a flat non-empty list of ints."""
    code = _STRUCT_CODES.get(dtype)
    if code is not None and isinstance(data, list) and data:
        try:
            return torch.frombuffer(bytearray(struct.pack(f"={len(data)}{code}", *data)), dtype=dtype)
        except struct.error:
            pass  # not flat ints, or out of range: torch.tensor says what
    return torch.tensor(data, dtype=dtype)


def upload(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list/tensor as a device tensor without blocking on the device queue.

    On CUDA the host copy is pinned and copied with ``non_blocking=True`` (the caching
    host allocator keeps the pinned block alive until the copy has run).
    """
    t = data if isinstance(data, torch.Tensor) else _host_tensor(data, dtype)
    if t.dtype != dtype:
        t = t.to(dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def as_device(device) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None); ``ValueError`` naming it otherwise.

    Catches what torch would report later as a RuntimeError: an unknown device string,
    or CUDA asked for on a machine without it.
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device: expected a torch.device or a device string such as 'cpu' or 'cuda:0', got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asks for CUDA, which is not available on this machine")
    try:
        return torch.empty(0, device=dev).device  # "cuda" -> "cuda:0", as on the arena's views
    except RuntimeError as exc:
        raise ValueError(f"device: cannot allocate on {device!r}: {exc}") from exc


def check_forward_tensor(
    name: str, t, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, what: str
) -> None:
    """Shape/dtype/device check with a message naming the argument and the expectation."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape:  # torch.Size compares with a tuple as one
        raise ValueError(f"{name}: expected shape {shape} ({what}), got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected the layout's input dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected the cache's device {device}, got {t.device}")
    if shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got strides {t.stride()}")


def pick_region(arena: KVArena, region: str | None, class_name: str, default: str) -> ArenaRegion:
    """The region a pool uses inside a shared arena.

    ``region`` when given; else the arena's only region; else the region named like the
    policy's class, else ``default``.
    """
    if not isinstance(arena, KVArena):
        raise TypeError(f"arena: expected a KVArena, got {type(arena).__name__}")
    if region is not None:
        return arena[region]
    if len(arena.regions) == 1:
        return next(iter(arena.regions.values()))
    for name in (class_name, default):
        if name in arena.regions:
            return arena.regions[name]
    raise ValueError(
        f"region: the arena has regions {list(arena.regions)}; pass region=<name> "
        f"(none is named {class_name!r} or {default!r})"
    )


def check_layout_match(given: KVLayout | None, region: ArenaRegion) -> KVLayout:
    """A layout given next to an arena must be the region's."""
    if given is not None:
        if not isinstance(given, KVLayout):
            raise TypeError(f"layout: expected a KVLayout, got {type(given).__name__}")
        if given != region.layout:
            raise ValueError(
                f"layout: {given} differs from the arena region {region.name!r}'s {region.layout}"
            )
    return region.layout


def region_of_arena(
    arena: KVArena,
    region: str | None,
    policy,
    default: str,
    layout: KVLayout | None,
    tokens_name: str,
    tokens: int | None,
    device,
) -> tuple[ArenaRegion, KVLayout]:
    """A pool's region of a shared arena, checked against the pool's other arguments.

    The region is :func:`pick_region`'s; ``layout`` (when given) must be its layout,
    ``tokens`` (when given; the argument ``tokens_name``) its ``block_tokens`` and
    ``device`` (when given) the arena's. Returns the region and its layout.
    """
    reg = pick_region(arena, region, getattr(policy, "class_name", ""), default)
    layout = check_layout_match(layout, reg)
    if tokens is not None and tokens != reg.block_tokens:
        raise ValueError(
            f"{tokens_name}: {tokens} differs from the arena region {reg.name!r}'s "
            f"block_tokens {reg.block_tokens}"
        )
    if device is not None and as_device(device) != arena.device:
        raise ValueError(f"device: {device} differs from the arena's device {arena.device}")
    return reg, layout
