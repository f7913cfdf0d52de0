"""The ``kvarena`` command line: ``--version``, ``demo``, ``check``, ``bench``.

Each subcommand lives in its own module and is imported only when chosen, so that
``kvarena --version`` never imports torch or triton.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvarena._version import __version__

# subcommand -> (module, help). Each module provides ``add_arguments(parser)`` and
# ``run(args) -> int`` and imports neither torch nor triton at module level, so building
# the parser stays cheap and TRITON_INTERPRET can still be chosen by the subcommand.
_COMMANDS = {
    "demo": ("kvarena.demo", "run the causal-DiT rollout and AR-decode examples and print a table"),
    "check": ("kvarena.check", "compile the Triton kernels ahead of time for sm_80/sm_90a and report registers/spills"),
    "bench": ("kvarena.benchmark.cli", "run the kernel and cache benchmarks against same-run baselines"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvarena", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvarena {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
