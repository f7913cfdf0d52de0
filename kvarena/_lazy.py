"""Lazy public names (PEP 562): a package's ``__getattr__`` and ``__dir__``, made once here."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_names(package: str, exports: Mapping[str, str], namespace: dict,
               submodules: tuple[str, ...] = ()) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``exports`` (name -> module) is
    imported on first use and kept in ``namespace`` (the package's globals); a name of
    ``submodules`` is the submodule itself. ``__dir__`` lists the package's ``__all__``."""

    def __getattr__(name: str):
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(namespace["__all__"])

    return __getattr__, __dir__
