"""``kvarena check`` on the command line: its arguments, the compiles (one process per
target, with a progress line) and the report."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from kvarena.check.cases import TARGETS
from kvarena.check.compile import Row, _compile_cached
from kvarena.check.launches import _launches
from kvarena.check.report import (
    TABLE_COLUMNS,
    _markdown_tables,
    _print_model,
    _print_table,
    _print_workloads,
    _workload_rows,
    _write_occupancy,
)
from kvarena.check.sass import _reference_loop_sass_cached
from kvarena.cli import UsageError, nonempty, output_file


def add_arguments(parser) -> None:
    parser.add_argument("--target", action="append", choices=TARGETS, metavar="NAME",
                        help=f"GPU architecture to compile for (repeatable; default: all of {', '.join(TARGETS)})")
    parser.add_argument("--only", type=nonempty, default=None,
                        help="only configurations whose name contains this text")
    # Checked when parsed (a writable file in an existing directory): the compiles take minutes.
    parser.add_argument("--json", dest="json_path", type=output_file, default=None,
                        help="also write the rows as JSON to this file")
    parser.add_argument("--markdown", dest="markdown_path", type=output_file, default=None,
                        help="also write one markdown table per target to this file (bench/RESULTS.md's form)")
    parser.add_argument("--all-variants", "--all", dest="all_variants", action="store_true",
                        help="also compile every mask/output flag variant of each attention config "
                             "(causal x kv_start x lse x softcap; ~280 compiles, ~10 min)")
    parser.add_argument("--perf", action="store_true",
                        help="also report the metrics that decide speed: CTAs per SM, MMA kind, K/V "
                             "buffers in flight, SASS instructions per main-loop iteration and the interior "
                             "tile's path through it next to a contiguous flash loop at the same tile, the main loop's tile cycle model "
                             "(docs/perf-model.md), and the workloads' grids and waves")
    parser.add_argument("--wide", action="store_true",
                        help=f"print the full table, one line per compile (the default fits {TABLE_COLUMNS} columns)")
    parser.add_argument("--no-cache", action="store_true",
                        help="compile everything, ignoring and not writing the on-disk cache of compile results "
                             "(KVARENA_CHECK_CACHE, default ~/.cache/kvarena/check)")
    parser.add_argument("--write-occupancy", action="store_true",
                        help="with --perf: rewrite the CTAs-per-SM table of kvarena/kernels/occupancy.py "
                             "from these compiles: every target, the launches as launched and with every flag on")


#: Compiles finished so far, shared with the worker processes (forked, so they inherit it);
#: set by ``run`` while it compiles, read by its progress line.
_DONE = None


class _Progress:
    """``compiles done / total, ETA`` on stderr: redrawn in place on a terminal, else a line
    every 10% (so a log gets a dozen lines, not one per compile)."""

    def __init__(self, total: int) -> None:
        self.total, self.t0, self.tty = max(1, total), time.perf_counter(), sys.stderr.isatty()
        self.last_decile = -1

    def show(self, done: int, final: bool = False) -> None:
        elapsed = time.perf_counter() - self.t0
        eta = f", about {elapsed / done * (self.total - done):.0f} s left" if 0 < done < self.total else ""
        line = f"kvarena check: {done}/{self.total} compiles, {elapsed:.0f} s{eta}"
        if self.tty:
            sys.stderr.write(f"\r{line:<78}" + ("\n" if final else ""))
        elif final or done * 10 // self.total > self.last_decile:
            self.last_decile = done * 10 // self.total
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


@dataclass(frozen=True)
class _Job:
    """The compiles of one target (one worker process each)."""

    only: str | None
    target: str
    all_variants: bool
    perf: bool


def _compile_target(job: _Job) -> list[Row]:
    """Every launch of one target, in ``_launches`` order (with ``--perf``: its metrics and
    the reference loop of each tile)."""
    only, target, all_variants, perf = job.only, job.target, job.all_variants, job.perf
    rows = []
    ref: dict[tuple, int] = {}
    for launch in _launches(only, target, all_variants):
        row = _compile_cached(launch, target, perf)
        if perf and launch.ref_tile is not None and row.mma and row.mma != "mfma":
            if launch.ref_tile not in ref:
                ref[launch.ref_tile] = _reference_loop_sass_cached(launch.ref_tile, target)
            row.ref_loop_sass = ref[launch.ref_tile]
        rows.append(row)
        if _DONE is not None:
            with _DONE.get_lock():
                _DONE.value += 1
    return rows


def run(args) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("kvarena check: TRITON_INTERPRET=1 is set, which swaps the compiler for the interpreter; "
              "run it in an environment without TRITON_INTERPRET", file=sys.stderr)
        return 2
    # ptxas prints its -v log only when asked, and only for a compile that really runs.
    saved = {k: os.environ.get(k) for k in ("TRITON_DUMP_PTXAS_LOG", "TRITON_ALWAYS_COMPILE", "TRITON_DEFAULT_FP_FUSION",
                                            "KVARENA_CHECK_CACHE")}
    if args.no_cache:
        os.environ["KVARENA_CHECK_CACHE"] = "0"
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default launches use
    try:
        import triton

        targets = list(dict.fromkeys(args.target or TARGETS))
        per_target = {t: _launches(args.only, t, args.all_variants) for t in targets}
        n = len(per_target[targets[0]])
        if n == 0:  # nothing to compile must not read as "all fit"
            raise UsageError("--only", f"{args.only!r} matches no kernel configuration")
        print(f"kvarena check: {n} configurations x {len(targets)} targets, triton {triton.__version__}")
        t0 = time.perf_counter()
        # One process per target: compiles are CPU-bound (MLIR passes, ptxas), so two
        # targets on a 2-core machine take about half the wall time.
        jobs = [_Job(args.only, t, args.all_variants, args.perf) for t in targets]
        workers = min(len(targets), os.cpu_count() or 1)
        import concurrent.futures
        import multiprocessing

        global _DONE
        ctx = multiprocessing.get_context("fork")
        _DONE = ctx.Value("i", 0)
        progress = _Progress(n * len(targets))
        progress.show(0)
        try:
            if workers > 1:
                with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                    futures = [pool.submit(_compile_target, job) for job in jobs]
                    while concurrent.futures.wait(futures, timeout=1.0).not_done:
                        progress.show(_DONE.value)
                    per_rows = [f.result() for f in futures]
            else:
                per_rows = []
                for job in jobs:  # the counter moves in this process: show it per target
                    per_rows.append(_compile_target(job))
                    progress.show(_DONE.value)
            progress.show(_DONE.value, final=True)
        finally:
            _DONE = None
        rows = [per_rows[t][i] for i in range(n) for t in range(len(targets))]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _print_table(rows, wide=args.wide)
    bad = [r for r in rows if not r.fits]
    hits = sum(r.cached for r in rows)
    cache_note = f" ({hits} from the compile cache; --no-cache compiles all)" if hits else ""
    print(f"{len(rows)} compiles in {time.perf_counter() - t0:.0f} s{cache_note}; "
          + ("all fit (no spills, shared memory within limits)" if not bad else f"{len(bad)} do NOT fit"))
    if args.perf and any(r.tile_model for r in rows):
        print()
        _print_model(rows, wide=args.wide)
    workloads = _workload_rows(targets) if args.perf else []
    if workloads:
        print()
        _print_workloads(workloads)
    if args.perf and args.write_occupancy:
        print(f"wrote the CTAs-per-SM table to {_write_occupancy(rows)}")
    if args.markdown_path:
        with open(args.markdown_path, "w") as f:
            f.write(_markdown_tables(rows, workloads))
    if args.json_path:
        with open(args.json_path, "w") as f:
            payload = [asdict(r) for r in rows]
            json.dump({"rows": payload, "workloads": workloads} if args.perf else payload, f, indent=1)
    return 1 if bad or not rows else 0
