"""Cache layer: keys and policies, dict caches (feature, residual), KV pools, handle.

Submodules are imported on demand (``kvarena.cache.keys``, ``.feature``,
``.residual``, ``.handle``, and the KV pools ``.arena``, ``.slab``, ``.paged``);
this package module imports nothing, so loading one pool never pulls in the others.
The public names are re-exported lazily from the top-level ``kvarena`` package.
"""
