"""Layers shared by the example models (no kvarena logic here)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim (the examples have random weights anyway)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(pos: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[N, 1, head_dim // 2]`` (fp64) for absolute positions ``pos [N]``."""
    inv = base ** (-torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float64) / head_dim)
    ang = pos.double()[:, None] * inv[None, :]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of ``x [N, H, D]`` by the position angles."""
    half = x.shape[-1] // 2
    acc = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)
