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
                        help="DiT chunks per video, 1 or more (default 8; 3 with the interpreter)")
    parser.add_argument("--new-tokens", type=positive_int, default=None,
                        help="AR tokens per request, 1 or more (default 8; 3 with the interpreter)")
    parser.add_argument("--no-check", action="store_true", help="skip the dense reference checks")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ar_num_blocks(new_tokens: int, prompt_lens: tuple = _AR_PROMPT_LENS) -> int:
    """Paged-cache blocks that hold every AR request (and the fork) at full length.

    64 blocks hold the default run; larger ``--new-tokens`` get a larger cache instead of
    a CacheFullError halfway through.
    """
    lens = (*prompt_lens, prompt_lens[0])  # the fork of r0 grows as long as r0
    # +1 per sequence: the partly filled block a fork may have to copy.
    need = sum(math.ceil((n + new_tokens) / _AR_BLOCK_SIZE) + 1 for n in lens)
    return max(64, need)


def run(args: argparse.Namespace) -> int:
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

    from kvarena.examples.ar_decode import GEMMA3_LIKE, run_ar_decode
    from kvarena.examples.causal_dit import run_causal_dit

    dtype = torch.bfloat16 if on_cuda else torch.float32
    tiny = not on_cuda and args.backend == "triton"
    # None is the only "use the default" value: the parser rejects 0 and negatives.
    chunks = args.chunks if args.chunks is not None else (3 if tiny else 8)
    new_tokens = args.new_tokens if args.new_tokens is not None else (3 if tiny else 8)
    check = not args.no_check
    print(f"kvarena demo: device={device} backend={args.backend} dtype={str(dtype).replace('torch.', '')}")

    def dit_progress(done: int, total: int) -> None:
        print(f"  causal DiT rollout: chunk {done}/{total}", flush=True)

    dit = run_causal_dit(num_chunks=chunks, dtype=dtype, device=device, backend=args.backend, check=check,
                         residual_threshold=0.2, progress=dit_progress)

    def ar_progress(rep) -> None:
        print(f"  AR decode: step {rep.steps}, {rep.tokens} tokens", flush=True)

    ar = run_ar_decode(prompt_lens=_AR_PROMPT_LENS, new_tokens=new_tokens, block_size=_AR_BLOCK_SIZE,
                       num_blocks=_ar_num_blocks(new_tokens), dtype=dtype, device=device,
                       backend=args.backend, check=check, progress=ar_progress)
    # Hybrid: prompts of 100 and 37 tokens, then 8x --new-tokens (64 by default: the
    # generation runs well past the 64-token window); the interpreter keeps it short.
    hy_new = new_tokens if tiny else 8 * new_tokens
    hy_lens = (20, 9) if tiny else _HYBRID_PROMPT_LENS
    hy = run_ar_decode(config=GEMMA3_LIKE, prompt_lens=hy_lens, new_tokens=hy_new, prefill_chunk=32,
                       block_size=_AR_BLOCK_SIZE, num_blocks=_ar_num_blocks(hy_new, hy_lens), dtype=dtype,
                       device=device, backend=args.backend, check=check, progress=ar_progress)
    full = [g for g, w in enumerate(hy.group_windows) if w is None]
    slid = [g for g, w in enumerate(hy.group_windows) if w is not None]
    kept_all = hy.group_blocks_peak[full[0]] * len(hy.group_windows) * hy.block_bytes  # no release: all like full
    hy_mem = (f"{_fmt_bytes(hy.arena_used_bytes_peak)} ({_fmt_bytes(kept_all)} keeping every layer's history)")

    after = dit.arena_used_bytes_after_window
    flat = "n/a: window never filled" if not after else ("yes" if len(set(after)) == 1 else f"NO: {after}")
    def err(rep) -> str:
        return f"{rep.max_logit_err:.2e}, greedy match {rep.greedy_match}" if check else "not checked"

    rows = [
        ("workload", "causal DiT rollout (slab KV)", "AR decode (paged KV)", "hybrid decode (layer groups)"),
        ("work", f"{dit.chunks} chunks x 4 namespaces, {dit.passes} passes", f"{ar.requests} requests, {ar.steps} steps",
         f"{hy.requests} requests, {hy.steps} steps"),
        ("visibility", dit.visibility, "causal, whole history",
         f"{len(slid)} sliding (window {hy.group_windows[slid[0]] + 1}) : {len(full)} full layers"),
        ("tokens processed", f"{dit.tokens}", f"{ar.tokens}", f"{hy.tokens}"),
        ("arena reserved", _fmt_bytes(dit.arena_reserved_bytes), _fmt_bytes(ar.arena_reserved_bytes),
         _fmt_bytes(hy.arena_reserved_bytes)),
        ("arena used (peak)", _fmt_bytes(dit.arena_used_bytes), _fmt_bytes(ar.arena_used_bytes_peak), hy_mem),
        ("retained KV bytes moved", f"{dit.retained_bytes_moved} (memory flat after window: {flat})",
         "n/a (nothing recycled; a fork shares blocks)",
         f"0 (blocks per group at peak: full {hy.group_blocks_peak[full[0]]}, sliding "
         f"<= {max(hy.group_blocks_peak[g] for g in slid)})"),
        ("reuse", f"text K/V hits {dit.text_cache_hits}/{dit.text_cache_hits + dit.text_cache_misses}, "
                  f"layers skipped {dit.skipped_layer_evals}", "fork shares prompt blocks",
         "freed sliding blocks serve new tokens"),
        ("max error vs dense", f"{dit.max_err:.2e} ({dit.checked_passes} passes)" if check else "not checked",
         err(ar), err(hy)),
        ("wall time", f"{dit.wall_s:.2f} s", f"{ar.wall_s:.2f} s", f"{hy.wall_s:.2f} s"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    for i, row in enumerate(rows):
        print("| " + " | ".join(f"{c:<{w}}" for c, w in zip(row, widths)) + f" | {row[3]}")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|" + "-" * 30)
    # OK means: every requested chunk and token ran, and each was checked against dense
    # recomputation. A run that did less never reports OK, nor does one that was not checked.
    ran = dit.chunks == chunks and dit.tokens > 0 and ar.tokens > 0 and ar.steps > 0 and hy.steps > 0
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    if not ran:
        print(f"\nresult: INCOMPLETE (ran {dit.chunks}/{chunks} DiT chunks, {ar.tokens} AR tokens)")
        return 1
    if not check:
        print("\nresult: ran, not checked against the dense reference (--no-check)")
        return 0
    ok = (dit.checked_passes > 0 and dit.max_err <= tol and ar.max_logit_err <= tol and ar.greedy_match
          and hy.max_logit_err <= tol and hy.greedy_match)
    print("\nresult:", "OK" if ok else "MISMATCH vs dense reference")
    return 0 if ok else 1
