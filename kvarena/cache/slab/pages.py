"""One layer's K and V of a slab region as pages of ``g`` rows, for the kernels' tables."""

from __future__ import annotations

from kvarena.attention.batch import CacheView
from kvarena.attention.fp8 import as_bytes
from kvarena.cache.arena import ArenaRegion

__all__ = ["page_views"]


def page_views(region: ArenaRegion, layer: int, g: int) -> CacheView:
    """Layer ``layer``'s K and V as pages of ``g`` rows (a divisor of the slab's tokens).

    ``g`` = the slab: the region's own per-layer views (page id = slot). Smaller: views of
    the whole arena region with a page stride of ``g`` rows, whose page
    ``slot * (2 * num_layers * slab_tokens / g) + i`` is rows ``i*g .. i*g+g-1`` of
    ``slot``'s slab at this layer; pages between two slabs' layer rows belong to other
    layers and are never listed. No byte moves; pages never overlap. fp8 per-token scales
    get the same page views of the region's scale section (None for a float layout).
    """
    if g == region.block_tokens:
        return region.op_views(layer)
    lay = region.layout
    st, h, d = region.block_tokens, lay.num_kv_heads, lay.head_dim
    n_pages = (region.num_blocks - 1) * (2 * lay.num_layers * st // g) + st // g

    def pages(t, e):  # t: [slots, L, 2, st, H(, D)] contiguous; e elements per (token, head)
        size, stride = (n_pages, g, h, e)[: t.dim() - 2], (g * h * e, h * e, e, 1)[: t.dim() - 2]
        base = t.storage_offset() + layer * 2 * st * h * e
        return t.as_strided(size, stride, base), t.as_strided(size, stride, base + st * h * e)

    k, v = pages(region.data, d)
    scales = region.op_views(layer).scales
    if lay.is_fp8:  # as the ops take them (region.op_views): uint8 views
        k, v = as_bytes(k), as_bytes(v)
        if region.scales is not None:
            scales = tuple(as_bytes(x) for x in pages(region.scales, 1))
    return CacheView(k, v, scales)
