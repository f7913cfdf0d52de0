"""KVLayout, KVArena (one allocation, aligned regions, strided views) and BlockAllocator."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvarena.cache.arena import (
    ALIGN_BYTES,
    BlockAllocator,
    CacheFullError,
    KVArena,
    KVLayout,
    RegionSpec,
)

_LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16)


# ---------------------------------------------------------------------------------------
# KVLayout
def test_layout_bytes() -> None:
    lay = KVLayout(4, 8, 128, torch.bfloat16)
    assert lay.token_bytes == 4 * 2 * 8 * 128 * 2
    assert lay.block_bytes(16) == 4 * 2 * 16 * 8 * 128 * 2
    assert KVLayout(1, 1, 8, torch.float32).block_bytes(3) == 2 * 3 * 8 * 4


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        pytest.param(dict(num_layers=0), ValueError, "num_layers", id="zero-layers"),
        pytest.param(dict(num_kv_heads=-1), ValueError, "num_kv_heads", id="negative-heads"),
        pytest.param(dict(head_dim=8.0), TypeError, "head_dim", id="float-head-dim"),
        pytest.param(dict(num_layers=True), TypeError, "num_layers", id="bool-layers"),
        pytest.param(dict(dtype="float16"), TypeError, "dtype", id="str-dtype"),
        pytest.param(dict(dtype=torch.int8), ValueError, "dtype", id="int-dtype"),
    ],
)
def test_layout_rejects_bad_fields(kwargs: dict, exc: type, name: str) -> None:
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32) | kwargs
    with pytest.raises(exc, match=name):
        KVLayout(**fields)


def test_layout_is_frozen_and_hashable() -> None:
    with pytest.raises(AttributeError):
        _LAYOUT.num_layers = 5  # type: ignore[misc]
    assert hash(_LAYOUT) == hash(KVLayout(3, 2, 8, torch.float16))


def test_block_bytes_rejects_bad_block_tokens() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        _LAYOUT.block_bytes(0)


# ---------------------------------------------------------------------------------------
# KVArena
def _two_region_arena() -> KVArena:
    other = KVLayout(2, 1, 16, torch.float32)
    return KVArena(
        {
            "slab_kv": RegionSpec(_LAYOUT, block_tokens=5, max_bytes=_LAYOUT.block_bytes(5) * 3 + 7),
            "paged_kv": RegionSpec(other, block_tokens=4, max_bytes=other.block_bytes(4) * 6),
        }
    )


def test_arena_is_one_allocation_with_aligned_disjoint_regions() -> None:
    arena = _two_region_arena()
    assert arena.buffer.dtype == torch.uint8 and arena.buffer.dim() == 1
    assert arena.buffer.numel() == arena.nbytes
    base = arena.data_ptr()
    storage = arena.buffer.untyped_storage().data_ptr()
    spans = []
    for reg in arena.regions.values():
        assert reg.offset % ALIGN_BYTES == 0, f"{reg.name} offset {reg.offset} not aligned"
        assert reg.data.untyped_storage().data_ptr() == storage, f"{reg.name} is not a view"
        assert reg.data.data_ptr() == base + reg.offset
        spans.append((reg.offset, reg.offset + reg.nbytes))
    spans.sort()
    for (_a0, a1), (b0, _b1) in zip(spans, spans[1:]):
        assert a1 <= b0, f"regions overlap: {spans}"
    assert spans[-1][1] <= arena.nbytes


def test_region_budget_holds_whole_blocks() -> None:
    arena = _two_region_arena()
    slab = arena["slab_kv"]
    assert slab.num_blocks == 3  # the 7 spare bytes do not make a block
    assert slab.reserved_bytes == 3 * _LAYOUT.block_bytes(5)
    assert slab.used_bytes == 0 and slab.free_bytes == slab.reserved_bytes
    slab.allocator.alloc(2)
    assert slab.used_bytes == 2 * slab.block_bytes
    assert arena.used_bytes == slab.used_bytes
    assert arena.free_bytes + arena.used_bytes == arena.reserved_bytes


def test_region_views_shapes_and_write_through() -> None:
    arena = _two_region_arena()
    reg = arena["slab_kv"]
    lay = reg.layout
    assert tuple(reg.data.shape) == (3, lay.num_layers, 2, 5, lay.num_kv_heads, lay.head_dim)
    assert reg.data.dtype == lay.dtype
    for layer in range(lay.num_layers):
        k, v = reg.k(layer), reg.v(layer)
        assert tuple(k.shape) == (3, 5, lay.num_kv_heads, lay.head_dim)
        assert k.stride(-1) == 1 and v.stride(-1) == 1
        k.fill_(layer + 1)
        v.fill_(-(layer + 1))
    for layer in range(lay.num_layers):
        assert torch.all(reg.data[:, layer, 0] == layer + 1)
        assert torch.all(reg.data[:, layer, 1] == -(layer + 1))
    # views alias the arena buffer: the bytes of block 1, layer 2, V changed there
    assert reg.k(2).data_ptr() == reg.data[:, 2, 0].data_ptr()


def test_region_layer_out_of_range_names_layer() -> None:
    reg = _two_region_arena()["slab_kv"]
    with pytest.raises(ValueError, match="layer"):
        reg.k(3)
    with pytest.raises(TypeError, match="layer"):
        reg.v(1.0)  # type: ignore[arg-type]


def test_arena_zero_block_region_and_lookup_errors() -> None:
    arena = KVArena({"a": RegionSpec(_LAYOUT, 4, 10)})
    assert arena["a"].num_blocks == 0 and arena["a"].data.numel() == 0
    with pytest.raises(CacheFullError):
        arena["a"].allocator.alloc(1)
    with pytest.raises(KeyError, match="'b'"):
        arena["b"]
    with pytest.raises(TypeError, match="RegionSpec"):
        KVArena({"a": (_LAYOUT, 4, 10)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="regions"):
        KVArena([("a", RegionSpec(_LAYOUT, 4, 10))])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_bytes"):
        RegionSpec(_LAYOUT, 4, -1)


def test_arena_single_and_repr() -> None:
    arena = KVArena.single("paged_kv", _LAYOUT, 16, _LAYOUT.block_bytes(16) * 2)
    assert list(arena.regions) == ["paged_kv"] and arena["paged_kv"].num_blocks == 2
    assert "paged_kv" in repr(arena) and "paged_kv" in arena


# ---------------------------------------------------------------------------------------
# BlockAllocator
def test_allocator_alloc_free_order_and_counts() -> None:
    a = BlockAllocator(4)
    assert a.alloc(2) == [0, 1]
    assert a.num_used == 2 and a.num_free == 2
    assert a.decref([1]) == [1]
    assert a.alloc(1) == [1]  # a freed id is handed out next (LIFO)
    assert a.alloc(0) == []


def test_allocator_all_or_nothing_when_full() -> None:
    a = BlockAllocator(3)
    a.alloc(2)
    before = a.state()
    with pytest.raises(CacheFullError, match="need 2 blocks, only 1"):
        a.alloc(2)
    assert a.state() == before


@pytest.mark.parametrize(
    "blocks, match",
    [
        pytest.param([2], "block 2 freed more often", id="double-free"),
        pytest.param([7], "block id 7 out of range", id="out-of-range"),
        pytest.param([-1], "block id -1 out of range", id="negative"),
        pytest.param([0, 0], "block 0 freed more often", id="twice-in-one-call"),
    ],
)
def test_allocator_rejects_bad_frees_without_change(blocks: list, match: str) -> None:
    a = BlockAllocator(4)
    a.alloc(2)  # 0 and 1 allocated; 2 and 3 free
    before = a.state()
    with pytest.raises(ValueError, match=match):
        a.decref([1, *blocks])
    assert a.state() == before


def test_allocator_refcounts() -> None:
    a = BlockAllocator(2)
    (b,) = a.alloc(1)
    a.incref([b, b])
    assert a.refcount(b) == 3
    assert a.decref([b, b]) == []
    assert a.refcount(b) == 1 and a.num_used == 1
    assert a.free([b]) == [b]
    with pytest.raises(ValueError, match="not allocated"):
        a.incref([b])
    with pytest.raises(ValueError, match="n"):
        a.alloc(-1)
    with pytest.raises(TypeError, match="block id"):
        a.refcount("0")  # type: ignore[arg-type]


def test_allocator_is_thread_safe() -> None:
    a = BlockAllocator(64)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(300):
                ids = a.alloc(3)
                a.incref(ids[:1])
                a.decref(ids + ids[:1])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert a.num_free == 64 and a.num_used == 0
    assert sorted(a.alloc(64)) == list(range(64)), "a block id was lost or handed out twice"


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/incref/decref sequences against a model of the refcounts."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(12)
        self.model: dict[int, int] = {}  # block -> refcount

    @rule(n=st.integers(0, 5))
    def allocate(self, n: int) -> None:
        free = 12 - len(self.model)
        if n > free:
            with pytest.raises(CacheFullError):
                self.alloc.alloc(n)
            return
        ids = self.alloc.alloc(n)
        assert len(set(ids)) == n and not set(ids) & set(self.model), (ids, self.model)
        for b in ids:
            self.model[b] = 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def incref(self, data) -> None:
        b = data.draw(st.sampled_from(sorted(self.model)))
        self.alloc.incref([b])
        self.model[b] += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def decref(self, data) -> None:
        b = data.draw(st.sampled_from(sorted(self.model)))
        freed = self.alloc.decref([b])
        self.model[b] -= 1
        if self.model[b] == 0:
            del self.model[b]
            assert freed == [b]
        else:
            assert freed == []

    @rule(b=st.integers(-2, 14))
    def bad_free(self, b: int) -> None:
        if b in self.model:
            return
        with pytest.raises(ValueError, match=str(b)):
            self.alloc.decref([b])

    @invariant()
    def counts_match(self) -> None:
        assert self.alloc.num_used + self.alloc.num_free == 12
        assert self.alloc.num_used == len(self.model)
        for b in range(12):
            assert self.alloc.refcount(b) == self.model.get(b, 0), (b, self.model)

    def teardown(self) -> None:
        for b, n in list(self.model.items()):
            self.alloc.decref([b] * n)
        assert self.alloc.num_free == 12


AllocatorMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase
