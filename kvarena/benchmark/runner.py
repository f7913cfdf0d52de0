"""Timing, device ceilings and the case x provider loop.

Timing
------
CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls, 25 ms warmup,
100 ms of repeats) returning the median and the 20th/80th percentiles; CUDA events by
hand when triton is missing. CPU: ``time.perf_counter`` around each call after one
warmup call, repeated until ``cpu_reps`` calls or ``cpu_budget_s`` seconds (at least 3
calls), then the same quantiles.

Ceilings
--------
Measured in the same run, so fractions do not depend on a datasheet: copy bandwidth is
``(bytes read + bytes written) / time`` of one large device-to-device ``copy_`` (1 GiB
on CUDA, far past the H200's 50 MB L2); the matmul rate is ``2 n^3 / time`` of an
``n x n`` matmul (bf16, n = 8192 on CUDA; fp32, n = 1024 on CPU).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kvarena.benchmark.cases import BASELINES, NO_OUTPUT, Case, providers_for
from kvarena.benchmark.providers import Skip, build, make_data, rel_err, work_of

__all__ = ["sync", "synced", "time_fn", "measure_ceilings", "run_kernels", "progress", "quantiles"]


def sync(device: torch.device) -> None:
    """Wait for ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``fn`` followed by a device synchronize, for host-side timers (pytest-benchmark)."""
    if device.type != "cuda":
        return fn

    def run():
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return run


def quantiles(xs: list[float], qs: Iterable[float]) -> list[float]:
    """Linear-interpolated quantiles of ``xs`` (``qs`` in [0, 1])."""
    s = sorted(xs)
    out = []
    for q in qs:
        pos = q * (len(s) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return out


def time_fn(fn: Callable[[], Any], device: torch.device, *, cpu_reps: int = 20,
            cpu_budget_s: float = 0.25) -> dict[str, float]:
    """Time ``fn``; returns ``median_ms``, ``p20_ms``, ``p80_ms`` and ``n`` (calls timed)."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            med, p20, p80 = do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
            return {"median_ms": med, "p20_ms": p20, "p80_ms": p80, "n": math.nan}
        times = []
        fn()
        sync(device)
        for _ in range(cpu_reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        fn()  # warmup (caches, lazy init)
        times = []
        start = time.perf_counter()
        while len(times) < min(3, cpu_reps) or (len(times) < cpu_reps and time.perf_counter() - start < cpu_budget_s):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    med, p20, p80 = quantiles(times, (0.5, 0.2, 0.8))
    return {"median_ms": med, "p20_ms": p20, "p80_ms": p80, "n": len(times)}


def measure_ceilings(device: torch.device, *, quick: bool = False) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s) of ``device``."""
    big = device.type == "cuda" and not quick
    copy_bytes = (1 << 30) if big else (64 << 20)
    n = 8192 if big else 1024
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t_copy = time_fn(lambda: dst.copy_(src), device, cpu_reps=10)["median_ms"]
    src = dst = None  # free before the matmul operands
    # bf16 on CUDA (docs/contract.md's ceiling). On CPU the attention paths compute in fp32 and
    # bf16 GEMM is emulated (measured here: ~1 GFLOP/s vs tens for fp32), so fp32 is the
    # honest ceiling there.
    mm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=mm_dtype)
    b = torch.randn(n, n, device=device, dtype=mm_dtype)
    t_mm = time_fn(lambda: a @ b, device, cpu_reps=5)["median_ms"]
    return {
        "copy_gbps": 2 * copy_bytes / (t_copy * 1e-3) / 1e9,
        "copy_bytes": copy_bytes,
        "matmul_tflops": 2 * n**3 / (t_mm * 1e-3) / 1e12,
        "matmul_n": n,
        "matmul_dtype": str(mm_dtype).removeprefix("torch."),
    }


class _Plain:
    """Progress as plain lines when tqdm is not installed (or not wanted)."""

    def __init__(self, total: int, desc: str, stream=None) -> None:
        # stderr as it is now, not at import (a test harness may have swapped it since)
        self.total, self.desc, self.i, self.stream = total, desc, 0, stream or sys.stderr

    def set_postfix_str(self, s: str) -> None:
        print(f"[{self.desc} {self.i + 1}/{self.total}] {s}", file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.i += n

    def close(self) -> None:
        pass


def progress(total: int, desc: str, enabled: bool = True):
    """A tqdm bar when stderr is a terminal and tqdm is installed, else plain lines (a log
    or a pipe gets no carriage returns or escape codes); ``enabled=False``: silent."""
    if not enabled:
        p = _Plain(total, desc)
        p.set_postfix_str = lambda s: None
        return p
    if not sys.stderr.isatty():
        return _Plain(total, desc)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Plain(total, desc)
    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True, leave=False)


def _skip_reason(exc: BaseException) -> str:
    if isinstance(exc, Skip):
        return str(exc)
    msg = str(exc).strip().splitlines()
    if isinstance(exc, RuntimeError) and msg and "No viable backend" in msg[0]:
        # A forced SDPA backend that cannot serve this shape/dtype/device: expected, a skip.
        return "the forced SDPA backend does not support this case here (torch: no viable backend)"
    return f"error: {type(exc).__name__}: {msg[0][:160] if msg else ''}"


def _row(case: Case, provider: str) -> dict[str, Any]:
    return {
        "case": case.name, "kind": case.kind, "model": case.model, "provider": provider,
        "batch": case.batch, "kv_tokens": case.kv_tokens, "context": case.context, "chunk": case.chunk,
        "window": case.window, "sinks": case.sinks, "h_q": case.h_q, "h_kv": case.h_kv,
        "head_dim": case.head_dim, "dtype": case.dtype, "page": case.page,
        "status": "skipped", "reason": "", "note": "",
        "median_ms": None, "p20_ms": None, "p80_ms": None, "n": None,
        "step": case.step, "layers": case.layers, "kv_dtype": case.kv_dtype, "rope": case.rope, "goal": case.goal,
        "gbps": None, "tflops": None, "frac_ceiling": None, "vs_baseline": None, "max_rel_err": None,
        # Per same-run baseline of the kind (BASELINES): baseline time / this time, and the
        # max relative error of this row's output against the baseline's.
        "vs": {}, "err_vs": {},
    }


def _metrics(row: dict, case: Case, ceilings: dict) -> None:
    sec = row["median_ms"] * 1e-3
    w = work_of(case)
    if case.kind == "decode":
        row["gbps"] = w["kv_bytes"] / sec / 1e9
        row["tflops"] = w["flops"] / sec / 1e12
        row["frac_ceiling"] = row["gbps"] / ceilings["copy_gbps"] if ceilings else None
    elif case.kind in ("chunk", "train"):
        row["gbps"] = w["kv_bytes"] / sec / 1e9
        row["tflops"] = w["flops"] / sec / 1e12
        row["frac_ceiling"] = row["tflops"] / ceilings["matmul_tflops"] if ceilings else None
    else:
        # Store: the new chunk read once and written once, against the copy ceiling (read +
        # write). Extra bytes a provider moves (the shift) only show up as a lower fraction.
        row["gbps"] = w["store_bytes"] / sec / 1e9
        row["frac_ceiling"] = row["gbps"] / ceilings["copy_gbps"] if ceilings else None


def run_kernels(case_list: list[Case], device: torch.device, *, ceilings: dict | None = None,
                deadline: float = math.inf, show_progress: bool = True,
                providers: Iterable[str] | None = None, skip: Iterable[str] = (), cpu_reps: int = 20,
                cpu_budget_s: float = 0.25, backend: str = "auto",
                on_row: Callable[[dict], None] | None = None) -> list[dict[str, Any]]:
    """Run every provider of every case; one row per (case, provider).

    Parameters
    ----------
    case_list : cases to run.
    device : torch.device.
    ceilings : from :func:`measure_ceilings` (None: no fraction column).
    deadline : ``time.monotonic()`` after which remaining rows are skipped ("time budget").
    show_progress : tqdm bar / plain lines on stderr.
    providers : restrict to these provider names.
    skip : provider names reported as skipped ("not run in this run").
    backend : kvarena's backend (``"auto"``, ``"torch"``, ``"triton"``).
    on_row : called with each row as soon as it is final (``kvarena bench`` appends it to
        ``results.jsonl``, so a run killed from outside keeps every finished row).

    Returns
    -------
    list of dict
        Rows with ``status`` "ok" or "skipped" (with ``reason``), times in ms, throughput,
        fraction of the ceiling, ``vs`` / ``err_vs`` (per same-run baseline of the kind:
        baseline time / this time, and the max relative error against its output; the
        baselines run first), ``vs_baseline`` / ``max_rel_err`` for the primary one.
    """
    wanted = set(providers) if providers else None
    skipped = set(skip)
    plan = [(c, [p for p in providers_for(c) if wanted is None or p in wanted]) for c in case_list]
    bar = progress(sum(len(ps) for _, ps in plan), "bench", show_progress)
    rows: list[dict[str, Any]] = []
    try:
        for case, provs in plan:
            case_rows = _run_case(case, provs, device, ceilings, deadline, skipped, bar, backend,
                                  dict(cpu_reps=cpu_reps, cpu_budget_s=cpu_budget_s), on_row)
            rows += case_rows
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        bar.close()
    return rows


def _run_case(case, provs, device, ceilings, deadline, skipped, bar, backend, timing, on_row) -> list[dict]:
    """The rows of one case, each handed to ``on_row`` once final."""
    case_rows = [_row(case, p) for p in provs]
    data = None
    if time.monotonic() < deadline:
        try:
            data = make_data(case, device)
        except Exception as exc:  # e.g. out of memory
            for r in case_rows:
                r["reason"] = f"data: {_skip_reason(exc)}"
    baselines = BASELINES[case.kind]
    outs: dict[str, torch.Tensor] = {}  # baselines' outputs (kvarena's layout)
    times: dict[str, float] = {}
    for r in case_rows:
        prov = r["provider"]
        bar.set_postfix_str(f"{case.name} {prov}")
        if prov in case.skip_providers:
            r["reason"] = "not run on this case (keeps the set within its time budget)"
        elif prov in skipped:
            r["reason"] = "not run in this run (--skip-providers)"
        elif data is None:
            r["reason"] = r["reason"] or "time budget exhausted"
        elif time.monotonic() > deadline:
            r["reason"] = "time budget exhausted"
        else:
            try:
                _measure(r, case, data, device, ceilings, backend, timing, outs, times, baselines)
            except Exception as exc:
                r["reason"] = _skip_reason(exc)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        bar.update()
        if on_row is not None:
            on_row(r)
    del data, outs
    return case_rows


def _measure(r, case, data, device, ceilings, backend, timing, outs, times, baselines) -> None:
    """Build, check and time one provider into row ``r`` (raises to skip it)."""
    prov = r["provider"]
    b = build(prov, case, data, backend=backend)
    r["note"] = b.note
    out = b.fn()
    sync(device)
    got = None if prov in NO_OUTPUT else b.to_ref(out)
    del out
    if got is not None:
        for base, ref in outs.items():
            r["err_vs"][base] = rel_err(got, ref)
        if prov in baselines:
            outs[prov] = got.detach().clone()
    del got
    r.update(time_fn(b.fn, device, **timing))
    r["status"] = "ok"
    _metrics(r, case, ceilings)
    if prov in baselines:
        times[prov] = r["median_ms"]
    for base, t in times.items():
        r["vs"][base] = t / r["median_ms"]
    primary = baselines[0]
    r["vs_baseline"] = r["vs"].get(primary)
    r["max_rel_err"] = r["err_vs"].get(primary, next(iter(r["err_vs"].values()), None))
