"""Self-Forcing-style causal video DiT rollout over a SlabKVCache (see kvarena/examples/causal_dit.py).

Usage: python examples/causal_dit.py [--chunks 8] [--device cpu|cuda] [--backend auto|torch|triton]
"""

import argparse

from kvarena.examples.causal_dit import run_causal_dit, summary

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto")
    p.add_argument("--residual-threshold", type=float, default=0.05)
    a = p.parse_args()
    rep = run_causal_dit(num_chunks=a.chunks, device=a.device, backend=a.backend,
                         residual_threshold=a.residual_threshold,
                         progress=lambda d, n: print(f"chunk {d}/{n}", flush=True))
    print(summary(rep))
