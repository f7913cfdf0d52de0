"""An independent statement of Self-Forcing's causal inference on a diffusers Wan (tests only).

Self-Forcing's ``CausalWanModel`` with its rolling ``kv_cache`` gives chunk ``j`` (frames
``[s_j, e_j)``, ``fs`` tokens a frame) the keys ``t < S`` or ``E - (C - S) <= t < E`` with
``E = e_j * fs``, ``S = sink_size * fs``, ``C = local_attn_size * fs`` (everything before
``E`` when ``local_attn_size == -1``), the committed keys being those of the chunks' clean
passes. Stated without a cache: one full-sequence call of the same transformer on the
concatenated frames (the earlier chunks' clean latents at their clean-pass timestep, the
current chunk's input at its own: diffusers' per-token timestep), RoPE by absolute frame
index (diffusers numbers the whole sequence's frames ``0 .. F-1``), and self-attention
under the explicit boolean mask of that rule, in plain torch. Its last chunk's output is
what the rollout must return for the same call.
"""

from __future__ import annotations

import copy
import math

import torch


def chunk_bounds(frames: list[int]) -> list[tuple[int, int]]:
    """``[(s_j, e_j)]`` of consecutive chunks with these frame counts."""
    out, s = [], 0
    for f in frames:
        out.append((s, s + f))
        s += f
    return out


def causal_mask(frames: list[int], fs: int, local_attn_size: int, sink_size: int) -> torch.Tensor:
    """``[T, T]`` bool: query token (row) may attend key token (column)."""
    total = sum(frames) * fs
    allowed = torch.zeros(total, total, dtype=torch.bool)
    keys = torch.arange(total)
    s_tok, c_tok = sink_size * fs, local_attn_size * fs
    for s, e in chunk_bounds(frames):
        end = e * fs
        seen = keys < end
        if local_attn_size != -1:
            seen &= (keys < s_tok) | (keys >= end - (c_tok - s_tok))
        allowed[s * fs:end] = seen
    return allowed


class MaskedSelfAttention:
    """A ``WanAttention`` processor: full attention under ``self.mask`` (plain torch)."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        cos, sin = rotary_emb

        def rot(x):  # Wan's RoPE on interleaved pairs, written out
            x1, x2 = x[..., 0::2], x[..., 1::2]
            c, s_ = cos[..., 0::2], sin[..., 1::2]
            return torch.stack((x1 * c - x2 * s_, x1 * s_ + x2 * c), dim=-1).flatten(-2).to(x.dtype)

        q, k = rot(q), rot(k)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~self.mask, float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).flatten(2)
        return attn.to_out[1](attn.to_out[0](out))


class SelfForcingReference:
    """Self-Forcing's inference semantics on a private copy of a diffusers Wan."""

    def __init__(self, transformer, *, local_attn_size: int, sink_size: int, frame_tokens: int) -> None:
        self.model = copy.deepcopy(transformer)
        self.proc = MaskedSelfAttention()
        for block in self.model.blocks:
            block.attn1.set_processor(self.proc)
        self.local, self.sink, self.fs = local_attn_size, sink_size, frame_tokens
        self.clean: list[tuple[torch.Tensor, torch.Tensor]] = []  # per branch: committed latents, timesteps

    def __call__(self, history: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, t: torch.Tensor,
                 emb: torch.Tensor) -> torch.Tensor:
        """The output for chunk ``x [B, C, F, H, W]`` at timestep ``t [B]`` after the committed
        chunks ``history`` (each ``(clean latents, their clean-pass timestep [B])``)."""
        chunks = [*history, (x, t)]
        frames = [c.shape[2] for c, _ in chunks]
        lat = torch.cat([c for c, _ in chunks], dim=2)
        per_token = torch.cat([tt[:, None].expand(-1, c.shape[2] * self.fs) for c, tt in chunks], dim=1)
        self.proc.mask = causal_mask(frames, self.fs, self.local, self.sink)
        out = self.model(hidden_states=lat, timestep=per_token, encoder_hidden_states=emb, return_dict=False)[0]
        return out[:, :, -x.shape[2]:]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))
