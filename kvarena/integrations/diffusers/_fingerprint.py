"""A content fingerprint of tensors, computed where they live: what prompt K/V are keyed by.

Version counters and storage addresses do not see every write: ``weight.data += delta``
(how PEFT fuses a LoRA) and ``emb.data.mul_(2)`` bump no counter, ``load_state_dict(...,
assign=True)`` makes new parameters, and inference tensors have no counter at all. A
fingerprint of the bits sees every one of them, with no host copy of the weights.

A tensor's fingerprint is ``sum_ij bits[i, j] * r[i] * c[j] (mod 2**64)`` over its
elements' bit patterns (the tensor viewed as ``[rows, last dim]``), with fixed odd
pseudo-random 64-bit multipliers ``r``, ``c``: a change of any one element's bits changes
it (an odd multiplier is invertible mod 2**64); several changes cancel with probability
about 2**-64. The work is chunked so the int64 temporary stays under 64 MiB, and
tensors of one shape are hashed together (few launches for a model's per-block weights).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["fingerprint"]

_CHUNK = 1 << 23  # elements per int64 temporary (64 MiB)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.lru_cache(maxsize=64)
def _multipliers(n: int, device: torch.device, salt: int) -> torch.Tensor:
    """``n`` odd int64 multipliers, the same in every process (seeded by ``salt``, ``n``)."""
    g = torch.Generator().manual_seed(0x6B76_6172 + 1_000_003 * salt + n)
    return (torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64) | 1).to(device)


def _bits2d(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as an integer tensor ``[rows, last dim]`` (no copy for a view)."""
    x = t.detach()
    x = x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])
    return x.view(_BITS[x.element_size()]) if x.dtype.is_floating_point or x.dtype == torch.bool else x


def _hash(bits: torch.Tensor) -> torch.Tensor:
    """``[..., rows, cols]`` integer bits -> ``[...]`` int64 fingerprints (one chunk's worth)."""
    rows, cols = bits.shape[-2:]
    c, r = _multipliers(cols, bits.device, 1), _multipliers(rows, bits.device, 2)
    return ((bits.to(torch.int64) * c).sum(-1) * r).sum(-1)


def _one(bits: torch.Tensor) -> torch.Tensor:
    """One tensor's fingerprint, its rows in chunks of at most ``_CHUNK`` elements."""
    rows, cols = bits.shape
    step = max(1, _CHUNK // cols)
    c, r = _multipliers(cols, bits.device, 1), _multipliers(rows, bits.device, 2)
    parts = [((bits[i:i + step].to(torch.int64) * c).sum(1) * r[i:i + step]).sum() for i in range(0, rows, step)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _fingerprints(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 0-dim fingerprint of each tensor. Tensors of one device, bit width and 2-D shape
    (a model's per-block projections) are stacked and hashed together, several per chunk:
    a handful of launches instead of a few per tensor; each value is the one of ``_one``."""
    bits = [_bits2d(t) for t in leaves]
    out: list[torch.Tensor | None] = [None] * len(bits)
    groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(bits):
        if b.numel() == 0:
            out[i] = torch.zeros((), dtype=torch.int64, device=b.device)
        elif b.numel() > _CHUNK:
            out[i] = _one(b)
        else:
            groups.setdefault((b.device, b.dtype, tuple(b.shape)), []).append(i)
    for idx in groups.values():
        per = max(1, _CHUNK // bits[idx[0]].numel())
        for j in range(0, len(idx), per):
            part = idx[j:j + per]
            vals = _hash(torch.stack([bits[i] for i in part]))
            for k, i in enumerate(part):
                out[i] = vals[k]
    return out


def _leaves(t: torch.Tensor, path: str = ""):
    """``(path, plain tensor)`` pairs holding ``t``'s bits: ``t`` itself, or the inner tensors
    of a wrapper subclass (a quantized weight: its data and scales), with its type and
    metadata in the path."""
    if is_traceable_wrapper_subclass(t):
        attrs, ctx = t.__tensor_flatten__()
        for a in attrs:
            yield from _leaves(getattr(t, a), f"{path}/{type(t).__qualname__}({ctx!r}).{a}")
    else:
        yield path, t


def fingerprint(tensors: Iterable[torch.Tensor]) -> tuple[tuple, ...]:
    """``(dtype, shape, device, bits fingerprint)`` of each of ``tensors``, in order (a
    wrapper subclass: one entry per inner tensor): one device-to-host copy per device.
    Works under ``torch.inference_mode()``."""
    leaves = [(f"{i}{path}", leaf) for i, t in enumerate(tensors) for path, leaf in _leaves(t)]
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for (_, t), value in zip(leaves, _fingerprints([t for _, t in leaves])):
        sums.setdefault(t.device, []).append(value)
    values = {dev: iter(torch.stack(v).cpu().tolist()) for dev, v in sums.items()}
    return tuple((path, str(t.dtype), tuple(t.shape), str(t.device), next(values[t.device])) for path, t in leaves)
