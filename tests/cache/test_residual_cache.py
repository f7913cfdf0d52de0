"""ResidualCache: seed behaviour, budget, namespaces and branches, scope, threads."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from typing import Any

import pytest
import torch
from _helpers import blob, run_threads
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvarena.cache._bytes import value_nbytes
from kvarena.cache.keys import CachePolicy
from kvarena.cache.residual import ResidualCache


def _cache(max_bytes: int) -> ResidualCache:
    return ResidualCache(CachePolicy("residual", max_bytes))


# ---------------------------------------------------------------------------------------
# Seed behaviour kept
def test_get_returns_none_on_miss_and_counts() -> None:
    cache = _cache(100)
    value = blob(4)
    cache.put("req1", "cond", "block0", value)
    assert cache.get("req1", "cond", "block0") is value
    assert cache.get("req1", "uncond", "block0") is None
    assert cache.get("req2", "cond", "block0") is None
    assert (cache.hits, cache.misses) == (1, 2)


def test_branches_and_namespaces_are_separate() -> None:
    cache = _cache(100)
    vals = {(ns, br): blob(1) for ns in ("r1", "r2") for br in ("cond", "uncond")}
    for (ns, br), v in vals.items():
        cache.put(ns, br, "res", v)
    for (ns, br), v in vals.items():
        assert cache.get(ns, br, "res") is v


def test_clear_namespace_drops_all_its_branches_only() -> None:
    cache = _cache(100)
    cache.put("r1", "cond", "a", blob(10))
    cache.put("r1", "uncond", "a", blob(10))
    keep = blob(5)
    cache.put("r2", "cond", "a", keep)
    assert cache.clear_namespace("r1") == 2
    assert cache.get("r1", "cond", "a") is None and cache.get("r1", "uncond", "a") is None
    assert cache.get("r2", "cond", "a") is keep
    assert cache.used_bytes == 5 and cache.namespaces() == ["r2"]


def test_clear_unknown_namespace_is_a_noop() -> None:
    cache = _cache(100)
    cache.put("r1", "cond", "a", blob(10))
    assert cache.clear_namespace("nope") == 0
    assert cache.used_bytes == 10 and len(cache) == 1


def test_put_replaces() -> None:
    cache = _cache(100)
    cache.put("r", "cond", "a", blob(30))
    new = blob(10)
    cache.put("r", "cond", "a", new)
    assert cache.get("r", "cond", "a") is new and cache.used_bytes == 10 and len(cache) == 1


# ---------------------------------------------------------------------------------------
# Seed bug: no byte accounting, no budget
def test_bytes_are_accounted_and_budget_enforced_lru_first() -> None:
    cache = _cache(100)
    for i in range(3):
        assert cache.put(f"r{i % 2}", "cond", f"b{i}", blob(30))
    assert cache.used_bytes == 90
    cache.get("r0", "cond", "b0")  # b0 becomes most recent; b1 is the oldest
    cache.put("r2", "uncond", "x", (blob(5), [blob(10)]))  # 105 > 100: evict b1
    assert cache.get("r1", "cond", "b1") is None
    assert cache.used_bytes == 75 and cache.evictions == 1
    assert cache.keys() == [("r0", "cond", "b2"), ("r0", "cond", "b0"), ("r2", "uncond", "x")]


def test_value_larger_than_budget_is_not_stored_and_evicts_nothing() -> None:
    cache = _cache(50)
    cache.put("r", "cond", "a", blob(20))
    assert cache.put("r", "cond", "huge", blob(51)) is False
    assert cache.get("r", "cond", "huge") is None
    assert cache.used_bytes == 20 and cache.rejected == 1 and cache.evictions == 0


def test_rejected_put_never_leaves_a_stale_residual() -> None:
    cache = _cache(50)
    cache.put("r", "cond", "a", blob(20))
    cache.put("r", "cond", "a", blob(60))  # the newer residual does not fit
    assert cache.get("r", "cond", "a") is None
    assert cache.used_bytes == 0 and cache.namespaces() == []


class _CountingStr(str):
    """A str that counts how often it is compared for equality."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        type(self).comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_clear_namespace_does_not_scan_other_namespaces() -> None:
    cache = _cache(1 << 20)
    for i in range(2000):
        cache.put(f"other{i % 50}", "cond", f"b{i}", None)
    for i in range(3):
        cache.put("mine", "cond", f"b{i}", blob(1))
    _CountingStr.comparisons = 0
    assert cache.clear_namespace(_CountingStr("mine")) == 3
    # an index lookup compares a handful of keys; a scan would compare ~2000
    assert _CountingStr.comparisons <= 3
    assert len(cache) == 2000 and cache.used_bytes == 0


def test_eviction_updates_the_namespace_index() -> None:
    cache = _cache(20)
    cache.put("old", "cond", "a", blob(20))
    cache.put("new", "cond", "a", blob(20))
    assert cache.namespaces() == ["new"]
    assert cache.clear_namespace("old") == 0
    assert cache.used_bytes == 20


