"""``kvarena demo``: the package's main job, end to end, on whatever device is there.

Runs the causal-DiT rollout (slab KV with sinks + window recycled in place, two CFG
branches, two videos, FeatureCache text K/V, ResidualCache reuse), the AR decode (paged
KV, chunked prefill + decode, a fork) and a Gemma-3-like hybrid decode (5 sliding layers,
window 64, per full layer: a layer group each, the sliding ones releasing old blocks),
checks all three against dense recomputation, and prints one table.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from kvarena.cli import UsageError, device_name, positive_int

# The AR decode's requests; the demo sizes its paged cache from them (see _ar_num_blocks).
_AR_PROMPT_LENS = (5, 17, 30)
_HYBRID_PROMPT_LENS = (100, 37)
_AR_BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                        help="attention backend: auto = Triton on CUDA, torch on CPU; "
                             "triton on CPU runs the Triton interpreter at tiny sizes")
    parser.add_argument("--device", type=device_name, default=None,
                        help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="DiT chunks per video, 1 or more (default 8; 5 with the interpreter)")
    parser.add_argument("--new-tokens", type=positive_int, default=None,
                        help="AR tokens per request, 1 or more (default 8; 3 with the interpreter)")
    parser.add_argument("--no-check", action="store_true", help="skip the dense reference checks")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ar_num_blocks(new_tokens: int, prompt_lens: tuple = _AR_PROMPT_LENS, block_size: int = _AR_BLOCK_SIZE) -> int:
    """Paged-cache blocks that hold every AR request (and the fork) at full length.

    64 blocks hold the default run; larger ``--new-tokens`` get a larger cache instead of
    a CacheFullError halfway through.
    """
    lens = (*prompt_lens, prompt_lens[0])  # the fork of r0 grows as long as r0
    # +1 per sequence: the partly filled block a fork may have to copy.
    need = sum(math.ceil((n + new_tokens) / block_size) + 1 for n in lens)
    return max(64, need)


def _tolerance(dtype) -> float:
    """The largest error vs dense that the demo calls OK: fp32 on CPU, bf16 on CUDA."""
    import torch

    return 1e-3 if dtype == torch.float32 else 5e-2


def _decode_tokens(prompt_lens: tuple, new_tokens: int) -> int:
    """Tokens an AR decode run feeds the model: every prompt and all but the last sampled
    token of each request, plus the fork of ``r0`` (it starts with one sampled token)."""
    return sum(prompt_lens) + (len(prompt_lens) + 1) * (new_tokens - 1)


_LEGEND = """\
legend:
  streams: 2 videos x {{cond, uncond}} CFG branches; a pass = one model call over a chunk (denoising steps, then
    the commit pass that stores the chunk's K/V); sinks are kept forever, the window slides with the chunk.
  arena: the one device allocation, sized up front, that every block/slab lives in; "used" is what live K/V
    hold, "flat after window" means memory stops growing once the window is full (slabs recycled in place).
  retained KV bytes moved: K/V that stayed in the cache but were copied (a shift-left window cache copies its
    whole window every chunk; 0 means the kept K/V never move).
  hybrid: the sliding-window layers give blocks that left the window back, so memory grows with the full layers
    only ("no release": the same run keeping every layer's history).
  max error vs dense: largest |difference| from the same model recomputing the whole sequence with no cache
    (OK below {tol:g}); reused residuals (DBCache-style) are approximate by design, so those passes are not compared."""


class _Progress:
    """One line per workload: a bar redrawn in place on a terminal; elsewhere only the
    line it ends with, so redirected output has no control characters."""

    def __init__(self, name: str, total: int, unit: str) -> None:
        import sys
        import time

        self.name, self.total, self.unit = name, max(1, total), unit
        self.stream = sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.update(0)

    def update(self, done: int) -> None:
        if not self.tty:
            return
        frac = min(1.0, done / self.total)
        fill = int(round(24 * frac))
        self.stream.write(f"\r  {self.name:<30} [{'#' * fill}{'.' * (24 - fill)}] {done}/{self.total} {self.unit}")
        self.stream.flush()

    def finish(self, wall_s: float) -> None:
        line = f"  {self.name:<30} done: {self.total} {self.unit} in {wall_s:.1f} s"
        self.stream.write(f"\r{line:<72}\n" if self.tty else line + "\n")
        self.stream.flush()


_NAMES = ("causal DiT rollout (slab KV)", "AR decode (paged KV)", "hybrid decode (layer groups)")


@dataclass(frozen=True)
class _Plan:
    """What one ``kvarena demo`` runs: the device and backend, sizes, whether it checks."""

    device: str
    backend: str
    dtype: object  # torch.dtype (torch is imported in run)
    tiny: bool  # the interpreter's run: fewer steps, a smaller window
    chunks: int
    new_tokens: int
    check: bool


@dataclass(frozen=True)
class _Reports:
    """The three workloads' reports (``CausalDiTReport``, ``ARDecodeReport`` x 2)."""

    dit: object
    ar: object
    hy: object


def run(args: argparse.Namespace) -> int:
    plan = _plan(args)
    print(f"kvarena demo: device={plan.device} backend={plan.backend} dtype={str(plan.dtype).replace('torch.', '')}")
    reports = _run_workloads(plan)
    rows = _table_rows(reports, plan.check)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print()
    for i, row in enumerate(rows):
        print("| " + " | ".join(f"{c:<{w}}" for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print(_LEGEND.format(tol=_tolerance(plan.dtype)))
    return _verdict(reports, plan)


def _plan(args: argparse.Namespace) -> _Plan:
    """The run's device, dtype and sizes; sets ``TRITON_INTERPRET`` for a Triton run on CPU."""
    # Importing torch does not import triton, so the device can be resolved before
    # TRITON_INTERPRET is chosen: the interpreter is for a CPU run only.
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = torch.device(device).type == "cuda"
    if args.backend == "triton" and not on_cuda:
        # The interpreter is picked when triton is imported, so set it before anything does.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1":
            raise UsageError("--backend", "triton on CPU needs the Triton interpreter, but TRITON_INTERPRET="
                                          f"{os.environ['TRITON_INTERPRET']!r} is set; unset it or set it to 1")
    tiny = not on_cuda and args.backend == "triton"
    # None is the only "use the default" value: the parser rejects 0 and negatives.
    return _Plan(device=device, backend=args.backend, dtype=torch.bfloat16 if on_cuda else torch.float32, tiny=tiny,
                 chunks=args.chunks if args.chunks is not None else (5 if tiny else 8),
                 new_tokens=args.new_tokens if args.new_tokens is not None else (3 if tiny else 8),
                 check=not args.no_check)


def _run_workloads(plan: _Plan) -> _Reports:
    """The DiT rollout, the AR decode and the hybrid decode, each with its progress line."""
    from kvarena.examples.ar_decode import GEMMA3_LIKE, DecoderConfig, run_ar_decode
    from kvarena.examples.causal_dit import run_causal_dit

    tiny, new_tokens = plan.tiny, plan.new_tokens
    common = dict(dtype=plan.dtype, device=plan.device, backend=plan.backend, check=plan.check)
    # The interpreter's tiny run (2 denoising steps a chunk) still fills the window and
    # recycles slabs (sink 1 + window 3 frames: from chunk 3 on), and its hybrid model
    # slides an 8-token window over 4-token blocks.
    sink_frames, window_frames = (1, 3) if tiny else (2, 5)
    bar = _Progress(_NAMES[0], plan.chunks, "chunks")
    dit = run_causal_dit(num_chunks=plan.chunks, steps=2 if tiny else 4, sink_frames=sink_frames,
                         window_frames=window_frames, residual_threshold=0.2,
                         progress=lambda done, total: bar.update(done), **common)
    bar.finish(dit.wall_s)

    bar = _Progress(_NAMES[1], _decode_tokens(_AR_PROMPT_LENS, new_tokens), "tokens")
    ar = run_ar_decode(prompt_lens=_AR_PROMPT_LENS, new_tokens=new_tokens, block_size=_AR_BLOCK_SIZE,
                       num_blocks=_ar_num_blocks(new_tokens), progress=lambda rep: bar.update(rep.tokens), **common)
    bar.finish(ar.wall_s)
    # Hybrid: prompts of 100 and 37 tokens, then 4x --new-tokens (32 by default: both
    # requests run past the 64-token window); the interpreter's run is shorter and its
    # window smaller (Gemma 3's 5 sliding : 1 full, with an 8-token window).
    hy_new = new_tokens if tiny else 4 * new_tokens
    hy_lens = (20, 9) if tiny else _HYBRID_PROMPT_LENS
    hy_cfg = DecoderConfig(num_layers=6, windows=(7,) * 5 + (None,)) if tiny else GEMMA3_LIKE
    hy_block = 4 if tiny else _AR_BLOCK_SIZE
    bar = _Progress(_NAMES[2], _decode_tokens(hy_lens, hy_new), "tokens")
    hy = run_ar_decode(config=hy_cfg, prompt_lens=hy_lens, new_tokens=hy_new, prefill_chunk=32,
                       block_size=hy_block, num_blocks=_ar_num_blocks(hy_new, hy_lens, hy_block),
                       progress=lambda rep: bar.update(rep.tokens), **common)
    bar.finish(hy.wall_s)
    return _Reports(dit, ar, hy)


def _table_rows(reports: _Reports, check: bool) -> list[tuple[str, ...]]:
    """The table: a header row, then one row per measure with a cell per workload."""
    dit, ar, hy = reports.dit, reports.ar, reports.hy
    full = [g for g, w in enumerate(hy.group_windows) if w is None]
    slid = [g for g, w in enumerate(hy.group_windows) if w is not None]
    kept_all = hy.group_blocks_peak[full[0]] * len(hy.group_windows) * hy.block_bytes  # no release: all like full

    after = dit.arena_used_bytes_after_window
    flat = "n/a: window never filled" if not after else ("flat" if len(set(after)) == 1 else f"NOT flat: {after}")

    def err(rep) -> str:
        return f"{rep.max_logit_err:.1e}, same greedy tokens: {'yes' if rep.greedy_match else 'NO'}" if check \
            else "not checked"

    dit_err = "not checked"
    if check:
        dit_err = f"{dit.max_err:.1e} ({dit.checked_passes} of {dit.passes} passes"
        dit_err += f"; {dit.passes - dit.checked_passes} reused residuals)" if dit.checked_passes < dit.passes else ")"
    return [
        ("workload", *_NAMES),
        ("work", f"{dit.chunks} chunks x 4 streams, {dit.passes} passes", f"{ar.requests} requests, {ar.steps} steps",
         f"{hy.requests} requests, {hy.steps} steps"),
        ("attends to", dit.visibility, "whole history",
         f"{len(slid)} layers window {hy.group_windows[slid[0]] + 1}, {len(full)} full"),
        ("tokens processed", f"{dit.tokens}", f"{ar.tokens}", f"{hy.tokens}"),
        ("arena reserved", _fmt_bytes(dit.arena_reserved_bytes), _fmt_bytes(ar.arena_reserved_bytes),
         _fmt_bytes(hy.arena_reserved_bytes)),
        ("arena used (peak)", f"{_fmt_bytes(dit.arena_used_bytes)}, {flat} after window",
         _fmt_bytes(ar.arena_used_bytes_peak),
         f"{_fmt_bytes(hy.arena_used_bytes_peak)} (no release: {_fmt_bytes(kept_all)})"),
        ("retained KV bytes moved", f"{dit.retained_bytes_moved}", "0 (a fork shares blocks)",
         f"0 (blocks: full {hy.group_blocks_peak[full[0]]}, sliding <= {max(hy.group_blocks_peak[g] for g in slid)})"),
        ("reuse", f"text K/V hits {dit.text_cache_hits}/{dit.text_cache_hits + dit.text_cache_misses}, "
                  f"{dit.skipped_layer_evals} layers skipped", "fork shares prompt blocks",
         "freed sliding blocks reused"),
        ("max error vs dense", dit_err, err(ar), err(hy)),
        ("wall time", f"{dit.wall_s:.1f} s", f"{ar.wall_s:.1f} s", f"{hy.wall_s:.1f} s"),
    ]


def _verdict(reports: _Reports, plan: _Plan) -> int:
    """Print the result line; the exit code (0: OK, or ran unchecked with --no-check)."""
    dit, ar, hy = reports.dit, reports.ar, reports.hy
    # OK means: every requested chunk and token ran, and each was checked against dense
    # recomputation. A run that did less never reports OK, nor does one that was not checked.
    ran = dit.chunks == plan.chunks and dit.tokens > 0 and ar.tokens > 0 and ar.steps > 0 and hy.steps > 0
    tol = _tolerance(plan.dtype)
    if not ran:
        print(f"\nresult: INCOMPLETE (ran {dit.chunks}/{plan.chunks} DiT chunks, {ar.tokens} AR tokens)")
        return 1
    if not plan.check:
        print("\nresult: ran, not checked against the dense reference (--no-check)")
        return 0
    ok = (dit.checked_passes > 0 and dit.max_err <= tol and ar.max_logit_err <= tol and ar.greedy_match
          and hy.max_logit_err <= tol and hy.greedy_match)
    print("\nresult:", "OK" if ok else "MISMATCH vs dense reference")
    return 0 if ok else 1
