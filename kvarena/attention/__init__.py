"""Public attention ops (validation + dispatch) and the plain-PyTorch reference."""

from kvarena.attention import reference
from kvarena.attention.ops import merge_attention_states, paged_attention, store_kv
from kvarena.attention.spec import AttentionSpec

__all__ = ["AttentionSpec", "paged_attention", "store_kv", "merge_attention_states", "reference"]