# ---------------------------------------------------------------------------------------
# scope
def test_scope_clears_on_exit() -> None:
    cache = _cache(100)
    cache.put("other", "cond", "a", blob(1))
    with cache.scope("req") as c:
        assert c is cache
        c.put("req", "cond", "a", blob(10))
        assert cache.get("req", "cond", "a") is not None
    assert cache.get("req", "cond", "a") is None
    assert cache.used_bytes == 1 and cache.namespaces() == ["other"]


def test_scope_clears_on_exception() -> None:
    cache = _cache(100)
    with pytest.raises(RuntimeError, match="denoise failed"), cache.scope("req"):
        cache.put("req", "uncond", "a", blob(10))
        raise RuntimeError("denoise failed")
    assert len(cache) == 0 and cache.used_bytes == 0


def test_scope_rejects_non_str_namespace_on_entry() -> None:
    cache = _cache(100)
    with pytest.raises(TypeError, match="namespace"), cache.scope(7):  # type: ignore[arg-type]
        pass


# ---------------------------------------------------------------------------------------
# Values and validation
def test_values_are_detached(seed: int) -> None:
    x = torch.randn(4, requires_grad=True)
    r = x * 3
    cache = _cache(100)
    cache.put("r", "cond", "a", r)
    got = cache.get("r", "cond", "a")
    assert not got.requires_grad and got.grad_fn is None and torch.equal(got, r.detach())


def test_a_row_of_a_batch_does_not_keep_the_batch_alive(seed: int) -> None:
    # what a CFG/batched denoiser does: one residual per request from one batch tensor
    batch = torch.randn(8, 256)  # 8 KiB; each row 1 KiB
    cache = _cache(4 * 1024)
    for j in range(4):
        assert cache.put(f"req{j}", "cond", "tail", batch[j])
    assert cache.used_bytes == 4 * 1024, f"4 rows must count 4 KiB, got {cache.used_bytes}"
    for j in range(4):
        got = cache.get(f"req{j}", "cond", "tail")
        assert torch.equal(got, batch[j])
        assert got.untyped_storage().nbytes() == 1024, (
            f"row {j} keeps {got.untyped_storage().nbytes()} bytes alive, not its own 1024"
        )


@pytest.mark.parametrize(
    "args, exc, name",
    [
        pytest.param((1, "cond", "a"), TypeError, "namespace", id="namespace-int"),
        pytest.param((None, "cond", "a"), TypeError, "namespace", id="namespace-none"),
        pytest.param(("r", 0, "a"), TypeError, "branch", id="branch-parity-int"),
        pytest.param(("r", None, "a"), TypeError, "branch", id="branch-none"),
        pytest.param(("r", "", "a"), ValueError, "branch", id="branch-empty"),
        pytest.param(("r", "cond", 5), TypeError, "name", id="name-int"),
    ],
)
def test_bad_keys_raise_and_change_nothing(args: tuple, exc: type, name: str) -> None:
    cache = _cache(100)
    cache.put("r", "cond", "a", blob(10))
    before = (cache.stats(), cache.keys())
    with pytest.raises(exc, match=name):
        cache.put(*args, blob(1))
    with pytest.raises(exc, match=name):
        cache.get(*args)
    assert (cache.stats(), cache.keys()) == before


def test_clear_namespace_type_error() -> None:
    with pytest.raises(TypeError, match="namespace"):
        _cache(10).clear_namespace(b"r")  # type: ignore[arg-type]


def test_policy_must_be_a_cache_policy() -> None:
    with pytest.raises(TypeError, match="policy"):
        ResidualCache(None)  # type: ignore[arg-type]


def test_stats() -> None:
    cache = _cache(30)
    cache.put("a", "cond", "x", blob(20))
    cache.put("b", "cond", "x", blob(20))
    cache.put("b", "cond", "y", blob(40))
    cache.get("b", "cond", "x")
    cache.get("a", "cond", "x")
    assert cache.stats() == {
        "hits": 1,
        "misses": 1,
        "evictions": 1,
        "rejected": 1,
        "entries": 1,
        "namespaces": 1,
        "used_bytes": 20,
        "max_bytes": 30,
    }


# ---------------------------------------------------------------------------------------
# Stateful model check
_NS = ("r0", "r1", "r2")
_BR = ("cond", "uncond")
_NAMES = ("x", "y")


