"""The shift-left copy window of Self-Forcing / LongLive: the recycling benchmark's baseline.

Self-Forcing and LongLive keep, per layer, one fixed-size K buffer and one V buffer of
``(sinks + window) * chunk`` tokens. Until the buffer is full a chunk is written at the
end of what is there. Once it is full, every new chunk first shifts the retained non-sink
tokens left by one chunk, ``buf[:, s:s+r] = buf[:, s+c:s+c+r].clone()`` (a clone because
source and destination overlap), and then writes the new chunk into the freed tail. So
after the window fills, each chunk moves ``(window - 1) * chunk`` retained tokens of K and
of V, twice (into the clone, then back), in every layer. :class:`ShiftLeftKVCache`
implements that scheme here (written for this benchmark, not copied).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ShiftLeftKVCache"]


class ShiftLeftKVCache:
    """The copy-based sliding window of Self-Forcing / LongLive (the baseline).

    Parameters
    ----------
    num_layers, batch, chunk_tokens : int
    window : int
        Chunks attended and kept, the newest included.
    sinks : int
        Leading chunks kept forever.
    num_kv_heads, head_dim : int
    dtype, device : torch dtype and device of the buffers.

    Attributes
    ----------
    k, v : list of Tensor
        Per layer, ``[batch, (sinks + window) * chunk_tokens, H_kv, D]``.
    end : list of int
        Per layer, tokens currently held (Self-Forcing's ``local_end_index``).
    """

    def __init__(self, num_layers: int, batch: int, chunk_tokens: int, *, window: int, sinks: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 sink_tokens: int | None = None, window_tokens: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window: expected >= 1, got {window}")
        self.chunk = chunk_tokens
        self.window, self.sinks = window, sinks
        # Token counts (Self-Forcing's sink_size * frame_seqlen and local_attn_size * frame_seqlen
        # - sink): the buffer holds S + W tokens and rolls token by token.
        self.sink_tokens = sinks * chunk_tokens if sink_tokens is None else sink_tokens
        self.capacity = self.sink_tokens + (window * chunk_tokens if window_tokens is None else window_tokens)
        shape = (batch, self.capacity, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.end = [0] * num_layers

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the K and V buffers of all layers."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def transient_bytes(self) -> int:
        """The largest temporary a shift allocates: one ``.clone()`` of the rolled tokens."""
        buf = self.k[0]
        rolled = max(0, self.capacity - self.sink_tokens - self.chunk)
        return rolled * buf.shape[0] * buf.shape[2] * buf.shape[3] * buf.element_size()

    def store(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> None:
        """Append one chunk ``k, v [B, T, H_kv, D]`` to ``layer``, shifting when full."""
        n = k.shape[1]
        end = self.end[layer]
        sink = self.sink_tokens
        if end + n > self.capacity:
            evicted = end + n - self.capacity
            rolled = end - evicted - sink
            for buf in (self.k[layer], self.v[layer]):
                # Overlapping ranges: the clone is what makes the shift well defined.
                buf[:, sink:sink + rolled] = buf[:, sink + evicted:sink + evicted + rolled].clone()
            end -= evicted
        self.k[layer][:, end:end + n] = k
        self.v[layer][:, end:end + n] = v
        self.end[layer] = end + n

    def attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Full attention of ``q [B, T, H_q, D]`` over what ``layer`` holds; ``[B, T, H_q, D]``."""
        end = self.end[layer]
        kk = self.k[layer][:, :end].transpose(1, 2)
        vv = self.v[layer][:, :end].transpose(1, 2)
        gqa = q.shape[2] != kk.shape[1]
        return F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, enable_gqa=gqa).transpose(1, 2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """Store the chunk's K/V, then attend (the clean, committing pass)."""
        self.store(k, v, layer)
        return self.attend(q, layer)
