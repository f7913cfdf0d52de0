"""The tiny Wan-like causal video DiT of :mod:`kvarena.examples.causal_dit`, and its dense
reference: the whole video so far through every layer with the explicit sink + window
token mask (a query of the chunk ending at ``e`` sees ``t < e`` with ``t < S`` or
``t >= e - W``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvarena.examples.common import apply_rope, rms_norm, rope_tables

__all__ = ["DiTConfig", "TinyCausalDiT", "dense_forward", "sink_window_mask"]


@dataclass(frozen=True)
class DiTConfig:
    channels: int = 8  # latent channels per token
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 16
    ffn: int = 128
    text_len: int = 7
    vocab: int = 50
    frame_tokens: int = 6
    frames_per_chunk: int = 2
    first_chunk_frames: int = 1  # image-to-video style short first chunk
    rope_base: float = 10000.0

    @property
    def chunk_tokens(self) -> int:
        return self.frame_tokens * self.frames_per_chunk

    def chunk_len(self, c: int) -> int:
        return self.frame_tokens * (self.first_chunk_frames if c == 0 else self.frames_per_chunk)

    def chunk_start(self, c: int) -> int:
        """Global position of chunk c's first token (RoPE and the dense check use it)."""
        return 0 if c == 0 else self.chunk_len(0) + (c - 1) * self.chunk_tokens


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    ang = t.float()[..., None] * 1000.0 * freqs
    return torch.cat((ang.cos(), ang.sin()), dim=-1)


class TinyCausalDiT(nn.Module):
    """adaLN blocks of self-attention (RoPE before caching), text cross-attention and FFN."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        c = cfg
        self.cfg = cfg
        hd = c.num_heads * c.head_dim
        self.patch_in = nn.Linear(c.channels, c.dim)
        self.patch_out = nn.Linear(c.dim, c.channels)
        self.t_mlp = nn.Sequential(nn.Linear(c.dim, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.ada = nn.ModuleList(nn.Linear(c.dim, 6 * c.dim) for _ in range(c.num_layers))
        self.qkv = nn.ModuleList(nn.Linear(c.dim, 3 * hd) for _ in range(c.num_layers))
        self.proj = nn.ModuleList(nn.Linear(hd, c.dim) for _ in range(c.num_layers))
        self.cross_q = nn.ModuleList(nn.Linear(c.dim, hd) for _ in range(c.num_layers))
        self.cross_kv = nn.ModuleList(nn.Linear(c.dim, 2 * hd) for _ in range(c.num_layers))
        self.cross_o = nn.ModuleList(nn.Linear(hd, c.dim) for _ in range(c.num_layers))
        self.ffn = nn.ModuleList(
            nn.Sequential(nn.Linear(c.dim, c.ffn), nn.GELU(), nn.Linear(c.ffn, c.dim)) for _ in range(c.num_layers)
        )
        self.text_embed = nn.Embedding(c.vocab, c.dim)
        self.text_mlp = nn.Sequential(nn.Linear(c.dim, c.dim), nn.GELU(), nn.Linear(c.dim, c.dim))
        for m in self.ada:  # small modulation, as adaLN-zero-like init keeps activations tame
            nn.init.normal_(m.weight, std=0.02)

    # -- text encoder + per-layer text K/V (what FeatureCache stores) ---------------------
    def text_kv(self, prompt: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """prompt ids ``[text_len]`` -> per layer (k, v), each ``[text_len, H, D]``."""
        c = self.cfg
        e = self.text_mlp(self.text_embed(prompt))
        out = []
        for layer in range(c.num_layers):
            k, v = self.cross_kv[layer](e).view(-1, 2, c.num_heads, c.head_dim).unbind(1)
            out.append((k, v))
        return tuple(out)

    # -- one layer, split so that DBCache can stop after the first block -----------------
    def block(self, layer: int, h: torch.Tensor, temb: torch.Tensor, pos: torch.Tensor, text, attn_fn) -> torch.Tensor:
        """h ``[B, T, dim]``, temb ``[B, T, dim]``, pos ``[B, T]``, text: per-row (k, v) ``[B, S, H, D]``."""
        c = self.cfg
        b, t, _ = h.shape
        sh1, sc1, g1, sh2, sc2, g2 = self.ada[layer](temb).chunk(6, dim=-1)
        x = rms_norm(h) * (1 + sc1) + sh1
        q, k, v = self.qkv[layer](x).view(b, t, 3, c.num_heads, c.head_dim).unbind(2)
        cos, sin = rope_tables(pos.reshape(-1), c.head_dim, c.rope_base)
        q = apply_rope(q.reshape(b * t, c.num_heads, c.head_dim), cos, sin).view(b, t, c.num_heads, c.head_dim)
        k = apply_rope(k.reshape(b * t, c.num_heads, c.head_dim), cos, sin).view(b, t, c.num_heads, c.head_dim)
        o = attn_fn(layer, q, k, v)  # [B, T, H, D]
        h = h + g1 * self.proj[layer](o.reshape(b, t, -1))
        # text cross-attention (full, no mask)
        tq = self.cross_q[layer](rms_norm(h)).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        tk, tv = text[layer]
        co = F.scaled_dot_product_attention(tq, tk.transpose(1, 2), tv.transpose(1, 2))
        h = h + self.cross_o[layer](co.transpose(1, 2).reshape(b, t, -1))
        x = rms_norm(h) * (1 + sc2) + sh2
        return h + g2 * self.ffn[layer](x)

    def embed(self, x: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[B, T, C]``, sigma ``[B, T]`` -> (h, temb), both ``[B, T, dim]``."""
        temb = _timestep_embedding(sigma, self.cfg.dim).to(x.dtype)
        return self.patch_in(x), self.t_mlp(temb)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.patch_out(rms_norm(h))


