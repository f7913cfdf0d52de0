"""Rotary tables for RoPE on read (``AttentionSpec.rope_cos`` / ``rope_sin``).

A table row is a token position; its ``D / 2`` columns are the rotation angles' cosines
(sines) of the ``D / 2`` rotation pairs. The kernels rotate a query or key at position p
by row p, so any RoPE whose angles depend on the token position fits: the standard 1-D
RoPE, NTK / YaRN-scaled frequencies (give the scaled table), and Wan's 3-D RoPE, whose
row for token ``f * H * W + h * W + w`` joins the frame, height and width frequencies.
"""

from __future__ import annotations

import torch

from kvarena.argcheck import check_int

__all__ = ["rope_table", "wan_rope_table"]


def _angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """``[len(positions), dim / 2]`` fp64 angles ``p * theta ** (-2i / dim)``."""
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return positions.double()[:, None] * inv[None, :]


def _check_sizes(**sizes: int) -> None:
    """Each table size an int >= 1 and ``head_dim`` even (>= 2): TypeError / ValueError naming it."""
    for name, n in sizes.items():
        check_int(name, n, 2 if name == "head_dim" else 1)
    if sizes["head_dim"] % 2:
        raise ValueError(f"head_dim: expected an even int (D / 2 rotation pairs), got {sizes['head_dim']}")


def rope_table(num_positions: int, head_dim: int, *, theta: float = 10000.0, device=None):
    """The standard 1-D RoPE table: ``(cos, sin)``, each fp32 ``[num_positions, head_dim / 2]``.

    Column i holds angle ``p * theta ** (-2i / head_dim)`` (Llama, Qwen, Mistral; use
    ``rope_interleaved=False`` for their ``rotate_half`` pairs). A ``num_positions`` below
    1 (or an odd ``head_dim``) is a ValueError naming it, a non-int a TypeError.
    """
    _check_sizes(num_positions=num_positions, head_dim=head_dim)
    a = _angles(torch.arange(num_positions), head_dim, theta)
    return a.cos().float().to(device), a.sin().float().to(device)


def wan_rope_table(frames: int, height: int, width: int, head_dim: int, *, theta: float = 10000.0, device=None):
    """Wan 2.1's 3-D RoPE as a table over tokens ``f * H * W + h * W + w``: ``(cos, sin)``,
    each fp32 ``[frames * height * width, head_dim / 2]``, for ``rope_interleaved=True``.

    Wan splits the ``c = head_dim / 2`` complex channels into ``c - 2 (c // 3)`` frame,
    ``c // 3`` height and ``c // 3`` width channels, each with 1-D frequencies of its own
    width (``theta ** (-2i / w)`` over ``w = 2 * channels``). The frame index is the
    position that moves along a rollout; height and width repeat every frame. A size below
    1 (or an odd ``head_dim``) is a ValueError naming it, a non-int a TypeError.
    """
    _check_sizes(frames=frames, height=height, width=width, head_dim=head_dim)
    c = head_dim // 2
    cf, ch = c - 2 * (c // 3), c // 3
    f = _angles(torch.arange(frames), 2 * cf, theta)  # [F, cf]
    h = _angles(torch.arange(height), 2 * ch, theta)  # [H, ch]
    w = _angles(torch.arange(width), 2 * ch, theta)  # [W, ch]
    a = torch.cat([
        f[:, None, None, :].expand(frames, height, width, cf),
        h[None, :, None, :].expand(frames, height, width, ch),
        w[None, None, :, :].expand(frames, height, width, ch),
    ], dim=-1).reshape(frames * height * width, c)
    return a.cos().float().to(device), a.sin().float().to(device)
