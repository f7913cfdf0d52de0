"""diffusers' own stateful cache hooks (FirstBlockCache, MagCache, ...) per (request, branch).

diffusers keeps each hook's state in a ``StateManager``: one state object per cache-context
name, and ONE current-context slot per manager, set by ``module.cache_context(name)``; and
``DiffusionPipeline.maybe_free_model_hooks`` resets every state at the end of each pipeline
call. For one scoped call this module gives every manager, on the calling thread only, a
state dict holding just the (request, branch)'s state and that context; after the call the
state's attributes go to the ``ResidualCache`` (one entry per manager), so the budget counts
them, eviction drops them whole, and a reset by another pipeline call finds nothing of ours.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from kvarena.cache.residual import check_storable
from kvarena.integrations.cache_dit._overlay import ThreadOverlay

_SLOTS = ("_state_cache", "_context")


def state_managers(module: Any) -> list[Any]:
    """The distinct ``StateManager`` objects of the stateful hooks on ``module`` and below."""
    from diffusers.hooks.hooks import StateManager

    registry = getattr(module, "_diffusers_hook", None)
    if registry is None:
        return []
    found: dict[int, Any] = {}
    for child in (registry, *registry._get_child_registries()):
        for hook_name in child._hook_order:
            hook = child.hooks[hook_name]
            if getattr(hook, "_is_stateful", False):
                for value in vars(hook).values():
                    if isinstance(value, StateManager):
                        found.setdefault(id(value), value)
    return list(found.values())


def _copied(attrs: dict[str, Any]) -> dict[str, Any]:
    """``attrs`` with its containers copied one level: a hook appending to a list in the
    state of a call that then raises must not reach the stored state."""
    return {k: copy.copy(v) if isinstance(v, (list, dict)) else v for k, v in attrs.items()}


def _rebuild(cls: type, attrs: dict[str, Any]) -> Any:
    """A state object of ``cls`` with the stored attributes (its ``__init__`` is not run)."""
    state = cls.__new__(cls)
    state.__dict__.update(_copied(attrs))
    return state


class DiffusersStates:
    """The stateful diffusers hooks of one module, scoped per call (see the module docstring)."""

    def __init__(self, module: Any) -> None:
        self.managers = state_managers(module)
        for i, manager in enumerate(self.managers):
            fresh = manager._state_cls(*manager._init_args, **manager._init_kwargs)
            try:
                check_storable(_copied(vars(fresh)))
            except TypeError as exc:
                raise ValueError(
                    f"kvarena: module: diffusers hook state {type(fresh).__name__} (manager {i}) "
                    f"holds what a ResidualCache cannot store or count ({exc})"
                ) from None
        self.overlays = [ThreadOverlay(m, _SLOTS) for m in self.managers]

    def names(self) -> list[str]:
        return [f"diffusers:{i}:{m._state_cls.__name__}" for i, m in enumerate(self.managers)]

    @contextlib.contextmanager
    def installed(self, cache: Any, request_id: str, branch: str, context_kwargs: dict) -> Iterator[None]:
        """Give each manager this (request, branch)'s state for the call; store it on success."""
        from diffusers.hooks.hooks import CacheContext

        states = []
        with contextlib.ExitStack() as stack:
            for name, manager, overlay in zip(self.names(), self.managers, self.overlays):
                stored = cache.get(request_id, branch, name)
                own = {} if stored is None else {branch: _rebuild(manager._state_cls, stored)}
                ctx = CacheContext(branch, **context_kwargs)
                stack.enter_context(overlay.installed({"_state_cache": own, "_context": ctx}))
                states.append((name, own))
            yield
        for name, own in states:
            if branch in own:
                cache.put(request_id, branch, name, _copied(vars(own[branch])))

    def close(self) -> None:
        for overlay in self.overlays:
            overlay.close()