def sink_window_mask(cfg: DiTConfig, n_chunks: int, sink_frames: int, window_frames: int, device) -> torch.Tensor:
    """Boolean ``[N, N]`` over the tokens of chunks ``0..n_chunks-1``: a query of the chunk
    ending at token ``e`` sees key ``t`` iff ``t < e`` and (``t < S`` or ``t >= e - W``), with
    ``S``, ``W`` the sink and window frames in tokens."""
    s, w = sink_frames * cfg.frame_tokens, window_frames * cfg.frame_tokens
    ends = torch.cat([torch.full((cfg.chunk_len(c),), cfg.chunk_start(c) + cfg.chunk_len(c), device=device)
                      for c in range(n_chunks)])
    e, t = ends[:, None], torch.arange(ends.shape[0], device=device)[None, :]
    return (t < e) & ((t < s) | (t >= e - w))


def dense_forward(model: TinyCausalDiT, x: torch.Tensor, sigma: torch.Tensor, text, mask: torch.Tensor,
                  *, detach_keys_before: int = 0) -> torch.Tensor:
    """The whole sequence ``x [1, N, C]`` through every layer with masked SDPA -> ``[1, N, C]``.

    ``detach_keys_before``: the K/V of tokens before it are constants to autograd (what a
    cached history is to a training step: computed earlier, under no_grad).
    """
    c = model.cfg
    n = x.shape[1]
    pos = torch.arange(n, device=x.device)[None]
    h, temb = model.embed(x, sigma)
    cut = detach_keys_before

    def attn(layer, q, k, v):
        if cut:
            k = torch.cat([k[:, :cut].detach(), k[:, cut:]], 1)
            v = torch.cat([v[:, :cut].detach(), v[:, cut:]], 1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double(), attn_mask=mask
        )
        return o.transpose(1, 2).to(q.dtype)

    for layer in range(c.num_layers):
        h = model.block(layer, h, temb, pos, text, attn)
    return model.head(h)
