"""The pool registry (``make_pool``) and ``CacheHandle``, one pool per cache class.

There is no single unified block pool: the cache classes differ by orders of
magnitude in natural granularity, so each class gets a statically budgeted pool.
The registry resolves classes lazily (``"module:Class"``), so importing this module
imports neither the KV pools nor triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from kvarena.argcheck import is_int
from kvarena.cache.keys import CachePolicy

__all__ = ["CacheHandle", "make_pool"]

DICT_CLASSES = ("feature", "residual")
KV_CLASSES = ("slab_kv", "paged_kv")


class _LazyRegistry(Mapping):
    """Read-only ``class_name -> class`` mapping that imports a class on first access."""

    def __init__(self, specs: Mapping[str, str]) -> None:
        self._specs = dict(specs)
        self._loaded: dict[str, type] = {}

    def __getitem__(self, name: str) -> type:
        cls = self._loaded.get(name)
        if cls is None:
            module, _, attr = self._specs[name].partition(":")
            cls = getattr(importlib.import_module(module), attr)
            self._loaded[name] = cls
        return cls

    def __contains__(self, name: object) -> bool:
        # Mapping's default would call __getitem__, importing the class.
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def spec(self, name: str) -> str:
        """Return the ``"module:Class"`` string of ``name`` without importing it."""
        return self._specs[name]

    def __repr__(self) -> str:
        return f"_LazyRegistry({self._specs!r})"


_CLASS_REGISTRY = _LazyRegistry(
    {
        "feature": "kvarena.cache.feature:FeatureCache",
        "residual": "kvarena.cache.residual:ResidualCache",
        "slab_kv": "kvarena.cache.slab:SlabKVCache",
        "paged_kv": "kvarena.cache.paged:PagedKVCache",
    }
)


def _check_policy(name: str, policy: Any) -> CachePolicy:
    if not isinstance(policy, CachePolicy):
        raise TypeError(f"{name} must be a CachePolicy, got {type(policy).__qualname__}")
    if policy.class_name not in _CLASS_REGISTRY:
        raise KeyError(
            f"unknown cache class {policy.class_name!r} in {name}.class_name "
            f"(known: {', '.join(_CLASS_REGISTRY)})"
        )
    return policy


def make_pool(policy: CachePolicy, **kwargs: Any) -> Any:
    """Build the pool of ``policy.class_name`` (the registry of the original ``cache_pools.py`` API).

    Parameters
    ----------
    policy : CachePolicy
    **kwargs
        Passed to the class constructor (e.g. ``layout=``, ``device=`` for the KV
        pools).

    Returns
    -------
    FeatureCache or ResidualCache or SlabKVCache or PagedKVCache

    Raises
    ------
    TypeError
        If ``policy`` is not a ``CachePolicy`` (or the class rejects a keyword).
    KeyError
        If ``policy.class_name`` is not a registered class; the message lists the
        known ones.

    Examples
    --------
    >>> import torch
    >>> from kvarena import CachePolicy, KVLayout, make_pool
    >>> make_pool(CachePolicy("feature", max_bytes=1024))
    FeatureCache(entries=0, used_bytes=0, max_bytes=1024)
    >>> layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    >>> pool = make_pool(CachePolicy("paged_kv", max_bytes=2048), layout=layout, block_size=4)
    >>> type(pool).__name__, pool.total_blocks            # 2048 B // (4 tokens x 64 B)
    ('PagedKVCache', 8)
    >>> make_pool(CachePolicy("lru", max_bytes=1024))
    Traceback (most recent call last):
        ...
    KeyError: "unknown cache class 'lru' in policy.class_name (known: feature, residual, ...)"
    """
    _check_policy("policy", policy)
    return _CLASS_REGISTRY[policy.class_name](policy, **kwargs)


def _collect_policies(policies: Any) -> dict[str, CachePolicy]:
    if isinstance(policies, CachePolicy):
        items: list[tuple[str | None, Any]] = [(None, policies)]
    elif isinstance(policies, Mapping):
        items = list(policies.items())
    elif isinstance(policies, Iterable) and not isinstance(policies, (str, bytes)):
        items = [(None, p) for p in policies]
    else:
        raise TypeError(
            "policies must be an iterable of CachePolicy or a dict class_name -> CachePolicy, "
            f"got {type(policies).__qualname__}"
        )
    out: dict[str, CachePolicy] = {}
    for label, policy in items:
        where = "policies" if label is None else f"policies[{label!r}]"
        _check_policy(where, policy)
        if label is not None and label != policy.class_name:
            raise ValueError(
                f"{where} has class_name {policy.class_name!r}; the dict key must equal it"
            )
        if policy.class_name in out:
            raise ValueError(f"policies has two policies for class {policy.class_name!r}")
        out[policy.class_name] = policy
    return out


def _check_per_kv_class(name: str, mapping: Any, by_class: Mapping[str, CachePolicy], expected: str) -> None:
    """A per-KV-class argument: None or a mapping whose keys are KV classes with a policy."""
    if mapping is None:
        return
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{name} must be a dict {expected} or None, got {type(mapping).__qualname__}")
    for cls_name in mapping:
        if cls_name not in KV_CLASSES:
            raise KeyError(f"{name} has key {cls_name!r}; expected one of {', '.join(KV_CLASSES)}")
        if cls_name not in by_class:
            raise ValueError(f"{name}[{cls_name!r}] is given but policies has no {cls_name!r} policy")


# Constructor arguments of the KV pools that CacheHandle passes itself.
_HANDLE_SETS = frozenset(("policy", "layout", "arena", "region", "device", "block_size", "slab_tokens", "attention"))


class CacheHandle:
    """One statically budgeted pool per cache class, behind one object.

    Parameters
    ----------
    policies : iterable of CachePolicy, or mapping of str to CachePolicy
        At most one policy per class (``"feature"``, ``"residual"``, ``"slab_kv"``,
        ``"paged_kv"``); a mapping's keys must equal the policies' class names.
    layouts : mapping of str to KVLayout, optional
        Per KV class layout (``{"slab_kv": ..., "paged_kv": ...}``).
    device : str or torch.device, optional
        Device of the KV arena.
    slab_tokens : int, optional
        Tokens per slab of the ``slab_kv`` pool.
    block_size : int, default 16
        Tokens per block of the ``paged_kv`` pool.
    attention : mapping of str to attention specs, optional
        Per KV class, the pool's ``attention=`` argument (an ``AttentionSpec``, a list
        with one per layer, or ``{layers: spec}``), e.g. ``{"paged_kv": {range(0, 26, 2):
        sliding}}``; classes not named take the default spec.
    options : mapping of str to mapping, optional
        Per KV class, more keyword arguments of the pool's constructor, e.g.
        ``{"paged_kv": {"free_out_of_window": True, "rollback_tokens": 64,
        "graph_capacity": (8, 256)}}`` (a layout with layer groups, ``KVLayout(groups=)``,
        then releases its sliding groups' old blocks). The arguments the handle sets
        itself (``policy``, ``layout``, ``arena``, ``region``, ``device``, ``block_size``,
        ``slab_tokens``, ``attention``) are a ValueError here.

    Attributes
    ----------
    feature : FeatureCache or None
    residual : ResidualCache or None
    slab_kv : SlabKVCache or None
    paged_kv : PagedKVCache or None
        ``None`` for a class without a policy.
    arena : KVArena or None
        The single device allocation of the KV classes that have a layout; ``None``
        when no KV class has one (only dict classes, or KV pools given without
        ``layouts``, which then make their own arenas or do bookkeeping only).
    policies : mapping of str to CachePolicy
        Read-only.

    Raises
    ------
    TypeError, ValueError, KeyError
        For a malformed argument, two policies of one class, or an unknown class.

    Examples
    --------
    >>> import torch
    >>> from kvarena import CacheHandle, CachePolicy, KVLayout
    >>> layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    >>> handle = CacheHandle(
    ...     [CachePolicy("slab_kv", max_bytes=4096, per_component={"window": 2}),
    ...      CachePolicy("paged_kv", max_bytes=4096)],
    ...     layouts={"slab_kv": layout, "paged_kv": layout}, slab_tokens=4, block_size=4)
    >>> list(handle.arena.regions), handle.slab_kv.num_slots, handle.paged_kv.total_blocks
    (['slab_kv', 'paged_kv'], 8, 8)
    >>> handle.paged_kv.allocate("req0", 3), sorted(handle.stats())
    (True, ['paged_kv', 'slab_kv'])
    >>> handle.stats()["paged_kv"]["used_bytes"], handle.arena.used_bytes   # 3 blocks x 512 B
    (1536, 1536)
    >>> handle.end_request("req0")                        # frees the request's blocks everywhere
    >>> handle.arena.used_bytes
    0
    """

    def __init__(
        self,
        policies: Iterable[CachePolicy] | Mapping[str, CachePolicy],
        *,
        layouts: Mapping[str, Any] | None = None,
        device: Any = None,
        slab_tokens: int | None = None,
        block_size: int = 16,
        attention: Mapping[str, Any] | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        by_class = _collect_policies(policies)
        _check_per_kv_class("options", options, by_class, "{'slab_kv': {...}, 'paged_kv': {...}} of constructor "
                            "keyword arguments")
        for cls_name, opts in (options or {}).items():
            if not isinstance(opts, Mapping):
                raise TypeError(f"options[{cls_name!r}]: expected a mapping of keyword arguments, got "
                                f"{type(opts).__qualname__}")
            bad = [k for k in opts if not isinstance(k, str)]
            if bad:
                raise TypeError(f"options[{cls_name!r}]: keyword names must be str, got {bad[0]!r}")
            taken = sorted(set(opts) & _HANDLE_SETS)
            if taken:
                raise ValueError(f"options[{cls_name!r}]: {taken[0]!r} is set by CacheHandle itself (pass it as "
                                 "its own CacheHandle argument)")
        _check_per_kv_class("layouts", layouts, by_class, "{'slab_kv': KVLayout, 'paged_kv': KVLayout}")
        _check_per_kv_class("attention", attention, by_class,
                            "{'slab_kv': ..., 'paged_kv': ...} of the pools' attention= arguments")
        if slab_tokens is not None and (
            not is_int(slab_tokens) or slab_tokens < 1
        ):
            raise ValueError(f"slab_tokens must be an int >= 1 or None, got {slab_tokens!r}")
        if not is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")

        self._policies = MappingProxyType(by_class)
        self._layouts = dict(layouts or {})
        self._device = device
        self._slab_tokens = slab_tokens
        self._block_size = block_size
        self._attention = dict(attention or {})
        self._options = {k: dict(v) for k, v in (options or {}).items()}
        self.feature: Any = None
        self.residual: Any = None
        self.slab_kv: Any = None
        self.paged_kv: Any = None
        self.arena: Any = None

        for cls_name in DICT_CLASSES:
            if cls_name in by_class:
                setattr(self, cls_name, make_pool(by_class[cls_name]))
        if any(cls_name in by_class for cls_name in KV_CLASSES):
            self._build_kv_pools(by_class)

    def _build_kv_pools(self, by_class: Mapping[str, CachePolicy]) -> None:
        """Carve ONE KVArena into a region per KV class that has a layout.

        A KV class given without a layout keeps the original ``cache_pools.py`` behaviour instead: a slab pool
        materializes its own arena from the first appended K/V, a paged pool does block
        bookkeeping only. Everything is validated before the single allocation is made.
        """
        from kvarena.cache.arena import KVArena, KVLayout, RegionSpec

        specs: dict[str, RegionSpec] = {}
        for cls_name in KV_CLASSES:
            if cls_name not in by_class or cls_name not in self._layouts:
                continue
            layout = self._layouts[cls_name]
            if not isinstance(layout, KVLayout):
                raise TypeError(f"layouts[{cls_name!r}]: expected a KVLayout, got {type(layout).__qualname__}")
            policy = by_class[cls_name]
            if cls_name == "slab_kv":
                tokens = self._slab_tokens or policy.per_component.get("slab_tokens")
                if tokens is None:
                    raise ValueError(
                        "slab_tokens: required for the slab_kv region (pass slab_tokens= or set "
                        'per_component["slab_tokens"])'
                    )
            else:
                tokens = self._block_size
            spec = RegionSpec(layout, int(tokens), policy.max_bytes)
            if policy.block_bytes not in (0, spec.block_bytes):
                raise ValueError(
                    f"policies[{cls_name!r}].block_bytes: expected 0 (derived) or {spec.block_bytes} "
                    f"for {layout} x {tokens} tokens, got {policy.block_bytes}"
                )
            specs[cls_name] = spec
        if specs:
            self.arena = KVArena(specs, device=self._device)
        for cls_name in KV_CLASSES:
            if cls_name not in by_class:
                continue
            attn = self._attention.get(cls_name)
            opts = self._options.get(cls_name, {})
            if cls_name in specs:
                pool = make_pool(by_class[cls_name], arena=self.arena, region=cls_name, attention=attn, **opts)
            elif cls_name == "slab_kv":
                pool = make_pool(by_class[cls_name], slab_tokens=self._slab_tokens, device=self._device,
                                 attention=attn, **opts)
            else:
                pool = make_pool(by_class[cls_name], block_size=self._block_size, device=self._device,
                                 attention=attn, **opts)
            setattr(self, cls_name, pool)

    @property
    def policies(self) -> Mapping[str, CachePolicy]:
        """mapping of str to CachePolicy: the configured policies, by class name."""
        return self._policies

    def pools(self) -> dict[str, Any]:
        """Return the configured pools by class name."""
        return {
            name: getattr(self, name)
            for name in (*DICT_CLASSES, *KV_CLASSES)
            if getattr(self, name) is not None
        }

    def stats(self) -> dict[str, dict[str, Any]]:
        """Return each configured pool's statistics, by class name.

        Returns
        -------
        dict
            ``{class_name: pool.stats()}``; a pool without ``stats()`` reports
            ``used_bytes`` and its policy's ``max_bytes``.
        """
        out: dict[str, dict[str, Any]] = {}
        for name, pool in self.pools().items():
            stats = getattr(pool, "stats", None)
            if callable(stats):
                out[name] = dict(stats())
            else:
                out[name] = {
                    "used_bytes": int(getattr(pool, "used_bytes", 0)),
                    "max_bytes": self._policies[name].max_bytes,
                }
        return out

    def end_request(self, namespace: str) -> None:
        """Release ``namespace`` everywhere: residuals, slabs and paged blocks.

        The feature cache is shared across requests and is left as is. Unknown
        namespaces are a no-op.

        Parameters
        ----------
        namespace : str

        Raises
        ------
        TypeError
            If ``namespace`` is not a str.
        """
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__qualname__}")
        if self.residual is not None:
            self.residual.clear_namespace(namespace)
        if self.slab_kv is not None:
            self.slab_kv.clear_namespace(namespace)
        if self.paged_kv is not None:
            self.paged_kv.free_namespace(namespace)

    def __repr__(self) -> str:
        return f"CacheHandle(classes={list(self._policies)})"
