"""Slab KV cache for chunked video-DiT / world-model rollouts, recycled in place.

One *slab* holds one chunk's K/V for every layer: a block of ``slab_tokens`` tokens of
an arena region, ``[num_layers, 2, slab_tokens, H_kv, D]``. Per namespace (a rollout,
one CFG branch, one expert) the pool keeps a logical slab table of the chunks that a
query can still see.

Visibility is a rule on logical tokens (``t`` counts from the rollout's first token; only
chunk 0 may be short, stored right-aligned): a query of the chunk covering ``[s, e)``
sees ``t < e`` with ``t < S`` (sinks) or ``t >= e - W`` (window), ``S`` and ``W`` given in
tokens (``sink_tokens`` / ``window_tokens``) or in whole chunks (``sinks`` / ``window``).
Inside a chunk attention is full (block-causal overall). A slab holding a sink token is
kept forever; a new chunk takes over, in place, the slab of a chunk no later query can
see, so no retained byte moves and a rollout's memory is flat once its window is full.
The kernels read each chunk's visible tokens as ``[kv_start, seq_len)`` of a list of
pages (whole slabs, or equal slices of them where a sink/window edge falls inside one).

Per denoising step, one :meth:`SlabKVCache.plan` for a batch of rollouts returns
:class:`SlabMetadata` reused by every layer; :meth:`SlabKVCache.forward` then either
commits the chunk's clean K/V and attends (``commit=True``), or attends over the cached
history plus the given K/V, merged by log-sum-exp, writing nothing (``commit=False``,
differentiable w.r.t. q, k, v).

Commit bookkeeping (host only, so ``forward`` never syncs): a chunk counts as committed
*at a layer* once ``forward(commit=True)`` (or ``append``) wrote it at that layer;
attending to a history chunk not committed at the layer being run raises.

>>> import torch
>>> from kvarena import CachePolicy, KVLayout
>>> from kvarena.cache.slab import SlabKVCache
>>> layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
>>> pool = SlabKVCache(CachePolicy("slab_kv", max_bytes=1 << 16, per_component={"window": 2, "sinks": 1}),
...                    layout=layout, slab_tokens=4)
>>> for c in range(4):
...     kv = torch.randn(1, 4, 1, 8)
...     _ = pool.forward(torch.randn(1, 4, 1, 8), kv, kv, pool.plan({"video": c}), 0)
>>> pool.chunk_indices("video"), pool.visible_chunks(3)     # the sink, then the window
([0, 2, 3], [0, 2, 3])

Rooms: :mod:`~kvarena.cache.slab.visibility` (the rule), :mod:`~kvarena.cache.slab.planner`
(a batch entry checked and walked), :mod:`~kvarena.cache.slab.claim` (slabs claimed),
:mod:`~kvarena.cache.slab.meta` (the step's metadata and seam objects),
:mod:`~kvarena.cache.slab.pool` (the pool and its public seam),
:mod:`~kvarena.cache.slab.local` (the single-process plan / forward),
:mod:`~kvarena.cache.slab.cp` (context parallel, wrapping it), :mod:`~kvarena.cache.slab.compat` (``append`` / ``get``),
:mod:`~kvarena.cache.slab.rollback` (``snapshot`` / ``restore``).
"""

from kvarena.cache.slab.meta import RopeKeys, SlabKeys, SlabMetadata
from kvarena.cache.slab.pool import SlabKVCache
from kvarena.cache.slab.records import ChunkInfo, RolloutInfo, Slab, SlabSnapshot

__all__ = ["ChunkInfo", "RolloutInfo", "RopeKeys", "Slab", "SlabKVCache", "SlabKeys", "SlabMetadata", "SlabSnapshot"]
