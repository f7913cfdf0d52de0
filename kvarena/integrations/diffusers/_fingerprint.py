"""A content fingerprint of tensors, computed where they live: what prompt K/V are keyed by.

Version counters and storage addresses do not see every write: ``weight.data += delta``
(how PEFT fuses a LoRA) and ``emb.data.mul_(2)`` bump no counter, ``load_state_dict(...,
assign=True)`` makes new parameters, and inference tensors have no counter at all. A
fingerprint of the bits sees every one of them, with no host copy of the weights.

A tensor's fingerprint is ``sum_ij bits[i, j] * r[i] * c[j] (mod 2**64)`` over its
elements' bit patterns (the tensor viewed as ``[rows, last dim]``), with fixed odd
pseudo-random 64-bit multipliers ``r``, ``c``: a change of any one element's bits changes
it (an odd multiplier is invertible mod 2**64); several changes cancel with probability
about 2**-64. The work is chunked so the int64 temporary stays under 32 MiB.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["fingerprint"]

_CHUNK = 1 << 22  # elements per int64 temporary (32 MiB)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.lru_cache(maxsize=64)
def _multipliers(n: int, device: torch.device, salt: int) -> torch.Tensor:
    """``n`` odd int64 multipliers, the same in every process (seeded by ``salt``, ``n``)."""
    g = torch.Generator().manual_seed(0x6B76_6172 + 1_000_003 * salt + n)
    return (torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64) | 1).to(device)


def _one(t: torch.Tensor) -> torch.Tensor:
    x = t.detach()
    x = x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])
    rows, cols = x.shape
    bits = x.view(_BITS[x.element_size()]) if x.dtype.is_floating_point or x.dtype == torch.bool else x
    if rows == 0 or cols == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    c = _multipliers(cols, x.device, 1)
    r = _multipliers(rows, x.device, 2)
    step = max(1, _CHUNK // cols)
    parts = [((bits[i:i + step].to(torch.int64) * c).sum(1) * r[i:i + step]).sum() for i in range(0, rows, step)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


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
    for _, t in leaves:
        sums.setdefault(t.device, []).append(_one(t))
    values = {dev: iter(torch.stack(v).cpu().tolist()) for dev, v in sums.items()}
    return tuple((path, str(t.dtype), tuple(t.shape), str(t.device), next(values[t.device])) for path, t in leaves)
