"""Argument checks of :class:`~kvarena.integrations.cache_dit.CacheDiTScope`: one home per rule.

Every refusal is raised before anything changes and names the argument.
"""

from __future__ import annotations

from typing import Any

import torch

from kvarena.cache.residual import ResidualCache

_SCOPED = "_kvarena_cache_dit_scope"


def check_cache(cache: Any) -> ResidualCache:
    if not isinstance(cache, ResidualCache):
        raise TypeError(
            f"kvarena: cache must be a kvarena.ResidualCache (its max_bytes bounds all cache-dit "
            f"state), got {type(cache).__qualname__}"
        )
    return cache


def check_module(module: Any, has_diffusers_hooks: bool) -> Any:
    """cache-dit's context manager on ``module`` (``None`` when only diffusers' hooks are)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            "kvarena: module must be the torch.nn.Module transformer that "
            f"cache_dit.enable_cache(transformer, ...) was called on, got {type(module).__qualname__}"
        )
    if getattr(module, _SCOPED, None) is not None:
        raise ValueError("kvarena: module already has an open CacheDiTScope; close() it first")
    manager = getattr(module, "_context_manager", None)
    names = getattr(module, "_context_names", None)
    if manager is None or not names or not getattr(module, "_is_cached", False):
        if has_diffusers_hooks:
            return None
        raise ValueError(
            f"kvarena: module: cache-dit is not enabled on this {type(module).__name__} (nor a "
            "stateful diffusers cache hook); call cache_dit.enable_cache(module, cache_config=...) first"
        )
    if not getattr(manager, "persistent_context", False):
        raise ValueError(
            "kvarena: module: cache-dit was enabled through a pipeline, whose wrapper (installed "
            "on the pipeline class) resets the shared contexts at every pipeline call; enable it "
            "on the transformer instead: cache_dit.enable_cache(pipe.transformer, ...)"
        )
    return manager


def check_request_id(request_id: Any) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise TypeError(
            f"kvarena: request_id must be a non-empty str, got {type(request_id).__qualname__} "
            f"{request_id!r}"
        )
    return request_id


def check_branch(branch: Any) -> str:
    if not isinstance(branch, str) or not branch:
        raise TypeError(
            "kvarena: branch must be a non-empty str naming the CFG branch (e.g. 'cond', "
            f"'uncond'), got {type(branch).__qualname__} {branch!r}"
        )
    return branch
