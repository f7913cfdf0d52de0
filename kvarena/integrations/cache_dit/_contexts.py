"""What a (request, branch) holds of cache-dit: one ``CachedContext`` per context name.

A fresh context is built from the transformer's own context's init arguments with
``enable_separate_cfg=False``: the scope names the branch explicitly, so each branch gets
its own context and cache-dit must not tell cond from uncond by call parity inside it.
A call works on a :func:`working_copy`, so a call that raises leaves the stored context
as it was (cache-dit replaces tensors in a context, it never writes into them).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from kvarena.cache.residual import check_storable

KEY_PREFIX = "cache_dit:"


def store_name(context_name: str) -> str:
    """The ``ResidualCache`` entry name of one cache-dit context."""
    return KEY_PREFIX + context_name


@dataclasses.dataclass(frozen=True)
class Template:
    """How to build a fresh context of one name (the module's own config, no parity CFG)."""

    cls: type
    kwargs: dict[str, Any]

    def fresh(self) -> Any:
        kwargs = copy.deepcopy(self.kwargs)
        ctx = self.cls(**kwargs)
        ctx._init_args = ()  # what cache-dit's new_context records, for its own refresh
        ctx._init_kwargs = copy.deepcopy(self.kwargs)
        return ctx


def template_of(manager: Any, name: str) -> Template:
    """The template of context ``name``; ``ValueError`` for state the store cannot hold."""
    ctx = manager.get_context(name)
    kwargs = copy.deepcopy(getattr(ctx, "_init_kwargs", None) or {})
    kwargs["name"] = name
    if kwargs.get("cache_config") is None:
        kwargs["cache_config"] = copy.deepcopy(ctx.cache_config)
    kwargs["cache_config"].enable_separate_cfg = False
    template = Template(type(ctx), kwargs)
    try:
        check_storable(template.fresh())
    except TypeError as exc:
        raise ValueError(
            f"kvarena: module: cache-dit context {name!r} holds state a ResidualCache cannot "
            f"store or count ({exc}); calibrators (TaylorSeer, FoCa, DMD) keep tensors in "
            "plain objects: enable cache-dit without calibrator_config to scope it"
        ) from None
    return template


def working_copy(ctx: Any) -> Any:
    """A copy of ``ctx`` whose containers are its own; tensors are shared, not copied."""
    new = copy.copy(ctx)
    for field in dataclasses.fields(ctx):
        value = getattr(ctx, field.name)
        if isinstance(value, (dict, list)):
            object.__setattr__(new, field.name, copy.copy(value))
    return new
