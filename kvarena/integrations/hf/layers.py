"""``KVArenaCache.layers[i]``: one layer of the arena as transformers' cache layer."""

from __future__ import annotations


class _ArenaLayer:  # transformers' CacheLayerMixin is mixed in (see KVArenaCache.__init__)
    """``KVArenaCache.layers[i]``: layer ``i`` of the arena as transformers' cache layer.

    ``keys`` / ``values`` are gathered copies (the arena's blocks are not contiguous per
    row), ``[B, H_kv, get_seq_length(), D]`` in the model's dtype (fp8 storage dequantized),
    each row's stored tokens right-aligned as transformers' cache holds them; slots the
    arena does not hold (left padding, blocks released out of the window) are zeros; None
    before the first step. Rows belong to the whole cache: reorder / crop / reset it, not a
    layer (a layer's own call is a ``kvarena:`` NotImplementedError).
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache, layer_idx: int) -> None:  # the mixin's __init__ would set keys / values
        self._cache, self.layer_idx = cache, layer_idx

    def __repr__(self) -> str:
        return f"KVArenaLayer({self.layer_idx})"

    @property
    def keys(self):
        return self._cache._read(self.layer_idx, 0)

    @property
    def values(self):
        return self._cache._read(self.layer_idx, 1)

    @property
    def is_initialized(self) -> bool:
        return self._cache.is_initialized

    @property
    def device(self):
        return None if self._cache.pool is None else self._cache.pool.device

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def lazy_initialization(self, key_states, value_states) -> None:
        return None  # the arena is made at the first update, for every layer

    def _whole_cache(self, what: str):
        raise NotImplementedError(f"kvarena: {what} on one layer of a KVArenaCache is not supported (its rows are "
                                  f"shared by every layer): call it on the cache")

    def reset(self) -> None:
        self._whole_cache("reset()")

    def reorder_cache(self, beam_idx) -> None:
        self._whole_cache("reorder_cache")

    def crop(self, tokens_to_remove: int) -> None:
        self._whole_cache("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole_cache("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        self._whole_cache("batch_select_indices")

    def offload(self) -> None:
        self._whole_cache("offload")

    def prefetch(self) -> None:
        self._whole_cache("prefetch")
