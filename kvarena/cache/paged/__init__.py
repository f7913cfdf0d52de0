"""The paged KV pool (AR decode): :class:`PagedKVCache` and its step metadata.

Rooms: ``pool`` (the pool: construction, namespaces, fork / truncate, accounting),
``table`` (the namespaces' records and the persistent device block table), ``planner``
(host planning of a step: what it needs, the window rules), ``build`` (the step's
metadata on the device), ``meta`` (:class:`PagedMetadata`, the CUDA-graph buffers),
``claim`` (the blocks a plan, a fork or a truncate takes and gives back), ``local`` (the
single-process plan / forward) and ``cp`` (decode context parallel, the steps a pool holds
under ``context_parallel=``).

Examples
--------
>>> import torch
>>> from kvarena import CachePolicy, KVLayout
>>> from kvarena.cache.paged import PagedKVCache
>>> layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
>>> pool = PagedKVCache(CachePolicy("paged_kv", max_bytes=1 << 14), layout=layout, block_size=4)
>>> meta = pool.plan({"req0": 6})                 # a 6-token prefill: two blocks
>>> pool.block_ids("req0") == pool.table[0, pool.table_row("req0"), :2].tolist()
True
"""

from kvarena.cache.paged.meta import PagedMetadata
from kvarena.cache.paged.pool import PagedKVCache

__all__ = ["PagedKVCache", "PagedMetadata"]
