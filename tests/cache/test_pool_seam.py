"""The public seam both KV pools give an integration (docs/architecture.md, "the integration
seam"): ``check_forward`` (what ``forward`` would refuse, before a plan), ``block_table`` of a
set of namespaces and ``attend`` of a batch of query rows over the stored keys.

``attend`` is compared with a dense fp64 softmax written here over the K/V the test stored
(not the pool's bytes), ``block_table`` with the pools' own bookkeeping (``table`` /
``block_ids``, ``rollout_info``); every refused call is shown to change nothing.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import one_torch_thread  # noqa: F401 - autouse fixture

from kvarena.attention.batch import KeySet, QueryRows
from kvarena.cache.arena import KVLayout
from kvarena.cache.keys import CachePolicy
from kvarena.cache.paged import PagedKVCache
from kvarena.cache.slab import SlabKVCache

LAY = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
ST = 4  # slab tokens
BACKENDS = ["torch", "triton"]


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp64 softmax attention of q ``[n, H_q, D]`` over every row of k, v ``[m, 1, D]``."""
    q, k, v = q.double(), k.double()[:, 0], v.double()[:, 0]
    p = torch.softmax(torch.einsum("nhd,md->nhm", q, k) * q.shape[-1] ** -0.5, dim=-1)
    return torch.einsum("nhm,md->nhd", p, v)


def _paged(**kw) -> PagedKVCache:
    return PagedKVCache(CachePolicy("paged_kv", LAY.block_bytes(4) * 16), layout=LAY, block_size=4, **kw)


def _slab() -> SlabKVCache:
    policy = CachePolicy("slab_kv", LAY.block_bytes(ST) * 8, per_component={"window": 2, "sinks": 1})
    return SlabKVCache(policy, layout=LAY, slab_tokens=ST)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attend_over_a_block_table_equals_dense_attention(backend, seed):
    pool = _paged()
    meta = pool.plan({"a": 6, "b": 3})
    k, v = torch.randn(9, 1, 8), torch.randn(9, 1, 8)
    pool.forward(torch.randn(9, 2, 8), k, v, meta, 1)
    pool.fork("a", "c")  # queued table entries: block_table writes them first
    table = pool.block_table(["a", "b", "c"])
    assert table.dtype == torch.int32 and table.shape == (3, 2)
    assert table[0].tolist() == table[2].tolist() == pool.block_ids("a")
    assert table[1, :1].tolist() == pool.block_ids("b")
    assert table[0].tolist() == pool.table[0, pool.table_row("a"), :2].tolist()
    before = pool.region.data.clone()  # bytes: blocks never written hold whatever empty() gave, NaN too
    q = torch.randn(3, 2, 8)
    keys = KeySet(table, torch.tensor([6, 3, 6], dtype=torch.int32), 6,
                  kv_start=torch.tensor([2, 0, 0], dtype=torch.int32))
    out = pool.attend(q, 1, keys, QueryRows(torch.arange(4, dtype=torch.int32), 1), backend=backend)
    ref = torch.cat([_dense(q[0:1], k[2:6], v[2:6]), _dense(q[1:2], k[6:9], v[6:9]), _dense(q[2:3], k[0:6], v[0:6])])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool.region.data.view(torch.uint8), before.view(torch.uint8))  # attend writes nothing


@pytest.mark.parametrize("backend", BACKENDS)
def test_slab_attend_over_a_block_table_equals_dense_attention(backend, seed):
    pool = _slab()
    kvs = [torch.randn(1, ST, 1, 8) for _ in range(4)]
    for c, kv in enumerate(kvs):
        pool.forward(torch.randn(1, ST, 2, 8), kv, -kv, pool.plan({"video": c}), 0)
    assert pool.chunk_indices("video") == [0, 2, 3]  # the sink, then the window
    table = pool.block_table(["video"])
    assert table.tolist() == [[ch.slot for ch in pool.rollout_info("video").chunks]]
    q = torch.randn(2 * ST, 2, 8)
    keys = KeySet(table, torch.tensor([3 * ST], dtype=torch.int32), 3 * ST)
    out = pool.attend(q, 0, keys, QueryRows(torch.tensor([0, 2 * ST], dtype=torch.int32), 2 * ST), backend=backend)
    k = torch.cat([kvs[c][0] for c in (0, 2, 3)])
    torch.testing.assert_close(out.double(), _dense(q, k, -k), atol=1e-5, rtol=1e-5)  # full attention over the list


