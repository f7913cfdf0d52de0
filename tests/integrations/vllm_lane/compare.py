"""Comparing two engine runs request by request (pure Python, no vLLM).

Tolerances scale with the logprob: a bf16 logit of magnitude m is rounded to within
m * 2**-9, and the logprob of a token at ``lp`` moves by a few such steps, so a token is
close when ``|lp - lp_ref| <= tol + rel * |lp_ref|`` (``tol`` absolute, ``rel`` relative).
Greedy tokens must be equal except at a near-tie: where the reference's chosen and
runner-up logprobs are within that same bound of each other, bf16 rounding may pick
either, and the two continuations are compared no further.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Distance:
    """How far one run is from a reference: mismatches (described), and the logprob gaps."""

    mismatches: tuple[str, ...]
    compared: int  # tokens compared (up to each request's first near-tie divergence)
    max_abs: float
    mean_abs: float


def bound(lp_ref: float, tol: float, rel: float) -> float:
    return tol + rel * abs(lp_ref)


def distance(ref: dict, got: dict, *, tol: float, rel: float) -> Distance:
    mismatches, diffs = [], []
    for name, ref_reqs in ref["workloads"].items():
        for i, (r, g) in enumerate(zip(ref_reqs, got["workloads"][name])):
            for j, (rt, gt) in enumerate(zip(r["tokens"], g["tokens"])):
                if rt != gt:
                    gap = r["logprobs"][j] - (r["runner_up"][j] if r["runner_up"][j] is not None else -1e9)
                    tie = bound(r["logprobs"][j], tol, rel)
                    if gap > tie:
                        mismatches.append(f"{name}[{i}] token {j}: {gt} where the reference chose {rt} "
                                          f"(its top-2 gap {gap:.3f} > {tie:.3f})")
                    break
                d, limit = abs(r["logprobs"][j] - g["logprobs"][j]), bound(r["logprobs"][j], tol, rel)
                diffs.append(d)
                if d > limit:
                    mismatches.append(f"{name}[{i}] token {j}: logprob {g['logprobs'][j]:.4f} vs the reference's "
                                      f"{r['logprobs'][j]:.4f} (|diff| {d:.4f} > {limit:.3f})")
    return Distance(tuple(mismatches), len(diffs), max(diffs, default=0.0), sum(diffs) / max(len(diffs), 1))


def prompt_distance(ref: dict, got: dict, *, tol: float = float("inf"), rel: float = 0.0) -> Distance:
    """Teacher-forced: |logprob difference| of every prompt token that has one (``mixed``),
    and a mismatch for each beyond ``tol + rel * |lp_ref|``."""
    mismatches, diffs = [], []
    for i, (r, g) in enumerate(zip(ref["workloads"]["mixed"], got["workloads"]["mixed"])):
        for j, (a, b) in enumerate(zip(r["prompt_logprobs"], g["prompt_logprobs"])):
            if a is None:
                continue
            diffs.append(abs(a - b))
            if diffs[-1] > bound(a, tol, rel):
                mismatches.append(f"mixed[{i}] prompt token {j}: logprob {b:.4f} vs the reference's {a:.4f}")
    return Distance(tuple(mismatches), len(diffs), max(diffs, default=0.0), sum(diffs) / max(len(diffs), 1))
