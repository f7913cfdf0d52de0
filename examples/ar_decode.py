"""Llama-like GQA decoder served from a PagedKVCache (see kvarena/examples/ar_decode.py).

Usage: python examples/ar_decode.py [--new-tokens 8] [--device cpu|cuda] [--backend auto|torch|triton]
"""

import argparse

from kvarena.examples.ar_decode import run_ar_decode, summary

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto")
    a = p.parse_args()
    rep = run_ar_decode(new_tokens=a.new_tokens, device=a.device, backend=a.backend)
    print(summary(rep))
