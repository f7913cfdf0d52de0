"""Covering arrays: the kernel suites' grids over their option factors (imported, not a plugin).

A full cross-product of a kernel's options grows multiplicatively (the forward's 11
factors: 23,328 cases); a covering array keeps every *pair* of option values in at least
one row, and every *triple* within the factor groups where options interact, in a few
dozen rows. Failures of real kernels are mostly such 2- and 3-way interactions.

* :func:`covering_array` builds one (greedy, AETG-style, deterministic for a seed).
* :func:`uncovered` lists what a grid misses (the check a suite's own test runs).
* ``LAYOUT``: the layout factors the kernel suites share (dtype, head dim, page size), so
  the forward's grid and the store's draw the same odd values (80 is not a power of two,
  48 and 150 straddle tiles).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Sequence

import torch

#: The element types by name (grids carry names so that test ids read well).
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: The layout factors shared by the kernel suites' grids.
LAYOUT = {
    "dtype": ["fp32", "fp16", "bf16"],
    "head_dim": [32, 80, 128],
    "block_size": [16, 48, 150],
}


def _tuples(factors: dict, triple_groups: Sequence[Sequence[str]]) -> tuple[list, list]:
    names = list(factors)
    triples = sorted({c for g in triple_groups for c in itertools.combinations(g, 3)})
    return names, triples


def _as_tuple(factors: dict, combo: dict) -> tuple:
    """A partial row ``{factor: value}`` as the array's tuple of (factor, value index)."""
    return tuple((f, factors[f].index(combo[f])) for f in factors if f in combo)


def covering_array(factors: dict, triple_groups: Sequence[Sequence[str]] = (), seed: int = 0, *,
                   also: Iterable[dict] = ()) -> list[dict]:
    """Greedy covering array: all pairs of all factors + all triples within each group,
    + every partial row of ``also`` (``{factor: value}``: a combination a grid being
    replaced held, so that the new grid covers at least what the old one did).

    Each step samples candidate rows and keeps the one covering the most uncovered
    tuples (AETG-style); deterministic for a given seed.
    """
    names, triples = _tuples(factors, triple_groups)
    extra = {_as_tuple(factors, c) for c in also}
    need = set(extra)
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(range(len(factors[a])), range(len(factors[b]))):
            need.add(((a, va), (b, vb)))
    for combo in triples:
        for vals in itertools.product(*(range(len(factors[f])) for f in combo)):
            need.add(tuple(zip(combo, vals)))
    rng = random.Random(seed)
    rows = []

    def tuples_of(row):
        out = set()
        for a, b in itertools.combinations(names, 2):
            out.add(((a, row[a]), (b, row[b])))
        for combo in triples:
            out.add(tuple((f, row[f]) for f in combo))
        out.update(t for t in extra if all(row[f] == v for f, v in t))
        return out

    while need:
        target = next(iter(sorted(need)))  # seed each row with one uncovered tuple
        best, best_gain = None, -1
        for _ in range(60):
            row = {f: rng.randrange(len(factors[f])) for f in names}
            row.update(dict(target))
            gain = len(tuples_of(row) & need)
            if gain > best_gain:
                best, best_gain = row, gain
        need -= tuples_of(best)
        rows.append({f: factors[f][v] for f, v in best.items()})
    return rows


def uncovered(rows: Iterable[dict], factors: dict, triple_groups: Sequence[Sequence[str]] = (), *,
              also: Iterable[dict] = ()) -> list:
    """What ``rows`` miss: the factor combinations (pairs of all factors, triples within
    each group) with fewer distinct values in ``rows`` than the factors allow, and the
    partial rows of ``also`` that no row holds."""
    rows = list(rows)
    names, triples = _tuples(factors, triple_groups)
    missing: list = []
    for combo in [*itertools.combinations(names, 2), *triples]:
        seen = {tuple(r[f] for f in combo) for r in rows}
        if len(seen) < len(list(itertools.product(*(factors[f] for f in combo)))):
            missing.append(combo)
    missing += [c for c in also if not any(all(r[f] == v for f, v in c.items()) for r in rows)]
    return missing
