"""``CacheDiTScope``: one transformer's cache-dit state per (request, branch), in a ResidualCache."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    import cache_dit  # noqa: F401 - the scope wraps what cache_dit.enable_cache installed
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvarena.integrations.cache_dit needs cache-dit: pip install 'kvarena[cache-dit]'"
    ) from exc

from kvarena.cache.residual import ResidualCache
from kvarena.integrations.cache_dit import _checks
from kvarena.integrations.cache_dit._contexts import store_name, template_of, working_copy
from kvarena.integrations.cache_dit._overlay import ThreadOverlay

DEFAULT_BRANCH = "default"
# the module attributes the scope replaces while open (close() puts the old ones back)
_HOOKED = ("forward", "cache_context")


class CacheDiTScope:
    """Scope cache-dit's state on ``module`` per (request, branch), stored in ``cache``.

    Parameters
    ----------
    module : torch.nn.Module
        A transformer on which ``cache_dit.enable_cache(module, ...)`` was called.
    cache : kvarena.ResidualCache
        Holds one entry per (request, branch, cache-dit context): namespace the request id,
        branch the branch, name ``"cache_dit:<context name>"``. Its ``max_bytes`` bounds all
        the scoped state; an evicted entry makes that request's branch start afresh (warmup,
        then caching again), never read another's residuals.

    Notes
    -----
    Transformer calls through the scope run one at a time (cache-dit patches the
    transformer's block lists during each call, so concurrent calls were never safe);
    threads may interleave their requests call by call. Calls outside the scope see the
    module's own cache-dit state, untouched.
    """

    def __init__(self, module: Any, cache: ResidualCache) -> None:
        cache = _checks.check_cache(cache)
        manager = _checks.check_module(module)
        names = list(module._context_names)
        self._templates = {name: template_of(manager, name) for name in names}
        self._module = module
        self._cache = cache
        self._lock = threading.RLock()
        self._local = threading.local()
        self._overlay = ThreadOverlay(manager)
        self._own_attrs = {k: module.__dict__[k] for k in _HOOKED if k in module.__dict__}
        self._install_hooks(module)
        setattr(module, _checks._SCOPED, self)

    # -- explicit branches --------------------------------------------------------------
    @contextmanager
    def call(self, request_id: str, branch: str) -> Iterator[None]:
        """Run the transformer calls inside with ``(request_id, branch)``'s cache-dit state.

        Parameters
        ----------
        request_id : str
            The request (the ``ResidualCache`` namespace).
        branch : str
            The CFG branch, explicit (``"cond"``, ``"uncond"``, ...): never inferred from
            call parity.

        Raises
        ------
        TypeError
            A bad ``request_id`` or ``branch``.
        RuntimeError
            The scope is closed, or this thread is already inside a call.

        Notes
        -----
        A body that raises leaves the stored state as it was before the call.
        """
        _checks.check_request_id(request_id)
        _checks.check_branch(branch)
        self._check_usable()
        with self._lock:
            contexts = {name: self._load(request_id, branch, name) for name in self._templates}
            with self._overlay.installed(contexts):
                yield
            for name in self._templates:
                self._cache.put(request_id, branch, store_name(name), contexts[name])

    def _load(self, request_id: str, branch: str, name: str) -> Any:
        stored = self._cache.get(request_id, branch, store_name(name))
        return self._templates[name].fresh() if stored is None else working_copy(stored)

    # -- branches from diffusers' cache_context -----------------------------------------
    @contextmanager
    def request(self, request_id: str) -> Iterator[None]:
        """Scope every transformer call of this thread inside to ``request_id``.

        Each call's branch is the name of the innermost ``module.cache_context(name)`` this
        thread entered (diffusers' Wan and Flux pipelines use ``"cond"`` / ``"uncond"``),
        or ``"default"`` outside one. Read per thread: diffusers keeps one slot per module.
        """
        _checks.check_request_id(request_id)
        self._check_usable()
        if getattr(self._local, "request", None) is not None:
            raise RuntimeError(
                f"kvarena: request_id: this thread is already inside request "
                f"{self._local.request!r}; requests do not nest"
            )
        self._local.request = request_id
        try:
            yield
        finally:
            self._local.request = None

    def _install_hooks(self, module: Any) -> None:
        scope, inner_forward, inner_context = self, module.forward, module.cache_context

        def forward(*args: Any, **kwargs: Any) -> Any:
            request_id = getattr(scope._local, "request", None)
            if request_id is None or scope._overlay.active():
                return inner_forward(*args, **kwargs)
            names = getattr(scope._local, "branches", None)
            with scope.call(request_id, names[-1] if names else DEFAULT_BRANCH):
                return inner_forward(*args, **kwargs)

        @contextmanager
        def cache_context(name: str, **kwargs: Any) -> Iterator[None]:
            stack = scope._local.__dict__.setdefault("branches", [])
            stack.append(name)
            try:
                with inner_context(name, **kwargs):
                    yield
            finally:
                stack.pop()

        module.forward = forward
        module.cache_context = cache_context

    # -- lifetime -------------------------------------------------------------------------
    def end_request(self, request_id: str) -> int:
        """Drop every entry of ``request_id`` (all branches); return how many were dropped."""
        _checks.check_request_id(request_id)
        with self._lock:
            return self._cache.clear_namespace(request_id)

    def close(self) -> None:
        """Restore the module as it was; the entries stay in the cache (see :meth:`end_request`)."""
        with self._lock:
            if self._module is None:
                return
            module, self._module = self._module, None
            for name in _HOOKED:
                module.__dict__.pop(name, None)
            module.__dict__.update(self._own_attrs)
            self._overlay.close()
            delattr(module, _checks._SCOPED)

    @property
    def closed(self) -> bool:
        """bool: whether :meth:`close` was called."""
        return self._module is None

    def _check_usable(self) -> None:
        if self._module is None:
            raise RuntimeError("kvarena: this CacheDiTScope is closed")
        if self._overlay.active():
            raise RuntimeError("kvarena: this thread is already inside a scope.call; calls do not nest")
