"""Adapters that put kvarena under other code bases' model calls.

Each adapter is a submodule, imported on demand; importing this package imports nothing
heavy (no transformers, no diffusers):

* :mod:`kvarena.integrations.causal_wan`: slab KV for causal Wan-style video DiTs
  (Self-Forcing, CausVid, LongLive), where the model passes per-block ``kv_cache`` objects
  and a token offset ``current_start`` to its self-attention.
* :mod:`kvarena.integrations.hf`: ``attn_implementation="kvarena"`` for Hugging Face
  transformers decoders, and :class:`~kvarena.integrations.hf.KVArenaCache`.
* :mod:`kvarena.integrations.diffusers`: Self-Forcing-style causal rollouts of diffusers'
  ``WanTransformer3DModel`` on the slab cache.
* :mod:`kvarena.integrations.cache_dit`: cache-dit's step caches scoped per request and per
  CFG branch, their state stored in a :class:`~kvarena.ResidualCache`.
"""

__all__: list[str] = []
