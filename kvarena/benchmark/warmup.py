"""``kvarena bench --warmup-only``: compile every selected case's kernels before timing.

Triton compiles a kernel at its first launch and keeps it in its on-disk cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``), where any later process finds it.
Compiling is CPU-bound (MLIR passes, ptxas: seconds per variant) and one process compiles
one kernel at a time, so ``bench/gpu.sh`` runs this first with one worker process per
core: each worker builds a case's data and runs kvarena's provider once (the same
shapes, hence the same specializations, as the timed run), and the timed run then loads
every kernel from the cache. Nothing is timed or written here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvarena._procs import map_in_processes
from kvarena.benchmark.cases import Case

__all__ = ["warm_up"]


def _one(job: tuple) -> tuple[str, float, str]:
    """Run kvarena's provider (and ``kvarena_plain`` where the case has it) on one case once."""
    case, device, backend = job
    import torch

    from kvarena.benchmark.cases import providers_for
    from kvarena.benchmark.providers import build, make_data

    t0 = time.perf_counter()
    dev = torch.device(device)
    try:
        data = make_data(case, dev)
        for prov in ("kvarena", "kvarena_plain"):
            if prov in providers_for(case):
                build(prov, case, data, backend=backend).fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        status = "ok"
    except Exception as exc:  # reported; the timed run reports it again on its row
        status = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    finally:
        data = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return case.name, time.perf_counter() - t0, status


def warm_up(case_list: list[Case], device, *, jobs: int = 1, backend: str = "auto",
            log: Callable[[str], None] = print) -> int:
    """Run each case's kvarena call once in ``jobs`` processes; returns 0 (1 when every case failed)."""
    t0 = time.perf_counter()
    work = [(c, str(device), backend) for c in case_list]
    # spawn: a CUDA context does not survive fork; workers import torch afresh.
    results = map_in_processes(_one, work, jobs, "spawn")
    for name, sec, status in results:
        log(f"warm-up {name}: {sec:.1f} s {status}")
    ok = sum(status == "ok" for _, _, status in results)
    log(f"warm-up: {ok} of {len(results)} cases ran in {time.perf_counter() - t0:.1f} s ({jobs} processes)")
    return 0 if ok or not results else 1