class ResidualCacheMachine(RuleBasedStateMachine):
    """Random puts/gets/clears/scopes against an OrderedDict model."""

    @initialize(max_bytes=st.integers(0, 64))
    def setup(self, max_bytes: int) -> None:
        self.cache = _cache(max_bytes)
        self.max_bytes = max_bytes
        self.model: OrderedDict[tuple[str, str, str], tuple[Any, int]] = OrderedDict()
        self.hits = self.misses = self.evictions = self.rejected = 0

    def _model_put(self, key: tuple[str, str, str], value: Any, size: int) -> bool:
        self.model.pop(key, None)
        if size > self.max_bytes:
            self.rejected += 1
            return False
        self.model[key] = (value, size)
        while sum(s for _v, s in self.model.values()) > self.max_bytes:
            self.model.popitem(last=False)
            self.evictions += 1
        return True

    def _model_clear(self, ns: str) -> int:
        drop = [k for k in self.model if k[0] == ns]
        for k in drop:
            del self.model[k]
        return len(drop)

    @rule(
        ns=st.sampled_from(_NS),
        br=st.sampled_from(_BR),
        name=st.sampled_from(_NAMES),
        size=st.integers(0, 40),
    )
    def put(self, ns: str, br: str, name: str, size: int) -> None:
        value = blob(size)
        assert self.cache.put(ns, br, name, value) == self._model_put((ns, br, name), value, size)

    @rule(ns=st.sampled_from(_NS), br=st.sampled_from(_BR), name=st.sampled_from(_NAMES))
    def get(self, ns: str, br: str, name: str) -> None:
        key = (ns, br, name)
        got = self.cache.get(ns, br, name)
        if key in self.model:
            self.model.move_to_end(key)
            self.hits += 1
            assert got is self.model[key][0]
        else:
            self.misses += 1
            assert got is None

    @rule(ns=st.sampled_from((*_NS, "unknown")))
    def clear_namespace(self, ns: str) -> None:
        assert self.cache.clear_namespace(ns) == self._model_clear(ns)

    @rule(ns=st.sampled_from(_NS), sizes=st.lists(st.integers(0, 20), max_size=3))
    def scoped_request(self, ns: str, sizes: list[int]) -> None:
        with self.cache.scope(ns):
            for i, size in enumerate(sizes):
                value = blob(size)
                key = (ns, _BR[i % 2], _NAMES[i % 2])
                assert self.cache.put(*key, value) == self._model_put(key, value, size)
        self._model_clear(ns)

    @invariant()
    def matches_model(self) -> None:
        expected_bytes = sum(s for _v, s in self.model.values())
        assert self.cache.used_bytes == expected_bytes <= self.max_bytes
        assert self.cache.keys() == list(self.model)
        assert sorted(self.cache.namespaces()) == sorted({k[0] for k in self.model})
        assert self.cache.stats() == {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "rejected": self.rejected,
            "entries": len(self.model),
            "namespaces": len({k[0] for k in self.model}),
            "used_bytes": expected_bytes,
            "max_bytes": self.max_bytes,
        }


TestResidualCacheMachine = ResidualCacheMachine.TestCase
TestResidualCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ---------------------------------------------------------------------------------------
# Threads
def test_eight_threads_keep_accounting_exact(seed: int) -> None:
    cache = _cache(3000)
    blobs = [blob(n) for n in range(0, 300, 11)]
    lookups = [0] * 8
    start = threading.Barrier(8)

    def worker(tid: int) -> None:
        rng = random.Random(seed * 17 + tid)
        start.wait()
        for _ in range(2000):
            ns = f"req{rng.randrange(6)}"
            op = rng.random()
            if op < 0.5:
                cache.put(ns, rng.choice(_BR), f"b{rng.randrange(8)}", rng.choice(blobs))
            elif op < 0.85:
                cache.get(ns, rng.choice(_BR), f"b{rng.randrange(8)}")
                lookups[tid] += 1
            elif op < 0.97:
                cache.clear_namespace(ns)
            else:
                cache.stats()

    errors = run_threads(worker, 8)
    assert not errors, errors
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == sum(lookups)
    assert stats["evictions"] > 0
    keys = cache.keys()
    stored = sum(value_nbytes(cache.get(*k)) for k in keys)
    assert stats["used_bytes"] == stored <= stats["max_bytes"]
    assert sorted(cache.namespaces()) == sorted({k[0] for k in keys})


def test_interleaved_requests_never_see_each_other(seed: int) -> None:
    cache = _cache(1 << 20)
    start = threading.Barrier(8)
    seen_foreign: list[tuple[int, int]] = []

    def request(tid: int) -> None:
        rng = random.Random(seed + tid)
        ns = f"request-{tid}"
        start.wait()
        for step in range(250):
            for br in _BR:
                cache.put(ns, br, "residual", torch.full((4,), tid, dtype=torch.int32))
            for br in _BR:
                got = cache.get(ns, br, "residual")
                if got is None or int(got[0]) != tid:
                    seen_foreign.append((tid, step))
            if rng.random() < 0.1:
                cache.clear_namespace(ns)
                if cache.get(ns, "cond", "residual") is not None:
                    seen_foreign.append((tid, -step))
        cache.clear_namespace(ns)

    errors = run_threads(request, 8)
    assert not errors, errors
    assert not seen_foreign
    assert len(cache) == 0 and cache.used_bytes == 0
