"""A per-thread view of one cache-dit context manager's mutable slots.

cache-dit keeps a transformer's state on one ``CachedContextManager``: a dict of named
contexts and ONE current-context slot. Swapping the dict for a request's contexts would
be seen by every thread, so a pipeline wrapper resetting contexts on thread B during
thread A's call would write into A's request. The overlay gives the manager's three
slots a per-thread value while a thread is inside :meth:`ThreadOverlay.installed`, and
leaves them the manager's own everywhere else. It works by swapping the instance's class
for a subclass with data descriptors on those slots (undone by :meth:`ThreadOverlay.close`),
because cache-dit reads them as plain attributes from many places.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SLOTS = ("_current_context", "_cached_context_manager", "_current_step_refreshed")


class _Slot:
    """One manager attribute: the thread's view while installed, else the instance's own."""

    def __init__(self, name: str, local: threading.local) -> None:
        self.name = name
        self.local = local

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        view = getattr(self.local, "view", None)
        return view[self.name] if view is not None else obj.__dict__[self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        view = getattr(self.local, "view", None)
        if view is not None:
            view[self.name] = value
        else:
            obj.__dict__[self.name] = value


class ThreadOverlay:
    """Install per-thread slots on ``manager`` until :meth:`close`."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.original = type(manager)
        self.local = threading.local()
        slots = {name: _Slot(name, self.local) for name in SLOTS}
        view_cls = type(f"KVArenaScoped{self.original.__name__}", (self.original,), slots)
        manager.__class__ = view_cls

    def active(self) -> bool:
        """Whether this thread is inside :meth:`installed`."""
        return getattr(self.local, "view", None) is not None

    @contextmanager
    def installed(self, contexts: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Make ``contexts`` the manager's named contexts, for this thread only."""
        self.local.view = {
            "_current_context": None,
            "_cached_context_manager": contexts,
            "_current_step_refreshed": False,
        }
        try:
            yield contexts
        finally:
            self.local.view = None

    def close(self) -> None:
        """Give the manager its own class back (its own slots were never touched)."""
        self.manager.__class__ = self.original
