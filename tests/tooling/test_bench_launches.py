"""The benchmark times what the pools launch.

A chunk row of ``kvarena bench`` must run the kernel specialization that
``SlabKVCache.forward`` runs for the same shapes (a review found the chunk rows timing the
guarded causal page path while the pool launches the non-causal large-block path), and a
decode row the one ``PagedKVCache.forward`` runs. Both sides run through the Triton
interpreter here with the launcher's constexpr builder recorded: the recorded
specializations (path, masks, own k/v, splits, tiles) must be equal.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvarena
from kvarena.benchmark.cases import cases
from kvarena.benchmark.providers import build, make_data
from kvarena.kernels import attn_plan

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.fixture
def launches(monkeypatch):
    """Every ``_attn_constexprs`` result of the calls made while the fixture is active."""
    seen: list[dict] = []
    real = attn_plan._attn_constexprs

    def record(*args, **kwargs):
        meta = real(*args, **kwargs)
        seen.append(dict(meta))
        return meta

    monkeypatch.setattr(attn_plan, "_attn_constexprs", record)
    return seen


def _case(name: str):
    return next(c for c in cases("quick") if c.name == name)


def _bench_launch(case, launches) -> dict:
    data = make_data(case, "cpu")
    b = build("kvarena", case, data, backend="triton")
    launches.clear()
    b.fn()
    assert len(launches) == 1, f"{case.name}: the bench call made {len(launches)} launches, the pool makes one"
    return launches[0]


def _slab_launches(case, launches) -> dict[bool, dict]:
    """The constexprs of a ``SlabKVCache`` denoising (commit=False) and commit step of the
    case's next chunk, once its window is full (a recycled slab)."""
    layout = kvarena.KVLayout(1, case.h_kv, case.head_dim, getattr(torch, case.dtype))
    per = {"window": case.window, "sinks": case.sinks}
    slots = case.sinks + case.window + 1
    pool = kvarena.SlabKVCache(kvarena.CachePolicy("slab_kv", layout.block_bytes(case.chunk) * slots,
                                                   per_component=per),
                               layout=layout, slab_tokens=case.chunk, attention=kvarena.AttentionSpec(backend="triton"))
    dt = getattr(torch, case.dtype)
    out = {}
    for c in range(case.sinks + case.window + 1):
        meta = pool.plan({"video": c})
        q = torch.randn(1, case.chunk, case.h_q, case.head_dim, dtype=dt)
        k, v = (torch.randn(1, case.chunk, case.h_kv, case.head_dim, dtype=dt) for _ in range(2))
        last = c == case.sinks + case.window
        for commit in (False, True):
            launches.clear()
            pool.forward(q, k, v, meta, 0, commit=commit)
            if last:
                assert len(launches) == 1, f"commit={commit}: the pool made {len(launches)} launches"
                out[commit] = launches[0]
    return out


@pytest.mark.parametrize("window", [3], ids=["w3"])
def test_chunk_rows_launch_what_the_slab_pool_launches(launches, window) -> None:
    pool = _slab_launches(_case(f"chunk-tiny-w{window}-commit"), launches)
    for step, commit in (("denoise", False), ("commit", True)):
        bench = _bench_launch(_case(f"chunk-tiny-w{window}-{step}"), launches)
        diff = {k: (bench.get(k), pool[commit].get(k)) for k in set(bench) | set(pool[commit])
                if bench.get(k) != pool[commit].get(k)}
        assert not diff, f"{step}: bench vs pool constexprs differ (bench, pool): {diff}"
    assert pool[True]["LARGE_BLOCKS"] and not pool[True]["CAUSAL"], "the slab pool's chunks are non-causal slabs"
    assert pool[False]["HAS_OWN"], "a denoising step attends its own keys in the same launch"


def test_guarded_row_is_the_other_path(launches) -> None:
    guarded = _bench_launch(_case("chunk-tiny-w3-guarded"), launches)
    commit = _bench_launch(_case("chunk-tiny-w3-commit"), launches)
    assert guarded["CAUSAL"] and not guarded["LARGE_BLOCKS"], guarded
    assert commit["LARGE_BLOCKS"] and not commit["CAUSAL"], commit


def test_decode_rows_launch_what_the_paged_pool_launches(launches) -> None:
    compact = _bench_launch(_case("decode-b2-ctx256"), launches)
    pool = _bench_launch(_case("decode-b2-ctx256-pool32"), launches)
    diff = {k: (compact[k], pool[k]) for k in compact if compact[k] != pool.get(k)}
    assert not diff, f"compact decode row vs PagedKVCache.forward constexprs differ: {diff}"
