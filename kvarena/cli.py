"""The ``kvarena`` command line: ``--version``, ``demo``, ``check``, ``bench``.

Each subcommand lives in its own module and is imported only when chosen, so that
``kvarena --version`` never imports torch or triton.

A bad flag value ends the way argparse ends it (the usage, one ``error:`` line on stderr,
exit status 2) before any work starts, whether argparse finds it through one of the
``type=`` functions below or a subcommand finds it later and raises :class:`UsageError`.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
from pathlib import Path

from kvarena._version import __version__

__all__ = [
    "UsageError",
    "build_parser",
    "comma_list",
    "device_name",
    "main",
    "nonempty",
    "output_dir",
    "output_file",
    "positive_float",
    "positive_int",
]

# subcommand -> (module, one-line help, what it does and an example with its time on a
# 2-core CPU). Each module provides ``add_arguments(parser)`` and ``run(args) -> int`` and
# imports neither torch nor triton at module level, so building the parser stays cheap
# and TRITON_INTERPRET can still be chosen by the subcommand.
_COMMANDS = {
    "demo": ("kvarena.demo",
             "run the example models on kvarena's caches, check them against dense attention, print a table",
             "Runs a causal video DiT rollout (slab KV, sinks + window recycled in place), an AR\n"
             "decode (paged KV, chunked prefill, a fork) and a hybrid sliding/full decode (layer\n"
             "groups), compares every checked step with a dense recomputation and prints one table.",
             [("kvarena demo", "5-20 s on a 2-core CPU (depending on load), seconds on a GPU"),
              ("kvarena demo --backend triton", "the Triton kernels through the interpreter on CPU, about 1 min")]),
    "check": ("kvarena.check",
              "compile the Triton kernels for eight GPU targets without a GPU; report registers, spills, shared memory",
              "Compiles every kernel configuration the pools launch ahead of time (ptxas included)\n"
              "and fails on a register spill or a shared-memory overflow. Progress goes to stderr;\n"
              "results are cached on disk, so a second run takes seconds.",
              [("kvarena check", "all eight targets, about 15 min on a 2-core CPU the first time"),
               ("kvarena check --perf", "adds occupancy, MMA kind and main-loop SASS (the same cache)"),
               ("kvarena check --only decode --target sm_89", "a subset, under a minute")]),
    "bench": ("kvarena.benchmark.cli",
              "run the kernel and cache benchmarks against same-run baselines; write results and a plot",
              "Times kvarena as the pools launch it next to same-run baselines (SDPA, a shift-left\n"
              "window cache, a device copy) and writes results.json, tables.md and plot.png.",
              [("kvarena bench --quick --out /tmp/q", "tiny shapes on CPU, about 20 s"),
               ("kvarena bench --out runs/gpu", "the full set on a GPU, a few minutes")]),
}

_DESCRIPTION = ("kvarena: paged and slab KV caches in one device arena, and Triton attention\n"
                "kernels that read straight from it.")


def _examples(rows: list) -> str:
    width = max(len(cmd) for cmd, _ in rows)
    return "examples:\n" + "\n".join(f"  {cmd:<{width}}  # {time}" for cmd, time in rows)


_DEVICE_RE = re.compile(r"cpu|cuda(?::(\d+))?")


class UsageError(Exception):
    """A flag value that parsed but cannot work, found by a subcommand's ``run``.

    :func:`main` reports it as argparse reports a bad flag: the subcommand's usage, then
    ``kvarena <command>: error: argument <flag>: <message>`` on stderr, exit status 2.

    Parameters
    ----------
    flag : str
        The flag at fault, e.g. ``"--cases"``.
    message : str
        What is wrong with its value and what is expected instead.
    """

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


def positive_int(text: str) -> int:
    """argparse ``type=`` for a count: an integer >= 1 (0 and negatives are errors, not defaults)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1 or more), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=`` for a positive, finite number (e.g. seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def nonempty(text: str) -> str:
    """argparse ``type=`` for a filter text: an empty one would silently mean "no filter"."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a non-empty text (omit the flag for no filter)")
    return text


def comma_list(text: str) -> list[str]:
    """argparse ``type=`` for ``a,b,c``: the stripped, non-empty names, at least one of them."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {text!r}")
    return names


def device_name(text: str) -> str:
    """argparse ``type=`` for ``--device``: ``cpu``, ``cuda`` or ``cuda:N``, usable here.

    torch is imported only for a CUDA value, when the flag is parsed: never at import
    time, and not at all for ``cpu`` (``kvarena demo --backend triton`` must still be
    able to set TRITON_INTERPRET before anything imports triton).
    """
    match = _DEVICE_RE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if text == "cpu":
        return text
    import torch

    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here "
                                         "(torch.cuda.is_available() is False); use cpu")
    count = torch.cuda.device_count()
    if match.group(1) is not None and int(match.group(1)) >= count:
        raise argparse.ArgumentTypeError(f"{text}: only {count} CUDA device(s) here (cuda:0 to cuda:{count - 1})")
    return text


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (a dangling symlink counts as existing)."""
    path = path.absolute()
    while not (path.exists() or path.is_symlink()):
        path = path.parent
    return path


def _check_can_create_in(path: Path, text: str) -> None:
    """Raise unless the directory ``path`` exists, or can be created, and is writable."""
    base = _nearest_existing(path)
    if not base.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {base} is not writable")


def output_dir(text: str) -> Path:
    """argparse ``type=`` for an output directory: an existing writable directory, or a
    path that can be created below one.

    Checked when the flag is parsed (nothing is created then), so a bad path fails in a
    second rather than after the run.
    """
    if not text:
        raise argparse.ArgumentTypeError("expected a directory path, got ''")
    path = Path(text)
    if (path.exists() or path.is_symlink()) and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a directory")
    _check_can_create_in(path, text)
    return path


def output_file(text: str) -> Path:
    """argparse ``type=`` for an output file: a writable file, or a new one in an existing
    writable directory (its directory is not created)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory, expected a file path")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text}: is not writable")
        return path
    parent = path.absolute().parent
    base = _nearest_existing(parent)
    if not base.is_dir():  # e.g. a path below a regular file
        raise argparse.ArgumentTypeError(f"{text}: {base} is not a directory")
    if base != parent:
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} is not writable")
    return path


def build_parser() -> argparse.ArgumentParser:
    epilog = _examples([row for *_, rows in _COMMANDS.values() for row in rows[:1]])
    epilog += "\n\n'kvarena COMMAND --help' describes a command's flags."
    parser = argparse.ArgumentParser(prog="kvarena", description=_DESCRIPTION, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"kvarena {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (module, help_text, description, examples) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=description, epilog=_examples(examples),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        # The subparser rides along so that main can report a UsageError with its usage.
        p.set_defaults(_module=module, _parser=p)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kvarena`` with ``argv`` (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status of a command that ran: 0 when it succeeded, 1 when a check it
        makes failed. With no command, prints the help and returns 0.

    Raises
    ------
    SystemExit
        Code 2, after the usage and one ``error:`` line on stderr, for a bad flag, found
        by argparse or by the subcommand (:class:`UsageError`); code 0 for ``--help``
        and ``--version``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except UsageError as exc:
        args._parser.error(str(exc))  # prints the usage and the message, raises SystemExit(2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
