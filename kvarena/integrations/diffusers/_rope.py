"""Wan's 3-D RoPE for a chunk at an absolute frame offset (Self-Forcing's ``causal_rope_apply``).

diffusers' ``WanRotaryPosEmbed`` always numbers a call's frames ``0 .. F-1``; Self-Forcing
numbers a chunk's frames ``start_frame .. start_frame + F - 1``. Only the temporal part
of the head dimension moves (its first ``head_dim - 4 * (head_dim // 6)`` channels);
height and width stay. The tables are diffusers' own (``rope.freqs_cos`` /
``rope.freqs_sin``), so a chunk at frame 0 gets exactly what diffusers computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ChunkRotary", "apply_rotary", "chunk_rotary"]


@dataclass(frozen=True)
class ChunkRotary:
    """``cos, sin [1, F*H*W, 1, head_dim]`` (diffusers' interleaved layout) of one chunk."""

    cos: torch.Tensor
    sin: torch.Tensor


def chunk_rotary(rope: torch.nn.Module, start_frame: int, frames: int, height: int, width: int) -> ChunkRotary:
    """RoPE of latent-patch grid ``frames x height x width`` whose first frame is ``start_frame``."""
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    parts = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        t, h, w = table.split(split, dim=1)
        grid = torch.cat([
            t[start_frame:start_frame + frames].view(frames, 1, 1, -1).expand(frames, height, width, -1),
            h[:height].view(1, height, 1, -1).expand(frames, height, width, -1),
            w[:width].view(1, 1, width, -1).expand(frames, height, width, -1),
        ], dim=-1)
        parts.append(grid.reshape(1, frames * height * width, 1, -1))
    return ChunkRotary(*parts)


def apply_rotary(x: torch.Tensor, rot: ChunkRotary) -> torch.Tensor:
    """``x [B, T, H, D]`` rotated as diffusers' ``WanAttnProcessor`` does (same arithmetic)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = rot.cos[..., 0::2]
    sin = rot.sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)
