"""The ``cache_pools.py`` API of a slab pool: whole chunks in (:meth:`append`) and out
(:meth:`get`), and :meth:`clear_namespace`."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from kvarena.attention.fp8 import dequantize_fp8, fp8_row_scales, quantize_fp8
from kvarena.cache._meta import check_forward_tensor
from kvarena.cache.arena import KVLayout, _check_int
from kvarena.cache.slab.claim import reserve
from kvarena.cache.slab.records import Slab, _Chunk

__all__ = ["SlabCompat"]


def _check_slab_kv(slab) -> None:
    if not isinstance(slab, Slab):
        raise TypeError(f"slab: expected a Slab, got {type(slab).__name__}")
    k, v = slab.k, slab.v
    for name, x in (("slab.k", k), ("slab.v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a [num_layers, T, H_kv, D] tensor, got {shape}")
    if v.shape != k.shape:
        raise ValueError(f"slab.v: expected slab.k's shape {tuple(k.shape)}, got {tuple(v.shape)}")


class SlabCompat:
    """The ``append`` / ``get`` / ``clear_namespace`` part of :class:`~kvarena.cache.slab.SlabKVCache`."""

    def append(self, namespace: Hashable, slab: Slab) -> None:
        """Store a whole chunk (all layers) in one call: ``plan`` + write every layer.

        Parameters
        ----------
        namespace : hashable
        slab : Slab
            ``k, v [num_layers, T, H_kv, D]``; the first append of a pool made from a
            policy alone creates the arena from it.

        Raises
        ------
        CacheFullError, ValueError, TypeError
            As :meth:`plan`, or K/V not matching the layout; nothing changed.
        """
        _check_slab_kv(slab)
        k, v = slab.k, slab.v
        t = int(k.shape[1])
        with self._lock:
            fresh = self._region is None
            prev_st = self.slab_tokens
            try:
                if fresh:
                    st = self.slab_tokens if self.slab_tokens is not None else t
                    self._materialize(KVLayout.from_kv(k), st, k.device if self._device_arg is None else self._device_arg)
                lay = self.layout
                shape = (lay.num_layers, t, lay.num_kv_heads, lay.head_dim)
                for name, x in (("slab.k", k), ("slab.v", v)):
                    check_forward_tensor(name, x, shape, lay.input_dtype, self.device,
                                         "[num_layers, T, H_kv, D] of the layout")
                res = reserve(self, {namespace: (_check_int("slab.chunk_index", slab.chunk_index, 0), t)})
            except BaseException:
                if fresh:  # a failed first append leaves the pool as it was: no arena
                    self.arena = self._region = self.layout = None
                    self.slab_tokens = prev_st
                    self._specs = ()
                raise
            ch = res.runs[0].run[0]
            self._write_chunk(ch, k, v, t)
            ch.committed = [True] * lay.num_layers

    def _write_chunk(self, ch: _Chunk, k, v, t: int) -> None:
        """Every layer of ``k, v [L, t, H, D]`` into ``ch``'s slab (right-aligned)."""
        lay, st, region = self.layout, self.slab_tokens, self._region
        data = region.data[ch.slot]  # [L, 2, st, H, D]
        with torch.no_grad():
            for j, x in ((0, k), (1, v)):
                if lay.is_fp8:
                    # The store's quantization rule (bit-equal to the kernels'), all layers at once.
                    if region.scales is not None:
                        sc = fp8_row_scales(x)  # [L, t, H]
                        region.scales[ch.slot, :, j, st - t :].copy_(sc)
                    else:
                        sc = torch.stack([region.kv_scales(i)[j] for i in range(lay.num_layers)])
                        sc = sc[:, None, None].expand(x.shape[:3])
                    x = quantize_fp8(x, sc)
                data[:, j, st - t :].copy_(x)

    def get(self, namespace: Hashable) -> list[Slab]:
        """The namespace's chunks committed at every layer, in logical order.

        Returns
        -------
        list of Slab
            Sinks, then the oldest to the newest chunk; ``k, v [num_layers, n, H_kv, D]``
            are views into the arena of the chunk's ``n`` real tokens (fp8 layouts:
            dequantized copies in the layout's ``input_dtype``). ``[]`` for an unknown
            namespace.
        """
        with self._lock:
            r = self._rollouts.get(namespace)
            if r is None or self._region is None:
                return []
            return [Slab(i, self._read_chunk(ch, 0), self._read_chunk(ch, 1))
                    for i, ch in r.chunks.items() if all(ch.committed)]

    def _read_chunk(self, ch: _Chunk, j: int):
        """``[L, n, H, D]`` of K (``j = 0``) or V (``j = 1``) of ``ch``."""
        st, region, lay = self.slab_tokens, self._region, self.layout
        x = region.data[ch.slot, :, j, st - ch.n_tokens :]
        if not lay.is_fp8:
            return x
        if region.scales is not None:
            sc = region.scales[ch.slot, :, j, st - ch.n_tokens :]
        else:
            sc = torch.stack([region.kv_scales(i)[j] for i in range(lay.num_layers)])
            sc = sc[:, None, None].expand(x.shape[:3])
        # In fp32, then cast: an fp16 scale would underflow for rows below ~1e-5.
        return dequantize_fp8(x, sc, torch.float32).to(lay.input_dtype)

    def clear_namespace(self, namespace: Hashable) -> None:
        """Free every slab of ``namespace`` (unknown: no-op)."""
        with self._lock:
            r = self._rollouts.pop(namespace, None)
            self._steps.forget(namespace)
            if r is not None:
                self._stamp()
            if r is not None and (r.chunks or r.retired):
                self._region.allocator.decref(
                    [ch.slot for ch in sorted(r.chunks.values(), key=lambda c: -c.index)]
                    + [ch.slot for ch in r.retired.values()]
                )
