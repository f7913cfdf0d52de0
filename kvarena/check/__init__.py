"""``kvarena check``: compile every kernel configuration the package launches, with no GPU.

For each kernel and each configuration that the launchers' pure config pickers return for
the heaviest realistic shapes (head_dim 256 and 128, GQA groups, fp16/bf16/fp32, split
and unsplit, decode and chunk prefill), this compiles ahead of time for sm_80 and sm_90a
(``triton.compile`` on an ``ASTSource``, ptxas included) and prints one row per
kernel/config/target: registers, spill bytes, shared memory and whether it fits (no
spills; shared memory <= 163 KiB on sm_80, 227 KiB on sm_90a). The exit code is 1 when
any row does not fit.

It needs the real compiler, so it refuses to run under TRITON_INTERPRET=1. Importing this
package imports neither torch nor triton (``kvarena.cli`` imports it to build its parser).

Compiles are cached on disk by content (``KVARENA_CHECK_CACHE``, default
``~/.cache/kvarena/check``; ``--no-cache`` or ``KVARENA_CHECK_CACHE=0`` to compile
everything): the key holds the kernel's Triton ``cache_key`` (its source and every jitted
function and global it reads), the signature, hints, constexprs and options, the target,
the Triton version, ``TRITON_PTXAS_PATH`` and this package's own sources (the parsing), so a
cached row is the row that compile gives; tests/tooling/test_check.py checks cached == fresh.

The modules: :mod:`.cases` (the tables of what is compiled), :mod:`.launches` (each case as
the launchers would launch it), :mod:`.compile` (one compile and its row),
:mod:`.cache` (the on-disk cache), :mod:`.sass` (the ``--perf`` metrics read from PTX,
ttgir and SASS), :mod:`.report` (the tables and the occupancy rewrite) and
:mod:`.command` (the command line).
"""

from __future__ import annotations

from kvarena.check.cases import (
    ATTENTION_CASES,
    BWD_CASES,
    FP8_CASES,
    MERGE_CASES,
    OWN_CASES,
    REDUCE_CASES,
    ROPE_CASES,
    SHARED_LIMIT,
    SHORT_CASES,
    SM_COUNT,
    STORE_CASES,
    TARGETS,
    WIDE_CASES,
    WORKLOADS,
)
from kvarena.check.command import _Progress, add_arguments, run
from kvarena.check.compile import Row
from kvarena.check.launches import _Launch, _launches, _signature
from kvarena.check.report import TABLE_COLUMNS, _print_table

__all__ = [
    "ATTENTION_CASES",
    "BWD_CASES",
    "FP8_CASES",
    "MERGE_CASES",
    "OWN_CASES",
    "REDUCE_CASES",
    "ROPE_CASES",
    "SHARED_LIMIT",
    "SHORT_CASES",
    "SM_COUNT",
    "STORE_CASES",
    "TABLE_COLUMNS",
    "TARGETS",
    "WIDE_CASES",
    "WORKLOADS",
    "Row",
    "add_arguments",
    "run",
    "_Launch",
    "_Progress",
    "_launches",
    "_print_table",
    "_signature",
]
