"""FeatureCache: seed behaviour, byte accounting, budget, invalidation, threads."""

from __future__ import annotations

import dataclasses
import random
import threading
import types
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from _helpers import blob, run_threads
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvarena.cache._bytes import value_nbytes
from kvarena.cache.feature import FeatureCache
from kvarena.cache.keys import CacheKey, CachePolicy


def _key(content: str, component: str = "text_encoder", weights: str = "w0") -> CacheKey:
    return CacheKey(component, content, weights)


def _cache(max_bytes: int, **kw: Any) -> FeatureCache:
    return FeatureCache(CachePolicy("feature", max_bytes, **kw))


def _order(cache: FeatureCache) -> list[str]:
    """Content ids of the stored keys, least recently used first."""
    stored = cache.keys()
    return [k.content_hash for k in stored]


# ---------------------------------------------------------------------------------------
# Byte accounting rule
class _Pair(NamedTuple):
    a: Any
    b: Any


@dataclasses.dataclass
class _Out:
    hidden: Any
    pooled: Any


def test_value_nbytes_counts_nested_tensors(seed: int) -> None:
    a = torch.randn(3, 4)  # 48 bytes
    b = torch.zeros(5, dtype=torch.bfloat16)  # 10
    c = torch.zeros(2, 2, dtype=torch.int64)  # 32
    assert value_nbytes(a) == 48
    assert value_nbytes((a, [b, {"x": c}])) == 48 + 10 + 1 + 32  # "x": a key is kept too
    assert value_nbytes(_Pair(a, b)) == 58
    assert value_nbytes(_Out(hidden=a, pooled=[c])) == 80
    assert value_nbytes({"hidden": a, "mask": None, "len": 3}) == 48 + 6 + 4 + 3


def test_value_nbytes_counts_the_storage_a_view_keeps_alive(seed: int) -> None:
    big = torch.randn(100, 8)  # 3200 bytes
    assert value_nbytes(big[:3]) == 3200, "a slice keeps its whole base alive"
    assert value_nbytes(big[:, 0]) == 3200
    assert value_nbytes((big[:50], big[50:], big)) == 3200, "one storage counts once"
    assert value_nbytes(torch.zeros(1, 8).expand(50, 8)) == 32, "stride 0: 8 floats kept"


def test_value_nbytes_counts_one_object_once(seed: int) -> None:
    t = torch.randn(10)
    assert value_nbytes((t, t, [t])) == 40
    assert value_nbytes((t, t.clone())) == 80


def test_value_nbytes_other_leaves() -> None:
    assert value_nbytes(np.zeros(7, dtype=np.float64)) == 56
    assert value_nbytes(b"abcd") == 4
    assert value_nbytes("h\u00e9") == 3  # UTF-8 length
    assert value_nbytes(None) == 0
    assert value_nbytes(3.5) == 0
    assert value_nbytes(np.float32(1.0)) == 4
    assert value_nbytes(range(10**6)) == 0
    assert value_nbytes((torch.float16, torch.device("cpu"))) == 0


# ---------------------------------------------------------------------------------------
# Seed behaviour kept
def test_hit_moves_entry_to_most_recent() -> None:
    cache = _cache(30)
    for name in "abc":
        assert cache.put(_key(name), blob(10))
    assert cache.get(_key("a")) is not None  # a becomes most recent; b is now oldest
    cache.put(_key("d"), blob(10))
    assert _key("b") not in cache
    assert _order(cache) == ["c", "a", "d"]
    assert cache.evictions == 1


def test_hits_and_misses_are_counted() -> None:
    cache = _cache(100)
    value = blob(4)
    cache.put(_key("a"), value)
    assert cache.get(_key("a")) is value
    assert cache.get(_key("a")) is value
    assert cache.get(_key("zzz")) is None
    assert (cache.hits, cache.misses) == (2, 1)


