"""Decode, chunk-attention and store cases x providers, from ``kvarena.benchmark.cases``.

Each test builds one provider on the case's shared data, checks its output against
kvarena's once (a fast-but-wrong provider fails here, it is not just a number), then
hands the call to pytest-benchmark. Providers that cannot run on this machine skip with
the reason the registry gives (library missing, backend refused, ...).
"""

from __future__ import annotations

import pytest
import torch

from kvarena.benchmark.providers import Skip, build, rel_err, work_of
from kvarena.benchmark.runner import synced

# bf16 data, fp32 accumulation everywhere: observed max relative errors are ~5e-3.
_TOL = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-4}


def _build(provider, case, data):
    try:
        return build(provider, case, data)
    except Skip as exc:
        pytest.skip(str(exc))
    except Exception as exc:
        if provider == "kvarena":
            raise
        pytest.skip(f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")


def test_provider(benchmark, case_provider, device, data_cache):
    case, provider = case_provider
    if provider in case.skip_providers:
        pytest.skip("not run on this case (keeps the set within its time budget)")
    data = data_cache.get(case, device)
    if data_cache.ref is None:
        kv = build("kvarena", case, data)
        data_cache.ref = kv.to_ref(kv.fn()).detach().clone()
    b = _build(provider, case, data)
    try:
        out = b.to_ref(b.fn())
    except Exception as exc:
        if provider == "kvarena":
            raise
        pytest.skip(f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    err = None if out is None else rel_err(out, data_cache.ref)  # None: no attention output (copy)
    assert err is None or err <= _TOL[case.dtype], f"{provider} differs from kvarena on {case.name}: max rel err {err:.3e}"
    del out
    benchmark.group = case.name
    benchmark.extra_info.update({"provider": provider, "max_rel_err": err, "note": b.note,
                                 **case.as_dict(), **work_of(case)})
    benchmark(synced(b.fn, device))
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:
        sec = stats.stats.median
        w = work_of(case)
        if "kv_bytes" in w:
            benchmark.extra_info["kv_gbps"] = w["kv_bytes"] / sec / 1e9
            benchmark.extra_info["tflops"] = w["flops"] / sec / 1e12
        else:
            benchmark.extra_info["store_gbps"] = w["store_bytes"] / sec / 1e9
    if device.type == "cuda":
        torch.cuda.empty_cache()
