"""Dict-cache budgets count what a value keeps alive (both FeatureCache and ResidualCache).

Regressions for budget bypasses: a small view of a large tensor was counted by its own
elements while pinning the whole base, and tensors inside sets, frozensets and deques
(or any object the counter did not know) counted 0 bytes.
"""

from __future__ import annotations

import dataclasses
import gc
import types
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import blob

from kvarena.cache._bytes import value_nbytes
from kvarena.cache.feature import FeatureCache
from kvarena.cache.keys import CacheKey, CachePolicy
from kvarena.cache.residual import ResidualCache

MIB = 1 << 20


class _Feature:
    """A FeatureCache addressed by plain names (the content hash of the key)."""

    def __init__(self, max_bytes: int) -> None:
        self.cache = FeatureCache(CachePolicy("feature", max_bytes))

    def put(self, name: str, value: Any) -> bool:
        return self.cache.put(CacheKey("te", name, "w0"), value)

    def get(self, name: str) -> Any:
        return self.cache.get(CacheKey("te", name, "w0"))

    def names(self) -> list[str]:
        stored = self.cache.keys()  # an LRU-ordered list, not a dict view
        return [k.content_hash for k in stored]


class _Residual:
    """A ResidualCache addressed by plain names (one namespace and branch)."""

    def __init__(self, max_bytes: int) -> None:
        self.cache = ResidualCache(CachePolicy("residual", max_bytes))

    def put(self, name: str, value: Any) -> bool:
        return self.cache.put("req", "cond", name, value)

    def get(self, name: str) -> Any:
        return self.cache.get("req", "cond", name)

    def names(self) -> list[str]:
        stored = self.cache.keys()
        return [k[2] for k in stored]


_CACHES = pytest.mark.parametrize(
    "make", [pytest.param(_Feature, id="feature"), pytest.param(_Residual, id="residual")]
)


@dataclasses.dataclass
class _Out:
    parts: Any


def _as_dict(items: list[Any]) -> dict[int, Any]:
    return dict(enumerate(items))  # int keys count 0, so the expected bytes stay simple


# every container the counter walks, built from a list of parts
_CONTAINERS = pytest.mark.parametrize(
    "build",
    [
        pytest.param(tuple, id="tuple"),
        pytest.param(list, id="list"),
        pytest.param(_as_dict, id="dict"),
        pytest.param(set, id="set"),
        pytest.param(frozenset, id="frozenset"),
        pytest.param(deque, id="deque"),
        pytest.param(_Out, id="dataclass"),
    ],
)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside ``value`` (the containers of ``_CONTAINERS``), in any order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    elif isinstance(value, _Out):
        value = [value.parts]
    if isinstance(value, (tuple, list, set, frozenset, deque)):
        return [t for v in value for t in _tensors(v)]
    return []


def _kept_alive(value: Any) -> int:
    """Bytes of the distinct storages the tensors of ``value`` hold (counted independently)."""
    storages = {}
    for t in _tensors(value):
        s = t.untyped_storage()
        storages[s.data_ptr() or id(t)] = s.nbytes()
    return sum(storages.values())


