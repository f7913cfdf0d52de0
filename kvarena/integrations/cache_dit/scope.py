"""``CacheDiTScope``: one transformer's step-cache state per (request, branch), in a ResidualCache."""

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
from kvarena.integrations.cache_dit._diffusers_hooks import DiffusersStates, state_managers
from kvarena.integrations.cache_dit._overlay import MANAGER_SLOTS, ThreadOverlay

DEFAULT_BRANCH = "default"
# the module attributes the scope replaces while open (close() puts the old ones back)
_HOOKED = ("forward", "cache_context")


class CacheDiTScope:
    """Scope the step-cache state on ``module`` per (request, branch), stored in ``cache``.

    Parameters
    ----------
    module : torch.nn.Module
        A transformer on which ``cache_dit.enable_cache(module, ...)`` was called, and/or
        one with diffusers' own stateful cache hooks (``module.enable_cache(
        FirstBlockCacheConfig(...))``); both are scoped.
    cache : kvarena.ResidualCache
        Holds one entry per (request, branch, cache-dit context or diffusers hook state):
        namespace the request id, branch the branch, name ``"cache_dit:<context name>"`` or
        ``"diffusers:<i>:<state class>"``. Its ``max_bytes`` bounds all the scoped state; an
        evicted entry makes that request's branch start afresh (warmup, then caching again),
        never read another's.

    Notes
    -----
    Transformer calls through the scope run one at a time (cache-dit patches the
    transformer's block lists during each call, so concurrent calls were never safe);
    threads may interleave their requests call by call. Calls outside the scope see the
    module's own state, untouched.
    """

    def __init__(self, module: Any, cache: ResidualCache) -> None:
        cache = _checks.check_cache(cache)
        manager = _checks.check_module(module, has_diffusers_hooks=bool(state_managers(module)))
        names = list(module._context_names) if manager is not None else []
        self._templates = {name: template_of(manager, name) for name in names}
        hooks = DiffusersStates(module)  # refuses what it cannot store, before any change
        self._hooks = hooks
        self._overlay = ThreadOverlay(manager, MANAGER_SLOTS) if manager is not None else None
        self._module = module
        self._cache = cache
        self._lock = threading.RLock()
        self._local = threading.local()
        self._own_attrs = {k: module.__dict__[k] for k in _HOOKED if k in module.__dict__}
        self._install_hooks(module)
        setattr(module, _checks._SCOPED, self)

    # -- explicit branches --------------------------------------------------------------
    def call(self, request_id: str, branch: str) -> Any:
        """Run the transformer calls inside with ``(request_id, branch)``'s state.

        Parameters
        ----------
        request_id : str
            The request (the ``ResidualCache`` namespace).
        branch : str
            The CFG branch, explicit (``"cond"``, ``"uncond"``, ...): never inferred from
            call parity.

        Returns
        -------
        context manager

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
        return self._call(request_id, branch, {})

    @contextmanager
    def _call(self, request_id: str, branch: str, context_kwargs: dict) -> Iterator[None]:
        with self._lock:
            contexts = {name: self._load(request_id, branch, name) for name in self._templates}
            self._local.in_call = True
            try:
                with self._installed(contexts), self._hooks.installed(
                    self._cache, request_id, branch, context_kwargs
                ):
                    yield
            finally:
                self._local.in_call = False
            for name in self._templates:
                self._cache.put(request_id, branch, store_name(name), contexts[name])

    def _installed(self, contexts: dict[str, Any]) -> Any:
        if self._overlay is None:
            return _nothing()
        view = {"_current_context": None, "_cached_context_manager": contexts,
                "_current_step_refreshed": False}
        return self._overlay.installed(view)

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
            if request_id is None or getattr(scope._local, "in_call", False):
                return inner_forward(*args, **kwargs)
            stack = getattr(scope._local, "branches", None)
            branch, context_kwargs = stack[-1] if stack else (DEFAULT_BRANCH, {})
            with scope._call(request_id, branch, context_kwargs):
                return inner_forward(*args, **kwargs)

        @contextmanager
        def cache_context(name: str, **kwargs: Any) -> Iterator[None]:
            stack = scope._local.__dict__.setdefault("branches", [])
            stack.append((_checks.check_branch(name), kwargs))
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
            if self._overlay is not None:
                self._overlay.close()
            self._hooks.close()
            delattr(module, _checks._SCOPED)

    @property
    def closed(self) -> bool:
        """bool: whether :meth:`close` was called."""
        return self._module is None

    def _check_usable(self) -> None:
        if self._module is None:
            raise RuntimeError("kvarena: this CacheDiTScope is closed")
        if getattr(self._local, "in_call", False):
            raise RuntimeError("kvarena: this thread is already inside a scope.call; calls do not nest")


@contextmanager
def _nothing() -> Iterator[None]:
    yield
