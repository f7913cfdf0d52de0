"""``kvarena bench``: kernel, recycling and host-overhead benchmarks against same-run baselines.

Examples
--------
``kvarena bench --quick``                      tiny CPU set, seconds
``kvarena bench --device cuda``                docs/contract.md's shapes (about 3 minutes on an H200)
``kvarena bench --cases decode-b16,wan1.3b``   only cases whose name contains one of these
``kvarena bench --sections recycle``           only the recycling comparison
``kvarena bench --warmup-only --jobs 8``       compile every case's kernels, in 8 processes
``kvarena bench --report bench/out``           the tables again, from results.jsonl (markdown)

Every finished row is appended to ``results.jsonl`` at once (a run killed from outside
keeps all but the row in flight); ``results.json`` / ``.csv`` / ``.png`` are written
after each section and at the end.

This module imports no torch at import time: ``kvarena.cli`` imports it to build the
parser.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvarena.cli import (
    UsageError,
    comma_list,
    device_name,
    output_dir,
    positive_float,
    positive_int,
)

__all__ = ["add_arguments", "run", "default_out_dir"]

_SECTIONS = ("kernels", "recycle", "overhead")


def _sections(text: str) -> list[str]:
    """argparse ``type=`` for ``--sections``: a non-empty subset of ``_SECTIONS``."""
    names = comma_list(text)
    bad = [s for s in names if s not in _SECTIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; expected a comma-separated subset of "
                                         f"{','.join(_SECTIONS)}")
    return names


def _providers(text: str) -> list[str]:
    """argparse ``type=`` for ``--providers``: known provider names (the registry imports no torch)."""
    from kvarena.benchmark.cases import PROVIDERS

    names = comma_list(text)
    known = {p for ps in PROVIDERS.values() for p in ps}
    unknown = [p for p in names if p not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; expected some of {','.join(sorted(known))}")
    return names


def default_out_dir() -> Path:
    """``bench/out`` inside a kvarena checkout (the current directory), else ``./kvarena-bench``."""
    cwd = Path.cwd()
    if (cwd / "bench").is_dir() and (cwd / "kvarena").is_dir():
        return cwd / "bench" / "out"
    return cwd / "kvarena-bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kvarena bench``'s options to ``parser``."""
    parser.add_argument("--quick", action="store_true",
                        help="the tiny CPU-sized set (the default on CPU); same as --set quick")
    parser.add_argument("--set", dest="set_name", choices=("quick", "gpu"), default=None,
                        help="case set (default: gpu on CUDA, quick otherwise)")
    parser.add_argument("--cases", type=comma_list, default=None,
                        help="comma-separated substrings; keep cases whose name contains one")
    parser.add_argument("--providers", type=_providers, default=None,
                        help="comma-separated provider names to run (default: all)")
    parser.add_argument("--skip-providers", type=_providers, default=None,
                        help="comma-separated provider names reported as skipped (e.g. gather_flex,flex_contiguous)")
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                        help="kvarena's backend (default auto: Triton on CUDA, PyTorch on CPU; triton on CPU "
                             "needs TRITON_INTERPRET=1)")
    parser.add_argument("--cpu-reps", type=positive_int, default=None,
                        help="CPU timing: at most this many timed calls per row (default 20)")
    parser.add_argument("--warmup-only", action="store_true",
                        help="run each selected case's kvarena call once (compiling its kernels into Triton's "
                             "cache), time nothing, write nothing")
    parser.add_argument("--jobs", type=positive_int, default=1,
                        help="--warmup-only: worker processes (compiles are CPU-bound: one per core)")
    parser.add_argument("--report", type=Path, default=None, metavar="DIR",
                        help="print markdown tables of DIR/results.jsonl (a finished or killed run) and exit")
    parser.add_argument("--sections", type=_sections, default=",".join(_SECTIONS),
                        help=f"comma-separated subset of {','.join(_SECTIONS)} (default: all)")
    parser.add_argument("--out", type=output_dir, default=None,
                        help="output directory, created if missing "
                             "(default: bench/out in a checkout, else ./kvarena-bench)")
    parser.add_argument("--device", type=device_name, default=None,
                        help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--budget-s", type=positive_float, default=None,
                        help="wall-clock budget in seconds (> 0); rows past it are reported as skipped "
                             "(results still written) (default: no budget)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU intra-op threads, 1 or more (default: 1 for the quick set on CPU, else torch's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar / lines")
    parser.add_argument("--list", action="store_true", help="list the selected cases and providers, run nothing")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the selected sections, print tables, write JSON/CSV/PNG. Returns the exit code.

    The exit code is 1 when kvarena's own provider failed with an error on some case, or
    when the recycling sanity check (both schemes give the same attention output) failed;
    baselines that cannot run are skipped with a reason and do not fail the run.

    Raises
    ------
    kvarena.cli.UsageError
        For flags that parse but select nothing or contradict each other (``kvarena.cli.main``
        turns it into argparse's exit 2), before anything is measured.
    """
    if args.report is not None:
        from kvarena.benchmark.report import markdown_from_jsonl

        path = args.report / "results.jsonl"
        if not path.is_file():
            raise UsageError("--report", f"{path} does not exist (a bench run writes it into its --out)")
        print(markdown_from_jsonl(path))
        return 0
    # --sections, --providers, --device, --out, --threads, --budget-s were checked by the parser.
    if args.quick and args.set_name not in (None, "quick"):
        raise UsageError("--quick", "not allowed with --set gpu (--quick means --set quick)")
    sel = _select(args)
    if args.list:
        from kvarena.benchmark import cases as C

        for c in sel.cases:
            provs = [p for p in C.providers_for(c)
                     if (not args.providers or p in args.providers) and p not in c.skip_providers]
            print(f"{c.name:28s} {c.kind:7s} kv_tokens={c.kv_tokens:<8d} providers={','.join(provs)}")
        return 0
    if args.warmup_only:
        from kvarena.benchmark.warmup import warm_up

        return warm_up(sel.cases, sel.device, jobs=args.jobs, backend=args.backend, log=_log)
    if sel.set_name == "gpu" and sel.device.type != "cuda":
        _log("kvarena bench: note: the gpu set on a CPU materializes GiB-sized score tensors; "
             "use --quick (or --cases) unless you mean it")
    return _bench(args, sel)


@dataclass(frozen=True)
class _Selection:
    """What the flags select: the device, the case set and its cases."""

    device: Any  # torch.device (torch is imported when run)
    set_name: str
    cases: list


def _select(args: argparse.Namespace) -> _Selection:
    import torch

    from kvarena.benchmark import cases as C

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    set_name = "quick" if args.quick else (args.set_name or C.default_set(str(device)))
    case_list = C.cases(set_name, args.cases)
    if args.cases and not case_list:
        raise UsageError("--cases", f"{','.join(args.cases)} matches no case of the {set_name} set "
                                    f"(kvarena bench --set {set_name} --list lists them)")
    return _Selection(device, set_name, case_list)


def _out_dir(args: argparse.Namespace) -> Path:
    """The output directory, created (before any measurement or global setting, so that a
    bad directory costs nothing)."""
    out_dir = args.out if args.out is not None else default_out_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        hint = "" if args.out is not None else " (the default; choose another with --out)"
        raise UsageError("--out", f"cannot create {out_dir}{hint}: {exc.strerror or exc}") from None
    return out_dir


def _set_threads(args: argparse.Namespace, sel: _Selection) -> None:
    import torch

    threads = args.threads
    if threads is None and sel.device.type == "cpu" and sel.set_name == "quick":
        # Tiny shapes gain nothing from intra-op threads, and on a shared 2-core host the
        # OpenMP barriers turn a 12 us 64x64 matmul into 30-50 ms at the 90th percentile
        # (measured while writing this); one thread keeps the quick numbers readable.
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class _Sink:
    """Where a run's results go: the ``results`` document, its JSON lines, its directory."""

    results: dict
    jsonl: Any  # report.JsonLines
    out_dir: Path

    def checkpoint(self) -> None:
        """JSON/CSV after every section, so a run killed by an outer timeout keeps its numbers."""
        from kvarena.benchmark import report

        report.write_json(self.out_dir / "results.json", self.results)
        report.write_csv(self.out_dir / "results.csv", self.results)


def _bench(args: argparse.Namespace, sel: _Selection) -> int:
    """The measured run: every selected section, its tables printed and its results written."""
    from kvarena.benchmark import report

    out_dir = _out_dir(args)
    _set_threads(args, sel)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s if args.budget_s is not None else math.inf
    results: dict = {"meta": report.run_metadata(sel.device, sel.set_name), "ceilings": None, "kernels": [],
                     "recycle": None, "recycle_tokens": None, "overhead": None, "notes": []}
    results["meta"]["argv"] = sys.argv[1:]
    results["meta"]["KVARENA_DEBUG"] = os.environ.get("KVARENA_DEBUG")
    results["meta"]["backend"] = args.backend
    sink = _Sink(results, report.JsonLines(out_dir / "results.jsonl"), out_dir)
    sink.jsonl.write("meta", results["meta"])
    if sel.device.type == "cpu":
        results["notes"].append("CPU run: kvarena runs its PyTorch path (no Triton); throughput targets "
                                "in docs/contract.md apply to the GPU run only")
    exit_code = 0
    if "kernels" in args.sections and sel.cases:
        exit_code |= _kernels_section(args, sel, sink, deadline)
    if "recycle" in args.sections:
        exit_code |= _recycle_section(args, sel, sink, deadline)
    if "overhead" in args.sections:
        from kvarena.benchmark.overhead import run_overhead

        reps, warm = (10, 2) if sel.set_name == "quick" else (50, 5)
        results["overhead"] = run_overhead(sel.device, reps=reps, warm=warm, deadline=deadline)
        sink.jsonl.write("overhead", {"rows": results["overhead"]})
        print("\n" + report.format_overhead(results["overhead"]), flush=True)
    results["meta"]["elapsed_s"] = time.monotonic() - t_start
    paths = report.write_all(out_dir, results)
    for note in results["notes"]:
        print(f"note: {note}")
    print(f"wrote {paths['json']}, {paths['csv']}" + (f", {paths['png']}" if paths["png"] else "")
          + f" ({results['meta']['elapsed_s']:.1f} s)")
    return exit_code


def _kernels_section(args: argparse.Namespace, sel: _Selection, sink: _Sink, deadline: float) -> int:
    """The kernel table; 1 when kvarena's own provider failed on some case."""
    from kvarena.benchmark import report
    from kvarena.benchmark.runner import measure_ceilings, run_kernels

    exit_code = 0
    _log(f"kvarena bench: {len(sel.cases)} cases ({sel.set_name} set) on {sel.device}; measuring ceilings ...")
    ceil = measure_ceilings(sel.device, quick=sel.set_name == "quick")
    sink.results["ceilings"] = ceil
    sink.jsonl.write("ceilings", ceil)
    timing = {} if args.cpu_reps is None else {"cpu_reps": args.cpu_reps}
    rows = run_kernels(sel.cases, sel.device, ceilings=ceil, deadline=deadline, show_progress=not args.no_progress,
                       providers=args.providers, skip=args.skip_providers or (), backend=args.backend,
                       on_row=lambda row: sink.jsonl.write("kernel", row), **timing)
    sink.results["kernels"] = rows
    print(report.format_table(rows, ceil), flush=True)
    for r in rows:
        if r["provider"] == "kvarena" and r["reason"].startswith("error"):
            exit_code = 1
            _log(f"kvarena bench: kvarena failed on {r['case']}: {r['reason']}")
    sink.checkpoint()
    return exit_code


def _recycle_section(args: argparse.Namespace, sel: _Selection, sink: _Sink, deadline: float) -> int:
    """Whole-chunk sinks/window, then Self-Forcing's token rule (I2V first frame); 1 when
    a comparison failed or its schemes disagree."""
    from kvarena.benchmark import report
    from kvarena.benchmark.recycle import run_recycle

    exit_code, results = 0, sink.results
    for key, cfg_name in (("recycle", sel.set_name), ("recycle_tokens", f"{sel.set_name}-tokens")):
        if time.monotonic() > deadline:
            results[key] = {"status": "skipped", "reason": "time budget exhausted"}
        else:
            try:
                results[key] = run_recycle(cfg_name, sel.device, log=_log if not args.no_progress else (lambda m: None))
                if not results[key]["sanity"]["same_output"]:
                    exit_code = 1
            except Exception as exc:
                results[key] = {"status": "skipped", "reason": f"error: {type(exc).__name__}: {exc}"}
                exit_code = 1
        print("\n" + report.format_recycle(results[key]), flush=True)
        sink.jsonl.write(key, results[key])
        sink.checkpoint()
    return exit_code
