"""The route of an attention call, decided once, before anything runs.

:func:`route` is the one function that says how a call runs: which backend serves it
(:func:`~kvarena.attention.backend.resolve_backend`, whose refusals it raises), which path
(:class:`Path`), whether autograd records it, and, when the step's own keys come after
each sequence's history, whether history and own keys go in one launch or in two partial
attentions merged by LSE. The pools call it once per layer call (before their store) and
:func:`kvarena.attention.dispatch.attend` only reads the answer; the public op calls it
once per call.

It is a pure function of host facts (names, devices, dtypes, ``requires_grad`` flags,
where the own keys sit, whether torch.compile is tracing, whether the kernel takes the own
keys), memoized on them: a pool's layer call pays a dictionary lookup. What it leaves to
others: the kernel's tile, grid, guard and large-block choices are the launch plan's
(:mod:`kvarena.attention.plans`, made once per step), and the CPU SDPA shortcut of the
torch path is a same-answer shortcut that reads lengths on the host
(:func:`~kvarena.attention.torch_path.paged_attention_sdpa`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from kvarena.attention.backend import resolve_backend

__all__ = ["Own", "Path", "Route", "path_of", "route"]


class Path(Enum):
    """Which code runs an attention call."""

    TRITON_TRAIN = "the Triton forward and backward (one custom op with an autograd formula)"
    TORCH_GRAD = "the differentiable torch path (plain torch ops autograd and dynamo trace through)"
    TRITON_EAGER = "an eager Triton launch straight into the caller's out"
    COMPILED = "the opaque custom op under torch.compile"
    BODY = "the op's body called directly (eager, no dispatch cost)"


class Own(Enum):
    """Where the step's own keys of a call sit (:class:`~kvarena.attention.batch.OwnKeys`)."""

    NONE = "no own keys: the cache only"
    AT_QUERIES = "the query rows' own keys, already stored in the cache at the rows' positions"
    AFTER = "dense own keys after each sequence's history, visible to all its query rows"
    AFTER_PAGED = "own keys after the history read through pages (each chunk of a run sees part)"


@dataclass(frozen=True)
class Route:
    """How one attention call runs (made by :func:`route`; compare by value).

    Attributes
    ----------
    path : Path
    backend : str
        ``"torch"`` or ``"triton"``: the attention's backend.
    store : str
        The backend of the call's K/V store (no gradient flows through a store).
    grad : bool
        Autograd records the call (the path is a differentiable one).
    kv_grad : bool
        The given k / v need gradients (a pool then passes them as own keys at the rows).
    merge : bool
        History and own keys (``Own.AFTER*``) go in two partial attentions merged by LSE;
        False: one launch (or one op) takes both, or there are no own keys after a history.
    """

    path: Path
    backend: str
    store: str
    grad: bool
    kv_grad: bool
    merge: bool


def route(requested: str, device: torch.device, dtype: torch.dtype, *, rope: bool = False, q_grad: bool = False,
          kv_grad: bool = False, cache_grad: bool = False, sink_grad: bool = False, own: Own = Own.NONE,
          takes_own: bool | Callable[[], bool] = False, compiling: bool | None = None) -> Route:
    """The :class:`Route` of a call, before anything runs.

    ``requested``: the validated backend name (``spec.backend``); ``device`` / ``dtype``:
    where and in what the call runs. The ``*_grad`` flags say which inputs autograd would
    record (already False under ``torch.no_grad()``): ``q``, the given k / v (own keys),
    the cache tensors, the learned sink logits. ``rope``: RoPE on read. ``own``: where the
    own keys sit. ``takes_own``: the kernel's answer for ``Own.AFTER`` on Triton
    (:func:`kvarena.attention.plans.takes_own_keys`), or a function without arguments
    that asks it: asked only on the eager Triton path with ``Own.AFTER``.
    ``compiling`` (None: ask torch) selects the opaque op while dynamo traces.

    Raises what :func:`~kvarena.attention.backend.resolve_backend` raises: ``'triton'``
    asked for a gradient its backward does not compute (a cache tensor, sink logits, RoPE
    on read, own keys read through pages), or a device / dtype the kernels do not take.
    """
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    # 'triton' on CPU needs the interpreter flag, read from the environment on every call
    # (a memoized yes must not outlive it): part of the memo's key.
    interp = os.environ.get("TRITON_INTERPRET") if requested == "triton" and device.type == "cpu" else None
    got = _route(requested, device, dtype, rope, q_grad, kv_grad, cache_grad, sink_grad, own, compiling, interp)
    if got.merge and own is Own.AFTER and got.path is Path.TRITON_EAGER and (
            takes_own() if callable(takes_own) else takes_own):
        return _one_launch(got)
    return got


@functools.lru_cache(maxsize=512)
def _route(requested, device, dtype, rope, q_grad, kv_grad, cache_grad, sink_grad, own, compiling,
           interp) -> Route:
    """The route with the kernel's answer for own keys taken as no (see :func:`route`;
    ``interp``: the interpreter flag, a key only)."""
    grad = q_grad or kv_grad or cache_grad or sink_grad
    paged_grad = grad and own is Own.AFTER_PAGED  # the given k/v read as a paged cache
    backend = resolve_backend(requested, device, dtype, grad, _what(rope, cache_grad, sink_grad, paged_grad),
                              triton_grad=not (rope or cache_grad or sink_grad or paged_grad))
    store = resolve_backend(requested, device, dtype, False)
    path = path_of(backend, grad, compiling)
    # Own keys after the history: the train op takes both (its forward asks the kernel
    # itself, inside the op); an eager launch takes both where the kernel does (route()).
    merge = own is Own.AFTER_PAGED or (own is Own.AFTER and path is not Path.TRITON_TRAIN)
    return Route(path, backend, store, grad, kv_grad, merge)


def path_of(backend: str, grad: bool, compiling: bool | None = None) -> Path:
    """The path of a call on a resolved ``backend`` (the route's rule; the two partial
    attentions of a merge each take theirs by it)."""
    if grad:
        return Path.TRITON_TRAIN if backend == "triton" else Path.TORCH_GRAD
    if torch.compiler.is_compiling() if compiling is None else compiling:
        return Path.COMPILED
    return Path.TRITON_EAGER if backend == "triton" else Path.BODY


@functools.lru_cache(maxsize=64)
def _one_launch(merged: Route) -> Route:
    """``merged`` with the history and the own keys in one launch."""
    return dataclasses.replace(merged, merge=False)


def _what(rope: bool, cache_grad: bool, sink_grad: bool, paged_grad: bool) -> str:
    """The tensor a refusal of ``'triton'`` under autograd names."""
    if cache_grad:
        return "k_cache/v_cache/sink_logits"
    if sink_grad:
        return "sink_logits"
    if paged_grad:
        return "k/v of a multi-chunk step"
    return "q (RoPE on read)" if rope else "q"