# ---------------------------------------------------------------------------------------
# Views
@_CACHES
def test_one_element_view_of_a_1mib_tensor_does_not_pin_it(make: Callable[[int], Any]) -> None:
    big = torch.zeros(MIB // 4)  # 1 MiB of float32
    big[0] = 7.0
    base = weakref.ref(big)
    c = make(2 * MIB)
    assert c.put("a", big[:1])
    del big
    gc.collect()
    got = c.get("a")
    kept = got.untyped_storage().nbytes()
    assert kept == 4, f"the stored view keeps {kept} bytes alive, not its own 4"
    assert base() is None, "the cache still keeps the 1 MiB base tensor alive"
    assert c.cache.used_bytes == 4 >= kept, f"counted {c.cache.used_bytes}, keeps {kept}"
    assert got.tolist() == [7.0], f"the compact copy lost the data: {got.tolist()}"


@_CACHES
def test_a_view_of_a_grad_tensor_is_detached_and_compacted(make: Callable[[int], Any]) -> None:
    w = torch.ones(1000, requires_grad=True)
    c = make(MIB)
    assert c.put("a", (w * 2)[:3])
    got = c.get("a")
    assert not got.requires_grad and got.grad_fn is None, "an autograd graph was kept alive"
    assert got.untyped_storage().nbytes() == 12 == c.cache.used_bytes, (
        f"keeps {got.untyped_storage().nbytes()}, counted {c.cache.used_bytes}, expected 12"
    )


@_CACHES
@pytest.mark.parametrize(
    "value_of, expected",
    [
        pytest.param(lambda big: (big[:2], big[2:4]), 16, id="two-disjoint-slices-copied"),
        pytest.param(lambda big: (big[:2], big[:2]), 16, id="two-equal-slices-copied"),
        pytest.param(lambda big: (big, big[:10], big[5:]), MIB, id="base-and-its-views-once"),
        pytest.param(lambda big: big.view(2, -1).unbind(0), MIB, id="halves-covering-base"),
        pytest.param(lambda big: [big, big.view(4, -1)], MIB, id="two-views-of-one-storage"),
    ],
)
def test_tensors_sharing_a_storage_are_counted_as_what_they_keep_alive(
    make: Callable[[int], Any], value_of: Callable[[torch.Tensor], Any], expected: int
) -> None:
    big = torch.zeros(MIB // 4)
    value = value_of(big)
    c = make(2 * MIB)
    assert c.put("a", value)
    got = c.get("a")
    kept = _kept_alive(got)
    assert c.cache.used_bytes == kept == expected, (
        f"counted {c.cache.used_bytes}, keeps {kept} bytes alive, expected {expected}"
    )
    if expected == MIB:  # copying would keep more alive: the value is stored as it is
        assert got is value, "views that together cover their storage were copied"


@_CACHES
def test_an_expanded_tensor_is_stored_as_is_and_counts_its_storage(
    make: Callable[[int], Any],
) -> None:
    row = torch.arange(8, dtype=torch.float32)
    value = row.expand(1000, 8)  # 32 000 logical bytes over a 32-byte storage
    c = make(100)
    assert c.put("a", value), "an expanded tensor keeps 32 bytes alive; it fits in 100"
    assert c.get("a") is value and c.cache.used_bytes == 32, c.cache.stats()


@_CACHES
def test_numpy_views_are_copied(make: Callable[[int], Any]) -> None:
    base = np.zeros(MIB // 8)  # 1 MiB of float64
    c = make(MIB)
    assert c.put("arr", base[:1])
    assert c.put("t", torch.from_numpy(base[:2]))  # torch sees 16 bytes, numpy pins 1 MiB
    arr, t = c.get("arr"), c.get("t")
    assert arr.flags.owndata and arr.base is None, "the stored array still views the 1 MiB base"
    assert t.untyped_storage().nbytes() == 16 and t.untyped_storage().resizable(), (
        "a tensor over numpy memory must be copied into memory torch owns"
    )
    assert c.cache.used_bytes == 8 + 16, c.cache.stats()
    assert value_nbytes(base[:1]) == MIB, "a numpy view counts the base it keeps alive"


def test_a_memoryview_slice_counts_its_whole_buffer() -> None:
    buf = bytes(1000)
    assert value_nbytes(memoryview(buf)[:1]) == 1000
    c = _Feature(100)
    assert c.put("mv", memoryview(buf)[:1]) is False, "a 1-byte slice of 1000 bytes fit in 100"
    assert c.cache.used_bytes == 0 and c.cache.rejected == 1, c.cache.stats()


def test_a_tensor_dict_key_is_counted() -> None:
    big = torch.zeros(MIB // 4)
    assert value_nbytes({big: "label"}) == MIB + 5
    c = _Feature(MIB // 2)
    assert c.put("a", {big: "label"}) is False, "a 1 MiB key slipped past a 512 KiB budget"


# ---------------------------------------------------------------------------------------
# Containers
@_CACHES
@_CONTAINERS
def test_tensors_in_every_container_count_their_bytes(
    make: Callable[[int], Any], build: Callable[[list[Any]], Any]
) -> None:
    c = make(100)
    assert c.put("a", build([blob(10), blob(20)]))
    assert c.cache.used_bytes == 30, (
        f"{build.__name__} of 10 + 20 bytes counted {c.cache.used_bytes}"
    )
    assert c.put("big", build([blob(60), blob(50)])) is False, (
        f"a {build.__name__} of 110 bytes was stored under a 100-byte budget"
    )


@_CACHES
@_CONTAINERS
def test_views_in_every_container_are_compacted(
    make: Callable[[int], Any], build: Callable[[list[Any]], Any]
) -> None:
    big = torch.zeros(MIB // 4)
    c = make(MIB)
    assert c.put("a", build([big[:1], big[1:3]]))
    got = c.get("a")
    assert type(got) is type(build([])), f"stored a {type(got).__name__}, not a {build.__name__}"
    tensors = _tensors(got)
    assert sorted(t.numel() for t in tensors) == [1, 2], f"parts lost: {tensors}"
    for t in tensors:
        assert t.untyped_storage().nbytes() == 4 * t.numel(), (
            f"a {t.numel()}-element part keeps {t.untyped_storage().nbytes()} bytes alive"
        )
    assert c.cache.used_bytes == 12 == _kept_alive(got), c.cache.stats()


def test_containers_keep_their_type_and_a_deque_its_maxlen() -> None:
    big = torch.zeros(100)
    c = _Feature(MIB)
    value = deque([big[:1]], maxlen=3)
    assert c.put("a", value)
    got = c.get("a")
    assert isinstance(got, deque) and got.maxlen == 3, f"got {got!r}"
    assert got is not value and value[0].untyped_storage().nbytes() == 400, (
        "the caller's own deque was modified"
    )


def test_a_list_that_contains_itself_is_rebuilt_with_its_cycle() -> None:
    big = torch.zeros(100)
    value: list[Any] = [big[:1]]
    value.append(value)
    c = _Feature(MIB)
    assert c.put("a", value)
    got = c.get("a")
    assert got[1] is got, "the rebuilt list does not refer to itself"
    assert got[0].untyped_storage().nbytes() == 4 == c.cache.used_bytes, c.cache.stats()


# ---------------------------------------------------------------------------------------
# Values the counter cannot size
class _Holder:
    """An arbitrary object holding a tensor (nothing tells the counter what it keeps)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _tuple_cycle() -> tuple[Any, ...]:
    back: list[Any] = []
    value = (back, torch.zeros(100)[:1])  # the view must be copied, so the tuple rebuilt
    back.append(value)
    return value


_UNSIZABLE = [
    pytest.param(lambda: _Holder(blob(50)), "_Holder", id="object-holding-a-tensor"),
    pytest.param(lambda: (t for t in [blob(50)]), "generator", id="generator"),
    pytest.param(lambda: iter([blob(50)]), "list_iterator", id="iterator"),
    pytest.param(lambda: {"x": blob(50)}.values(), "dict_values", id="dict-view"),
    pytest.param(lambda: types.SimpleNamespace(t=blob(50)), "SimpleNamespace", id="namespace"),
    pytest.param(lambda: [blob(1), {"x": {_Holder(blob(50))}}], "_Holder", id="nested-object"),
    pytest.param(lambda: torch.eye(8).to_sparse(), "sparse", id="sparse-tensor"),
    pytest.param(lambda: np.array([blob(50)], dtype=object), "object array", id="object-ndarray"),
    pytest.param(_tuple_cycle, "cycle through a tuple", id="tuple-cycle"),
]


@_CACHES
@pytest.mark.parametrize("bad, what", _UNSIZABLE)
def test_an_unsizable_value_raises_type_error_and_changes_nothing(
    make: Callable[[int], Any], bad: Callable[[], Any], what: str
) -> None:
    c = make(30)
    a, b = blob(10), blob(20)
    c.put("a", a)
    c.put("b", b)  # the budget is full: any store would evict "a"
    before = (c.cache.stats(), c.names())
    with pytest.raises(TypeError, match=rf"^value: .*{what}"):
        c.put("a", bad())  # also an existing key: its entry must survive
    with pytest.raises(TypeError, match=rf"^value: .*{what}"):
        c.put("new", bad())
    after = (c.cache.stats(), c.names())
    assert after == before, f"a put that raised changed the cache: {before} -> {after}"
    assert c.get("a") is a and c.get("b") is b, "a put that raised replaced a stored value"


# ---------------------------------------------------------------------------------------
# Budget and LRU with such values
@_CACHES
def test_budget_evicts_least_recently_used_with_compacted_and_container_values(
    make: Callable[[int], Any],
) -> None:
    big = torch.zeros(MIB // 4)
    c = make(100)
    assert c.put("view", big[:10])  # 40 bytes once compacted (1 MiB as a view)
    assert c.put("set", {blob(30), blob(30)})  # 60
    assert c.names() == ["view", "set"] and c.cache.used_bytes == 100, c.cache.stats()
    assert c.put("deque", deque([blob(20)]))  # 120 > 100: the view goes
    assert c.names() == ["set", "deque"] and c.cache.used_bytes == 80, c.cache.stats()
    assert c.get("set") is not None  # "deque" is now the least recently used
    assert c.put("frozenset", frozenset([big[10:15], blob(10)]))  # 20 + 10: "deque" goes
    assert c.names() == ["set", "frozenset"], f"LRU order {c.names()}"
    assert c.cache.evictions == 2, c.cache.stats()
    stored = [c.get(n) for n in c.names()]
    assert c.cache.used_bytes == sum(value_nbytes(v) for v in stored) == 90, (
        f"counted {c.cache.used_bytes}, stored values keep {[value_nbytes(v) for v in stored]}"
    )
    assert all(_kept_alive(v) == value_nbytes(v) for v in stored), "count and memory disagree"
