"""Context-parallel benchmark: ``torchrun --nproc-per-node N -m kvarena.benchmark cp``.

Per model shape and mode, one layer of a slab rollout (sinks + window committed, then a
denoising step: ``forward(commit=False)`` over the whole history plus the step's own
chunk): the attention call's time per layer (max over ranks), the collectives' time
(the same all-to-alls on the same shapes, timed alone), bytes each rank sent, KV bytes
per rank for the whole model, and the efficiency ``t1 / (N * tN)``, ``t1`` being the
single-process pool timed by every rank on the whole tensors in the same run. Runs with
N = 1 too (then it times the per-rank compute only). NCCL on CUDA, gloo on CPU.

Shapes (Wan 2.1 DiT): 1.3B = 12 heads x 128, 30 layers; 14B = 40 heads x 128, 40 layers;
``T`` = 4680 tokens per chunk (3 latent frames x 1560), sinks 1 + window 7 chunks, bf16.
``--tiny`` shrinks them for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

__all__ = ["MODELS", "run_cp", "main"]

#: name -> (heads, head_dim, layers); Wan's self-attention has as many kv heads as heads.
MODELS = {"wan1.3b": (12, 128, 30), "wan14b": (40, 128, 40)}
TINY = {"wan1.3b": (6, 16, 2), "wan14b": (12, 16, 2)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (after one warm-up), synchronized."""
    fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def _max_over_ranks(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _case(name: str, mode: str, *, tokens, sinks, window, dtype, device, reps, tiny) -> dict:
    """One row: a model shape in one mode (a ValueError of the pool: a skipped row)."""
    from kvarena import CachePolicy, KVLayout, SlabKVCache
    from kvarena.distributed import ContextParallel

    heads, d, layers = (TINY if tiny else MODELS)[name]
    row = {"model": name, "mode": mode, "world": dist.get_world_size(), "tokens": tokens, "sinks": sinks,
           "window": window, "heads": heads, "head_dim": d, "dtype": str(dtype)}
    try:
        cp = ContextParallel(mode=mode)
        lay = KVLayout(num_layers=1, num_kv_heads=heads, head_dim=d, dtype=dtype)
        policy = CachePolicy("slab_kv", (sinks + window + 1) * lay.block_bytes(tokens),
                             per_component={"sinks": sinks, "window": window})
        pool = SlabKVCache(policy, layout=lay, slab_tokens=tokens, device=device, context_parallel=cp)
        single = SlabKVCache(policy, layout=lay, slab_tokens=tokens, device=device)
    except ValueError as exc:
        return {**row, "status": "skipped", "reason": str(exc)}
    g = torch.Generator(device="cpu").manual_seed(0)

    def qkv():
        return [torch.randn(1, tokens, heads, d, generator=g).to(device=device, dtype=dtype) for _ in range(3)]

    with torch.no_grad():
        for c in range(sinks + window):  # fill the history (committed chunks)
            q, k, v = qkv()
            pool.forward(cp.shard(q), cp.shard(k), cp.shard(v), pool.plan({"r": c}), 0)
            single.forward(q, k, v, single.plan({"r": c}), 0)
        c = sinks + window
        m, ms = pool.plan({"r": c}), single.plan({"r": c})
        q, k, v = qkv()
        qs, ks, vs = cp.shard(q), cp.shard(k), cp.shard(v)
        cp.stats.reset()
        pool.forward(qs, ks, vs, m, 0, commit=False)
        sent = cp.stats.bytes_sent
        t_n = _time(lambda: pool.forward(qs, ks, vs, m, 0, commit=False), device, reps)
        qh = cp.to_heads(qs, tokens, 0) if mode == "heads" else None
        partial = torch.zeros(1, tokens, heads, d, device=device, dtype=dtype)
        partial_lse = torch.zeros(1, tokens, heads, device=device)

        def collectives():  # what forward sends, alone
            if mode == "heads":
                for x in (qs, ks, vs):
                    cp.to_heads(x, tokens, 0)
                cp.to_tokens(qh, 0)
            else:
                cp.gather_rows(qs, tokens, 0)
                cp.scatter_rows(partial, 0)
                cp.scatter_rows(partial_lse, 0)

        t_comm = _time(collectives, device, reps)
        t_1 = _time(lambda: single.forward(q, k, v, ms, 0, commit=False), device, reps)
    t_n, t_comm = _max_over_ranks(t_n, device), _max_over_ranks(t_comm, device)
    return {**row, "status": "ok", "attn_ms_per_layer": 1e3 * t_n, "collective_ms": 1e3 * t_comm,
            "single_ms": 1e3 * t_1, "efficiency": t_1 / (cp.world_size * t_n), "bytes_sent_per_layer": sent,
            "kv_gb_per_rank": pool.used_bytes * layers / 1e9}


def run_cp(*, models=("wan1.3b", "wan14b"), modes=("heads", "tokens"), tokens: int = 4680, sinks: int = 1,
           window: int = 7, dtype=torch.bfloat16, device=None, reps: int = 5, tiny: bool = False) -> list[dict]:
    """Rows of the context-parallel benchmark (every rank returns the same rows).

    ``torch.distributed`` must be initialized; the default group is used.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return [_case(name, mode, tokens=tokens, sinks=sinks, window=window, dtype=dtype, device=device, reps=reps,
                  tiny=tiny) for name in models for mode in modes]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvarena.benchmark cp", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="wan1.3b,wan14b")
    p.add_argument("--modes", default="heads,tokens")
    p.add_argument("--tokens", type=int, default=4680)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default=None)
    p.add_argument("--tiny", action="store_true", help="CPU-sized shapes (smoke run)")
    p.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rows = run_cp(models=a.models.split(","), modes=a.modes.split(","), tokens=a.tokens, dtype=dtype,
                  device=device, reps=a.reps, tiny=a.tiny)
    if dist.get_rank() == 0:
        for r in rows:
            if r["status"] != "ok":
                print(f"{r['model']:8} {r['mode']:6} N={r['world']}: skipped ({r['reason']})")
                continue
            print(f"{r['model']:8} {r['mode']:6} N={r['world']}: attention {r['attn_ms_per_layer']:.3f} ms/layer "
                  f"(collectives {r['collective_ms']:.3f} ms), single process {r['single_ms']:.3f} ms, "
                  f"efficiency {r['efficiency']:.2f}, sent {r['bytes_sent_per_layer'] / 1e6:.2f} MB/layer, "
                  f"KV {r['kv_gb_per_rank']:.3f} GB/rank")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()
    return 0
