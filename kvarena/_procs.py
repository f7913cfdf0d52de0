"""One way to fan CPU-bound work out over processes (``kvarena check``'s compiles, the
bench's warm-up). Imports neither torch nor triton."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def map_in_processes(fn: Callable, jobs: Sequence, workers: int, start_method: str) -> list:
    """``[fn(job) for job in jobs]``, in ``workers`` processes when there are more than one
    worker and one job (``start_method``: ``"fork"`` or ``"spawn"``, which a CUDA context needs)."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(job) for job in jobs]
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context(start_method)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        return list(pool.map(fn, jobs))
