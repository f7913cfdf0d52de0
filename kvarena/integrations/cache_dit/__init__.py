"""cache-dit's step caches scoped per request and per CFG branch, stored in a ``ResidualCache``.

cache-dit keeps a transformer's residuals, step counters and calibrators on one context
manager with one current-context slot and tells CFG branches apart by call parity, so two
interleaved requests corrupt each other. :class:`CacheDiTScope` gives every (request,
branch) its own cache-dit contexts, stored in a :class:`kvarena.ResidualCache` whose byte
budget bounds them; diffusers' own stateful cache hooks (FirstBlockCache, ...) on the module
are scoped the same way. See docs/cache-dit.md.

Importing this package imports cache-dit (``pip install 'kvarena[cache-dit]'``);
``import kvarena`` never does.
"""

from kvarena.integrations.cache_dit.scope import CacheDiTScope

__all__ = ["CacheDiTScope"]