def test_put_of_an_existing_key_replaces_it() -> None:
    cache = _cache(100)
    cache.put(_key("a"), blob(10))
    cache.put(_key("b"), blob(5))
    new = blob(20)
    cache.put(_key("a"), new)
    assert cache.get(_key("a")) is new
    assert cache.used_bytes == 25 and len(cache) == 2
    assert _order(cache) == ["b", "a"]


def test_invalidate_weights_drops_every_other_version() -> None:
    cache = _cache(1000)
    cache.put(_key("a", weights="w0"), blob(10))
    cache.put(_key("b", weights="w1"), blob(20))
    cache.put(_key("c", weights="w2"), blob(40))
    assert cache.invalidate_weights("w1") == 2
    assert cache.keys() == [_key("b", weights="w1")]
    assert cache.used_bytes == 20


def test_invalidate_components_drops_only_those() -> None:
    cache = _cache(1000)
    cache.put(_key("a", component="text_encoder"), blob(10))
    cache.put(_key("a", component="vision_encoder"), blob(20))
    cache.put(_key("a", component="transformer"), blob(40))
    assert cache.invalidate_components({"transformer", "vision_encoder", "unknown"}) == 2
    assert cache.keys() == [_key("a", component="text_encoder")]
    assert cache.used_bytes == 10
    assert cache.invalidate_components([]) == 0


def test_keys_differing_in_weights_do_not_collide() -> None:
    cache = _cache(1000)
    v0, v1 = blob(1), blob(1)
    cache.put(_key("p", weights="w0"), v0)
    cache.put(_key("p", weights="w1"), v1)
    assert cache.get(_key("p", weights="w0")) is v0
    assert cache.get(_key("p", weights="w1")) is v1


# ---------------------------------------------------------------------------------------
# Seed bugs (regressions)
def test_nested_tensor_values_count_against_the_budget(seed: int) -> None:
    # seed: _nbytes was 0 for containers, so the budget never applied to them
    cache = _cache(100)
    value = (torch.zeros(10), [torch.zeros(5, dtype=torch.float16), {"m": torch.zeros(3)}])
    assert cache.put(_key("a"), value)
    assert cache.used_bytes == 40 + 10 + 1 + 12
    assert cache.put(_key("b"), (torch.zeros(10),))
    assert _key("a") not in cache  # 63 + 40 > 100: the first one went
    assert cache.used_bytes == 40


def test_value_larger_than_budget_is_rejected_and_evicts_nothing() -> None:
    # seed: the put flushed the whole cache, the new value included
    cache = _cache(50)
    cache.put(_key("a"), blob(20))
    cache.put(_key("b"), blob(20))
    assert cache.put(_key("big"), blob(51)) is False
    assert _order(cache) == ["a", "b"]
    assert cache.used_bytes == 40
    assert (cache.rejected, cache.evictions) == (1, 0)
    assert cache.get(_key("big")) is None


def test_rejected_put_drops_the_previous_value_of_that_key() -> None:
    cache = _cache(50)
    cache.put(_key("a"), blob(20))
    cache.put(_key("b"), blob(20))
    cache.put(_key("a"), blob(60))
    assert _key("a") not in cache and _key("b") in cache
    assert cache.used_bytes == 20


def test_value_exactly_at_budget_is_stored() -> None:
    cache = _cache(50)
    cache.put(_key("a"), blob(10))
    assert cache.put(_key("b"), blob(50))
    assert cache.keys() == [_key("b")] and cache.used_bytes == 50


def test_reuse_disabled_stores_nothing() -> None:
    # seed: put stored values (and kept them alive) while get always missed
    cache = _cache(1000, reuse_across_requests=False)
    assert cache.put(_key("a"), blob(10)) is False
    assert len(cache) == 0 and cache.used_bytes == 0
    assert cache.get(_key("a")) is None
    calls = []
    assert cache.get_or_compute(_key("a"), lambda: calls.append(1) or 7) == 7
    assert cache.get_or_compute(_key("a"), lambda: calls.append(1) or 7) == 7
    assert len(calls) == 2
    assert cache.stats()["rejected"] == 3 and cache.misses == 3 and cache.hits == 0


