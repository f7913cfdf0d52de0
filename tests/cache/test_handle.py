"""make_pool registry and CacheHandle (dict classes; KV classes arrive with the arena)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from kvarena.cache.feature import FeatureCache
from kvarena.cache.handle import _CLASS_REGISTRY, CacheHandle, make_pool
from kvarena.cache.keys import CacheKey, CachePolicy
from kvarena.cache.residual import ResidualCache

_FEATURE = CachePolicy("feature", 1000)
_RESIDUAL = CachePolicy("residual", 500)


# ---------------------------------------------------------------------------------------
# make_pool
@pytest.mark.parametrize(
    "policy, cls",
    [
        pytest.param(_FEATURE, FeatureCache, id="feature"),
        pytest.param(_RESIDUAL, ResidualCache, id="residual"),
    ],
)
def test_make_pool_builds_the_class_of_the_policy(policy: CachePolicy, cls: type) -> None:
    pool = make_pool(policy)
    assert type(pool) is cls and pool.policy is policy
    assert _CLASS_REGISTRY[policy.class_name] is cls


def test_make_pool_forwards_keywords_to_the_class() -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        make_pool(_FEATURE, no_such_option=1)


def test_make_pool_unknown_class_names_the_known_ones() -> None:
    with pytest.raises(KeyError) as info:
        make_pool(CachePolicy("vae_tiles", 10))
    message = str(info.value)
    assert "vae_tiles" in message
    for known in ("feature", "residual", "slab_kv", "paged_kv"):
        assert known in message


def test_make_pool_rejects_a_non_policy() -> None:
    with pytest.raises(TypeError, match="policy"):
        make_pool({"class_name": "feature", "max_bytes": 1})  # type: ignore[arg-type]


def test_registry_lists_the_four_classes() -> None:
    assert sorted(_CLASS_REGISTRY) == ["feature", "paged_kv", "residual", "slab_kv"]
    assert _CLASS_REGISTRY.spec("slab_kv") == "kvarena.cache.slab:SlabKVCache"
    assert _CLASS_REGISTRY.spec("paged_kv") == "kvarena.cache.paged:PagedKVCache"


def test_registry_and_dict_pools_do_not_import_the_kv_modules() -> None:
    script = textwrap.dedent(
        """
        import sys
        from kvarena.cache.handle import _CLASS_REGISTRY, CacheHandle
        from kvarena.cache.keys import CachePolicy
        names = list(_CLASS_REGISTRY)
        h = CacheHandle([CachePolicy("feature", 10), CachePolicy("residual", 10)])
        loaded = [m for m in ("kvarena.cache.slab", "kvarena.cache.paged", "kvarena.cache.arena", "triton")
                  if m in sys.modules]
        print(",".join(loaded) or "none")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "none"


@pytest.mark.parametrize(
    "class_name, module", [("slab_kv", "kvarena.cache.slab"), ("paged_kv", "kvarena.cache.paged")]
)
def test_make_pool_resolves_kv_classes_lazily(class_name: str, module: str) -> None:
    mod = pytest.importorskip(module)
    cls = _CLASS_REGISTRY[class_name]
    assert cls is getattr(mod, _CLASS_REGISTRY.spec(class_name).split(":")[1])


# ---------------------------------------------------------------------------------------
# CacheHandle, dict classes
def test_handle_from_list_or_dict() -> None:
    for policies in ([_FEATURE, _RESIDUAL], {"feature": _FEATURE, "residual": _RESIDUAL}):
        h = CacheHandle(policies)
        assert isinstance(h.feature, FeatureCache) and h.feature.policy is _FEATURE
        assert isinstance(h.residual, ResidualCache) and h.residual.policy is _RESIDUAL
        assert h.slab_kv is None and h.paged_kv is None
        assert h.arena is None  # only dict classes: no arena
        assert dict(h.policies) == {"feature": _FEATURE, "residual": _RESIDUAL}


def test_handle_with_one_class_leaves_the_others_none() -> None:
    h = CacheHandle([_RESIDUAL])
    assert h.feature is None and isinstance(h.residual, ResidualCache)
    assert list(h.stats()) == ["residual"]


def test_handle_stats_are_per_class() -> None:
    h = CacheHandle([_FEATURE, _RESIDUAL])
    h.feature.put(CacheKey("te", "x", "w0"), torch.zeros(10))
    h.residual.put("req", "cond", "a", torch.zeros(5))
    stats = h.stats()
    assert stats["feature"] == h.feature.stats() and stats["feature"]["used_bytes"] == 40
    assert stats["residual"] == h.residual.stats() and stats["residual"]["used_bytes"] == 20
    assert stats["residual"]["max_bytes"] == 500