@pytest.mark.parametrize("make", [_paged, _slab], ids=["paged", "slab"])
def test_block_table_and_attend_refuse_bad_arguments(make):
    pool = make()
    with pytest.raises(KeyError, match="nope"):
        pool.block_table(["nope"])
    with pytest.raises(ValueError, match="group"):
        pool.block_table([], group=1)
    assert pool.block_table([]).shape == (0, 1)
    table = torch.zeros(1, 1, dtype=torch.int32)
    rows = QueryRows(torch.tensor([0, 1], dtype=torch.int32), 1)
    keys = KeySet(table, torch.ones(1, dtype=torch.int32), 1)
    with pytest.raises(TypeError, match="keys"):
        pool.attend(torch.randn(1, 2, 8), 0, (table,), rows)
    with pytest.raises(ValueError, match="layer"):
        pool.attend(torch.randn(1, 2, 8), 2, keys, rows)
    with pytest.raises(TypeError, match="causal"):  # forward's per-call option rule
        pool.attend(torch.randn(1, 2, 8), 0, keys, rows, causal=False)


def _calls(kind: str):
    """A pool, a batch for its plan, and q, k, v of one layer call of that plan."""
    if kind == "paged":
        return _paged(), {"a": 3, "b": 2}, torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    return _slab(), {"v0": 0, "v1": 0}, torch.randn(2, ST, 2, 8), torch.randn(2, ST, 1, 8), torch.randn(2, ST, 1, 8)


@pytest.mark.parametrize("kind", ["paged", "slab"])
@pytest.mark.parametrize("bad", ["layer", "head_dim", "option"])
def test_check_forward_raises_what_forward_would_and_plans_nothing(kind, bad):
    pool, batch, q, k, v = _calls(kind)
    layer, options = 0, {}
    if bad == "layer":
        layer = 2
    elif bad == "head_dim":
        q = q[..., :4]  # the layout's head_dim is 8
    else:
        options = {"sink_tokens": 1} if kind == "slab" else {"causal": False}
    with pytest.raises((TypeError, ValueError)) as before:
        pool.check_forward(batch, q, k, v, layer, **options)
    assert pool.namespaces() == []  # nothing planned, nothing made
    meta = pool.plan(batch)
    with pytest.raises(type(before.value)) as after:
        pool.forward(q, k, v, meta, layer, **options)
    assert str(after.value) == str(before.value)


@pytest.mark.parametrize("kind", ["paged", "slab"])
def test_check_forward_passes_a_call_forward_takes(kind, seed):
    pool, batch, q, k, v = _calls(kind)
    assert pool.check_forward(batch, q, k, v, 1) is None
    pool.forward(q, k, v, pool.plan(batch), 1)


def test_paged_check_forward_counts_the_padded_plan_rows():
    pool = _paged()
    q, k = torch.randn(6, 2, 8), torch.randn(6, 1, 8)
    pool.check_forward({"a": 3, "b": 1}, q, k, k, 0, pad_to=3)  # 2 rows x 3
    with pytest.raises(ValueError, match="q"):
        pool.check_forward({"a": 3, "b": 1}, q, k, k, 0)  # packed: 4 rows, not 6
    with pytest.raises(ValueError, match="batch"):
        pool.check_forward({"a": 4}, q, k, k, 0, pad_to=3)  # as plan: more new tokens than pad_to
    assert pool.namespaces() == []


def test_paged_check_forward_without_a_layout_raises_what_forward_does():
    pool = PagedKVCache(CachePolicy("paged_kv", max_bytes=1 << 12, block_bytes=64), block_size=4)
    q = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="no layout") as before:
        pool.check_forward({"a": 2}, q, q, q, 0)
    meta = pool.plan({"a": 2})
    with pytest.raises(RuntimeError) as after:
        pool.forward(q, q, q, meta, 0)
    assert str(after.value) == str(before.value)