def test_zero_budget_keeps_only_zero_byte_values() -> None:
    cache = _cache(0)
    assert cache.put(_key("a"), blob(1)) is False
    assert cache.put(_key("b"), None) is True
    assert cache.used_bytes == 0


# ---------------------------------------------------------------------------------------
# New API
def test_get_or_compute_computes_once() -> None:
    cache = _cache(100)
    calls = []

    def fn() -> torch.Tensor:
        calls.append(1)
        return blob(8)

    first = cache.get_or_compute(_key("a"), fn)
    second = cache.get_or_compute(_key("a"), fn)
    assert first is second and len(calls) == 1
    assert (cache.hits, cache.misses, cache.used_bytes) == (1, 1, 8)


def test_get_or_compute_exception_leaves_cache_unchanged() -> None:
    cache = _cache(100)
    cache.put(_key("a"), blob(8))

    def boom() -> Any:
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        cache.get_or_compute(_key("b"), boom)
    assert cache.keys() == [_key("a")] and cache.used_bytes == 8


def test_get_or_compute_runs_fn_outside_the_lock() -> None:
    cache = _cache(100)
    inside = threading.Event()
    other_done = threading.Event()

    def fn() -> torch.Tensor:
        inside.set()
        # another thread must be able to use the cache while fn runs
        assert other_done.wait(timeout=10)
        assert cache.get(_key("other")) is not None  # re-entrant use works too
        return blob(4)

    def other() -> None:
        assert inside.wait(timeout=10)
        cache.put(_key("other"), blob(4))
        other_done.set()

    t = threading.Thread(target=other)
    t.start()
    result: list = []
    worker = threading.Thread(target=lambda: result.append(cache.get_or_compute(_key("a"), fn)))
    worker.start()
    worker.join(timeout=20)
    t.join(timeout=20)
    assert not worker.is_alive() and not t.is_alive(), "deadlock: fn ran under the lock"
    assert len(result) == 1 and _key("a") in cache


def test_stored_tensors_are_detached(seed: int) -> None:
    w = torch.randn(4, 4, requires_grad=True)
    out = w @ w
    value = {"hidden": out, "pooled": [out.sum(0)], "raw": w}
    cache = _cache(1000)
    cache.put(_key("a"), value)
    stored = cache.get(_key("a"))
    assert out.grad_fn is not None  # the caller's value is untouched
    for t in (stored["hidden"], stored["pooled"][0], stored["raw"]):
        assert not t.requires_grad and t.grad_fn is None
    assert stored["hidden"].data_ptr() == out.data_ptr()  # detached, not copied
    assert cache.used_bytes == 64 + 16 + 64 + len("hidden") + len("pooled") + len("raw")


def test_get_or_compute_returns_fn_result_and_stores_it_detached(seed: int) -> None:
    w = torch.randn(3, requires_grad=True)
    cache = _cache(100)
    first = cache.get_or_compute(_key("a"), lambda: w * 2)
    assert first.requires_grad
    again = cache.get(_key("a"))
    assert not again.requires_grad and torch.equal(again, first.detach())


def test_stats_snapshot() -> None:
    cache = _cache(25)
    cache.put(_key("a"), blob(10))
    cache.put(_key("b"), blob(10))
    cache.put(_key("c"), blob(10))
    cache.put(_key("d"), blob(30))
    cache.get(_key("c"))
    cache.get(_key("a"))
    assert cache.stats() == {
        "hits": 1,
        "misses": 1,
        "evictions": 1,
        "rejected": 1,
        "entries": 2,
        "used_bytes": 20,
        "max_bytes": 25,
    }


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda c: c.get("a"), id="get"),
        pytest.param(lambda c: c.put(("a",), blob(1)), id="put"),
        pytest.param(lambda c: c.get_or_compute(None, lambda: 1), id="get_or_compute"),
    ],
)
def test_wrong_key_type_raises_and_changes_nothing(call: Any) -> None:
    cache = _cache(100)
    cache.put(_key("a"), blob(10))
    before = cache.stats()
    with pytest.raises(TypeError, match="key"):
        call(cache)
    assert cache.stats() == before