def test_end_request_clears_that_namespace_only() -> None:
    h = CacheHandle([_FEATURE, _RESIDUAL])
    key = CacheKey("te", "x", "w0")
    h.feature.put(key, torch.zeros(10))
    h.residual.put("req1", "cond", "a", torch.zeros(5))
    h.residual.put("req1", "uncond", "a", torch.zeros(5))
    h.residual.put("req2", "cond", "a", torch.zeros(5))
    h.end_request("req1")
    assert h.residual.namespaces() == ["req2"] and h.residual.used_bytes == 20
    assert key in h.feature  # shared across requests: untouched
    h.end_request("never-seen")  # a no-op
    assert h.residual.used_bytes == 20


class _StubKV:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.used_bytes = 7

    def clear_namespace(self, ns: str) -> None:
        self.calls.append(("clear_namespace", ns))

    def free_namespace(self, ns: str) -> None:
        self.calls.append(("free_namespace", ns))


def test_end_request_reaches_the_kv_pools_and_stats_tolerate_them() -> None:
    h = CacheHandle([_RESIDUAL])
    h.slab_kv, h.paged_kv = _StubKV(), _StubKV()
    h._policies = {
        **h.policies,
        "slab_kv": CachePolicy("slab_kv", 70),
        "paged_kv": CachePolicy("paged_kv", 80),
    }
    h.end_request("req")
    assert h.slab_kv.calls == [("clear_namespace", "req")]
    assert h.paged_kv.calls == [("free_namespace", "req")]
    stats = h.stats()
    assert stats["slab_kv"] == {"used_bytes": 7, "max_bytes": 70}
    assert stats["paged_kv"] == {"used_bytes": 7, "max_bytes": 80}


def test_kv_classes_share_one_arena_with_a_layout_each() -> None:
    import torch

    from kvarena.cache.arena import KVLayout

    dit = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    dec = KVLayout(num_layers=2, num_kv_heads=1, head_dim=32, dtype=torch.float32)
    slab_budget, paged_budget = 5 * dit.block_bytes(7), 9 * dec.block_bytes(4) + 100
    h = CacheHandle(
        [_FEATURE, _RESIDUAL, CachePolicy("slab_kv", slab_budget, per_component={"window": 2, "sinks": 1}),
         CachePolicy("paged_kv", paged_budget)],
        layouts={"slab_kv": dit, "paged_kv": dec}, slab_tokens=7, block_size=4,
    )
    # one allocation, two non-overlapping regions, each in its own layout
    assert h.slab_kv.arena is h.arena and h.paged_kv.arena is h.arena
    base = h.arena.buffer.data_ptr()
    ks, kp = h.slab_kv.arena["slab_kv"].k(0), h.paged_kv.arena["paged_kv"].k(0)
    assert ks.dtype == torch.float16 and kp.dtype == torch.float32
    assert base <= ks.data_ptr() < base + h.arena.nbytes and base <= kp.data_ptr() < base + h.arena.nbytes
    assert h.slab_kv.num_slots == 5 and h.paged_kv.total_blocks == 9
    # end_request reaches both KV pools
    h.paged_kv.plan({"req": 6})
    h.slab_kv.plan({"req": 0})
    assert h.paged_kv.used_bytes > 0 and h.slab_kv.used_bytes > 0
    h.end_request("req")
    assert h.paged_kv.used_bytes == 0 and h.slab_kv.used_bytes == 0
    assert h.paged_kv.free == h.paged_kv.total_blocks


