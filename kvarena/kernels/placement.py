"""Where a launch's own keys sit: ``own_k`` / ``own_v``, tensors given beside the cache.

The ``placement`` of :func:`kvarena.kernels.paged_attention_bwd.paged_attention_bwd` and
the ``mode`` argument of the ``kvarena::attention_train`` ops. Imports nothing (no
triton), so the attention ops read it when they are imported.
"""

from __future__ import annotations

__all__ = ["OWN_AT_QUERIES", "OWN_AFTER_HISTORY"]

#: The query rows' own keys ``[total_q, H_kv, D]``: key i of sequence b at position
#: ``L - q_len + i``, stored in the cache too (where a forward reads them).
OWN_AT_QUERIES = 0
#: ``[B, T, H_kv, D]``: T keys per sequence after its history, visible to every query.
OWN_AFTER_HISTORY = 1