@pytest.mark.parametrize(
    "call, exc, name",
    [
        pytest.param(lambda c: c.invalidate_weights(1), TypeError, "version", id="version-int"),
        pytest.param(
            lambda c: c.invalidate_components("text_encoder"), TypeError, "names", id="names-str"
        ),
        pytest.param(
            lambda c: c.invalidate_components({"te", 3}), TypeError, "names", id="names-int"
        ),
        pytest.param(lambda c: c.invalidate_components(None), TypeError, "names", id="names-none"),
        pytest.param(lambda c: c.get_or_compute(_key("z"), 3), TypeError, "fn", id="fn"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(call: Any, exc: type, name: str) -> None:
    cache = _cache(100)
    cache.put(_key("a"), blob(10))
    before = cache.stats()
    with pytest.raises(exc, match=name):
        call(cache)
    assert cache.stats() == before and cache.keys() == [_key("a")]


def test_unsizable_value_raises_even_with_reuse_disabled() -> None:
    # the same put fails whatever the policy, so a config switch cannot hide the bug
    cache = _cache(100, reuse_across_requests=False)
    with pytest.raises(TypeError, match=r"^value: .*generator"):
        cache.put(_key("a"), (t for t in [blob(4)]))
    assert cache.stats()["rejected"] == 0, "a put that raises must not count as rejected"


def test_get_or_compute_with_an_unsizable_result_raises_and_stores_nothing() -> None:
    cache = _cache(100)
    cache.put(_key("a"), blob(8))
    before = cache.stats()
    with pytest.raises(TypeError, match=r"^value: .*SimpleNamespace"):
        cache.get_or_compute(_key("b"), lambda: types.SimpleNamespace(t=blob(50)))
    assert cache.stats() == {**before, "misses": before["misses"] + 1}, cache.stats()
    assert cache.keys() == [_key("a")]


def test_policy_must_be_a_cache_policy() -> None:
    with pytest.raises(TypeError, match="policy"):
        FeatureCache({"class_name": "feature", "max_bytes": 10})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Stateful model check: an OrderedDict is the reference LRU.
_COMPONENTS = ("te", "ve", "dit")
_WEIGHTS = ("w0", "w1")
_keys = st.builds(
    CacheKey,
    component_id=st.sampled_from(_COMPONENTS),
    content_hash=st.sampled_from("abcd"),
    weights_version=st.sampled_from(_WEIGHTS),
)


class FeatureCacheMachine(RuleBasedStateMachine):
    """Random puts/gets/invalidations against an OrderedDict model."""

    @initialize(max_bytes=st.integers(0, 64))
    def setup(self, max_bytes: int) -> None:
        self.cache = _cache(max_bytes)
        self.max_bytes = max_bytes
        self.model: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()
        self.hits = self.misses = self.evictions = self.rejected = 0

    def _model_put(self, key: CacheKey, value: Any, size: int) -> bool:
        if size > self.max_bytes:
            self.model.pop(key, None)
            self.rejected += 1
            return False
        self.model.pop(key, None)
        self.model[key] = (value, size)
        while sum(s for _v, s in self.model.values()) > self.max_bytes:
            self.model.popitem(last=False)
            self.evictions += 1
        return True

    def _model_get(self, key: CacheKey) -> tuple[bool, Any]:
        if key in self.model:
            self.model.move_to_end(key)
            self.hits += 1
            return True, self.model[key][0]
        self.misses += 1
        return False, None

    @rule(key=_keys, size=st.integers(0, 40))
    def put_tensor(self, key: CacheKey, size: int) -> None:
        value = blob(size)
        assert self.cache.put(key, value) == self._model_put(key, value, size)

    @rule(key=_keys, sizes=st.lists(st.integers(0, 12), max_size=3))
    def put_nested(self, key: CacheKey, sizes: list[int]) -> None:
        value = {"parts": tuple(torch.zeros(s, dtype=torch.float16) for s in sizes)}
        size = 2 * sum(sizes) + len("parts")
        assert self.cache.put(key, value) == self._model_put(key, value, size)

    @rule(key=_keys)
    def get(self, key: CacheKey) -> None:
        found, expected = self._model_get(key)
        got = self.cache.get(key, default=KeyError)
        if found:
            assert got is expected
        else:
            assert got is KeyError

    @rule(key=_keys, size=st.integers(0, 40))
    def get_or_compute(self, key: CacheKey, size: int) -> None:
        value = blob(size)
        found, expected = self._model_get(key)
        got = self.cache.get_or_compute(key, lambda: value)
        if found:
            assert got is expected
        else:
            assert got is value
            self._model_put(key, value, size)

    @rule(version=st.sampled_from(_WEIGHTS))
    def invalidate_weights(self, version: str) -> None:
        drop = [k for k in self.model if k.weights_version != version]
        for k in drop:
            del self.model[k]
        assert self.cache.invalidate_weights(version) == len(drop)

    @rule(names=st.sets(st.sampled_from(_COMPONENTS)))
    def invalidate_components(self, names: set[str]) -> None:
        drop = [k for k in self.model if k.component_id in names]
        for k in drop:
            del self.model[k]
        assert self.cache.invalidate_components(names) == len(drop)

    @invariant()
    def matches_model(self) -> None:
        expected_bytes = sum(s for _v, s in self.model.values())
        assert self.cache.used_bytes == expected_bytes <= self.max_bytes
        assert self.cache.keys() == list(self.model)  # exact LRU order
        assert self.cache.stats() == {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "rejected": self.rejected,
            "entries": len(self.model),
            "used_bytes": expected_bytes,
            "max_bytes": self.max_bytes,
        }


TestFeatureCacheMachine = FeatureCacheMachine.TestCase
TestFeatureCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ---------------------------------------------------------------------------------------
# Threads
def test_eight_threads_keep_accounting_exact(seed: int) -> None:
    cache = _cache(4000)
    blobs = [blob(n) for n in range(0, 400, 7)]
    n_threads, n_ops = 8, 2000
    counts = [0] * n_threads  # lookups issued per thread
    start = threading.Barrier(n_threads)

    def worker(tid: int) -> None:
        rng = random.Random(seed * 31 + tid)
        start.wait()
        for _ in range(n_ops):
            key = _key(
                f"c{rng.randrange(40)}",
                component=rng.choice(_COMPONENTS),
                weights=rng.choice(_WEIGHTS),
            )
            op = rng.random()
            if op < 0.4:
                cache.put(key, rng.choice(blobs))
            elif op < 0.7:
                cache.get(key)
                counts[tid] += 1
            elif op < 0.9:
                cache.get_or_compute(key, lambda: rng.choice(blobs))
                counts[tid] += 1
            elif op < 0.95:
                cache.invalidate_weights(rng.choice(_WEIGHTS))
            elif op < 0.98:
                cache.invalidate_components({rng.choice(_COMPONENTS)})
            else:
                cache.stats()

    errors = run_threads(worker, n_threads)
    assert not errors, errors
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == sum(counts)
    assert stats["evictions"] > 0  # the budget was exercised
    keys = cache.keys()
    stored = sum(value_nbytes(cache.get(k)) for k in keys)
    assert stats["used_bytes"] == stored <= stats["max_bytes"]
    assert stats["entries"] == len(keys) == len(set(keys))
