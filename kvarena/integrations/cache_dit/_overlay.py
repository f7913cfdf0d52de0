"""A per-thread view of some mutable attributes ("slots") of one object.

cache-dit keeps a transformer's state on one ``CachedContextManager``: a dict of named
contexts and ONE current-context slot. Swapping the dict for a request's contexts would
be seen by every thread, so a pipeline wrapper resetting contexts on thread B during
thread A's call would write into A's request. The overlay gives the manager's
slots (and those of diffusers' hook ``StateManager`` objects, which have the same shape of
problem) a per-thread value while a thread is inside :meth:`ThreadOverlay.installed`, and
leaves them the object's own everywhere else. It works by swapping the instance's class
for a subclass with data descriptors on those slots (undone by :meth:`ThreadOverlay.close`),
because both libraries read them as plain attributes from many places.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: cache-dit's CachedContextManager: its named contexts and the current one
MANAGER_SLOTS = ("_current_context", "_cached_context_manager", "_current_step_refreshed")


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
    """Install per-thread ``slots`` on ``obj`` until :meth:`close`."""

    def __init__(self, obj: Any, slots: tuple[str, ...]) -> None:
        self.obj = obj
        self.slots = slots
        self.original = type(obj)
        self.local = threading.local()
        descriptors = {name: _Slot(name, self.local) for name in slots}
        obj.__class__ = type(f"KVArenaScoped{self.original.__name__}", (self.original,), descriptors)

    def active(self) -> bool:
        """Whether this thread is inside :meth:`installed`."""
        return getattr(self.local, "view", None) is not None

    @contextmanager
    def installed(self, view: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Give the slots the values in ``view`` (one per slot), for this thread only."""
        if set(view) != set(self.slots):
            raise ValueError(f"view must set exactly the slots {self.slots}, got {sorted(view)}")
        self.local.view = view
        try:
            yield view
        finally:
            self.local.view = None

    def close(self) -> None:
        """Give the object its own class back (its own slots were never touched)."""
        self.obj.__class__ = self.original