def test_handle_paged_pool_with_layer_groups_and_options() -> None:
    """A grouped layout and the pool's own options through the handle: the sliding group
    releases (its blocks come back), the full group keeps its history; stats per group."""
    import torch

    from kvarena import AttentionSpec, KVLayout, group_layers

    kinds = ["sliding", "full", "sliding", "full"]
    lay = KVLayout(num_layers=4, num_kv_heads=1, head_dim=8, dtype=torch.float32, groups=group_layers(kinds))
    sliding = AttentionSpec(window_left=3)
    h = CacheHandle([CachePolicy("paged_kv", 64 * lay.block_bytes(4))], layouts={"paged_kv": lay}, block_size=4,
                    attention={"paged_kv": {(0, 2): sliding}}, options={"paged_kv": {"free_out_of_window": True}})
    pool = h.paged_kv
    pool.plan({"r": 8})
    for _ in range(24):
        pool.plan({"r": 1})
    # sliding: planned at 31 tokens, keys >= 31 - 3 stay visible: block 7 (28..31); full: ceil(32 / 4)
    assert pool.group_used_blocks == (1, 8)
    groups = h.stats()["paged_kv"]["groups"]
    assert [(g["layers"], g["window_left"], g["blocks"]) for g in groups] == [((0, 2), 3, 1), ((1, 3), None, 8)]
    h.end_request("r")
    assert pool.group_used_blocks == (0, 0) and h.stats()["paged_kv"]["used_bytes"] == 0
    with pytest.raises(ValueError, match=r"options\['paged_kv'\]: 'block_size' is set by CacheHandle"):
        CacheHandle([CachePolicy("paged_kv", 1 << 16)], options={"paged_kv": {"block_size": 8}})
    with pytest.raises(TypeError, match=r"options\['paged_kv'\]: expected a mapping"):
        CacheHandle([CachePolicy("paged_kv", 1 << 16)], options={"paged_kv": 3})


def test_kv_class_without_layout_keeps_seed_behaviour() -> None:
    h = CacheHandle([_FEATURE, CachePolicy("paged_kv", 1 << 20, block_bytes=4096)])
    assert h.arena is None and h.paged_kv.total_blocks == 256
    assert h.paged_kv.allocate("a", 3) and h.paged_kv.free == 253


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        pytest.param({"layouts": {"slab_kv": "not a layout"}}, TypeError, "layouts", id="layout-type"),
        pytest.param({"layouts": {"slab_kv": None}}, TypeError, "layouts", id="layout-none"),
    ],
)
def test_kv_handle_bad_layouts(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        CacheHandle([CachePolicy("slab_kv", 1 << 20)], slab_tokens=8, **kwargs)


def test_kv_handle_needs_slab_tokens() -> None:
    import torch

    from kvarena.cache.arena import KVLayout

    lay = KVLayout(1, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="slab_tokens"):
        CacheHandle([CachePolicy("slab_kv", 1 << 20)], layouts={"slab_kv": lay})


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        pytest.param(
            ([_FEATURE, CachePolicy("feature", 5)],),
            {},
            ValueError,
            "two policies.*feature",
            id="duplicate",
        ),
        pytest.param(({"residual": _FEATURE},), {}, ValueError, "dict key", id="dict-key-mismatch"),
        pytest.param(([CachePolicy("vae", 5)],), {}, KeyError, "known", id="unknown-class"),
        pytest.param(([_FEATURE, "residual"],), {}, TypeError, "policies", id="not-a-policy"),
        pytest.param((3,), {}, TypeError, "policies", id="policies-int"),
        pytest.param(("feature",), {}, TypeError, "policies", id="policies-str"),
        pytest.param(([_FEATURE],), {"layouts": [1]}, TypeError, "layouts", id="layouts-list"),
        pytest.param(
            ([_FEATURE],), {"layouts": {"feature": 1}}, KeyError, "layouts", id="layouts-dict-class"
        ),
        pytest.param(
            ([_FEATURE],),
            {"layouts": {"slab_kv": 1}},
            ValueError,
            "layouts",
            id="layouts-unconfigured",
        ),
        pytest.param(([_FEATURE],), {"block_size": 0}, ValueError, "block_size", id="block-size-0"),
        pytest.param(
            ([_FEATURE],), {"block_size": True}, ValueError, "block_size", id="block-size-bool"
        ),
        pytest.param(
            ([_FEATURE],), {"slab_tokens": 0}, ValueError, "slab_tokens", id="slab-tokens-0"
        ),
    ],
)
def test_handle_bad_arguments(args: tuple, kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        CacheHandle(*args, **kwargs)


def test_end_request_type_error() -> None:
    with pytest.raises(TypeError, match="namespace"):
        CacheHandle([_RESIDUAL]).end_request(3)  # type: ignore[arg-type]


def test_top_level_exports_resolve_to_these_objects() -> None:
    import kvarena

    names: dict[str, Any] = {
        "CacheHandle": CacheHandle,
        "make_pool": make_pool,
        "FeatureCache": FeatureCache,
        "ResidualCache": ResidualCache,
        "CacheKey": CacheKey,
        "CachePolicy": CachePolicy,
    }
    for name, obj in names.items():
        assert getattr(kvarena, name) is obj
