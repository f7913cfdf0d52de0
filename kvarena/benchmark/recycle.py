"""Recycling: kvarena's in-place slab ring against the shift-left copy window.

The baseline is :class:`~kvarena.benchmark.shift_left.ShiftLeftKVCache`; the bytes each scheme
moves are counted by :class:`~kvarena.benchmark.bytecount.KVByteCounter`.

kvarena's ring (``SlabKVCache.plan`` / ``forward(commit=True)``) overwrites the evicted
slab in place: the only KV bytes it writes are the new chunk's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvarena.benchmark.bytecount import KVByteCounter
from kvarena.benchmark.shift_left import ShiftLeftKVCache

__all__ = ["ShiftLeftKVCache", "KVByteCounter", "RecycleConfig", "CONFIGS", "run_recycle", "chunk_stepper"]


@dataclass(frozen=True)
class RecycleConfig:
    """One rollout: ``chunks`` chunks of ``chunk`` tokens through ``layers`` layers.

    ``counted`` is how many chunks the byte-counting pass runs (None = all); it must pass
    ``sinks + window`` so the baseline's shifting regime is seen.
    """

    chunks: int = 120
    layers: int = 4
    batch: int = 1
    chunk: int = 64
    window: int = 3
    sinks: int = 1
    h_q: int = 4
    h_kv: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"
    counted: int | None = None
    # Token-granular visibility (both None: whole chunks): sinks and window in tokens, and
    # a short first chunk (image-to-video).
    sink_tokens: int | None = None
    window_tokens: int | None = None
    first_chunk: int | None = None

    @property
    def tokens(self) -> bool:
        return self.sink_tokens is not None

    def chunk_len(self, c: int) -> int:
        return (self.first_chunk or self.chunk) if c == 0 else self.chunk

    @property
    def fill(self) -> int:
        """The first chunk the baseline has to shift for (its buffer of S + W tokens is full)."""
        if not self.tokens:
            return self.sinks + self.window
        cap, end, c = self.sink_tokens + self.window_tokens, 0, 0
        while end + self.chunk_len(c) <= cap:
            end += self.chunk_len(c)
            c += 1
        return c


CONFIGS = {
    # 120 chunks of 64 tokens, 4 layers, window 3 + 1 sink: ~1.5 s timed on 2 CPU cores;
    # bytes are counted over the first 12 chunks (8 past the window filling), since the
    # dispatch mode costs ~0.3 ms per op.
    "quick": RecycleConfig(counted=12),
    # Wan-1.3B per-layer shape (12 heads, chunk 4680, window 4, 1 sink) over 100 chunks;
    # 4 layers instead of 30 keeps it to a few seconds (every layer does the same work).
    "gpu": RecycleConfig(chunks=100, layers=4, chunk=4680, window=4, sinks=1, h_q=12, h_kv=12,
                         head_dim=128, counted=12),
    # Self-Forcing's token rule: 16-token frames, 3-frame chunks after a 1-frame first chunk
    # (image-to-video), a 1-frame sink and a 7-frame window: no union of whole chunks.
    "quick-tokens": RecycleConfig(chunks=60, chunk=48, sink_tokens=16, window_tokens=112, first_chunk=16,
                                  counted=12),
    # Wan-1.3B frames (1560 tokens), 3-frame chunks after a 1-frame first one, sink 1 frame,
    # window 7 frames.
    "gpu-tokens": RecycleConfig(chunks=100, layers=4, chunk=4680, h_q=12, h_kv=12, head_dim=128, counted=12,
                                sink_tokens=1560, window_tokens=7 * 1560, first_chunk=1560),
}


class _Inputs:
    """Deterministic per-(chunk, layer) q/k/v, drawn from a small pool built up front so
    that generation is not timed. ``sinks + window + 3`` distinct entries: every chunk
    of one window holds different data, so a misplaced slab changes the output."""

    def __init__(self, cfg: RecycleConfig, device: torch.device) -> None:
        self.cfg = cfg
        dt = getattr(torch, cfg.dtype)
        # Drawn on the device: the gpu config's pool is ~0.7 G elements, seconds on a host.
        g = torch.Generator(device=device).manual_seed(1234)
        self.n = cfg.fill + 3
        b, t, d = cfg.batch, cfg.chunk, cfg.head_dim

        def rnd(h):
            return torch.randn(b, t, h, d, generator=g, device=device, dtype=dt)

        self.sets = [[(rnd(cfg.h_q), rnd(cfg.h_kv), rnd(cfg.h_kv)) for _ in range(cfg.layers)]
                     for _ in range(self.n)]

    def __call__(self, chunk: int, layer: int):
        n = self.cfg.chunk_len(chunk)
        return tuple(x[:, :n] for x in self.sets[chunk % self.n][layer])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_slab(cfg: RecycleConfig, device: torch.device):
    from kvarena.cache.arena import KVLayout
    from kvarena.cache.keys import CachePolicy
    from kvarena.cache.slab import SlabKVCache

    layout = KVLayout(cfg.layers, cfg.h_kv, cfg.head_dim, getattr(torch, cfg.dtype))
    slab_bytes = layout.block_bytes(cfg.chunk)
    if cfg.tokens:
        per = {"sink_tokens": cfg.sink_tokens, "window_tokens": cfg.window_tokens}
    else:
        per = {"window": cfg.window, "sinks": cfg.sinks}
    # Room for exactly the slabs a rollout holds at once, asked of a pool on the meta device.
    probe = SlabKVCache(CachePolicy("slab_kv", max_bytes=1 << 40, per_component=per), layout=layout,
                        slab_tokens=cfg.chunk, device="meta")
    slabs = probe.slabs_per_rollout(cfg.chunk_len(0))
    policy = CachePolicy("slab_kv", max_bytes=cfg.batch * slabs * slab_bytes, per_component=per)
    return SlabKVCache(policy, layout=layout, slab_tokens=cfg.chunk, device=device)


def _plan_chunk(pool, names, cfg: RecycleConfig, c: int):
    return pool.plan(dict.fromkeys(names, (0, cfg.chunk_len(0)) if c == 0 else c))


def _shift_cache(cfg: RecycleConfig, device) -> ShiftLeftKVCache:
    return ShiftLeftKVCache(cfg.layers, cfg.batch, cfg.chunk, window=cfg.window, sinks=cfg.sinks,
                            num_kv_heads=cfg.h_kv, head_dim=cfg.head_dim, dtype=getattr(torch, cfg.dtype),
                            device=device, sink_tokens=cfg.sink_tokens, window_tokens=cfg.window_tokens)


def _slab_reserved_bytes(pool) -> int:
    """Bytes the pool's arena holds for KV (all slabs, used or not): its peak KV memory."""
    return int(pool.arena.reserved_bytes)


def _slab_storages(pool) -> list[torch.Tensor]:
    """Views of the pool's KV storage (every region of an arena shares its one buffer)."""
    return [pool.arena.buffer]


def _rollout_kvarena(cfg, device, inputs, *, chunks, counter=None, keep=(), backend="auto"):
    pool = _make_slab(cfg, device)
    names = [f"r{i}" for i in range(cfg.batch)]
    kept: dict[int, torch.Tensor] = {}
    per_chunk_s: list[float] = []
    if counter is not None:
        counter.watch(*_slab_storages(pool))
    mem_after_fill = None
    for c in range(chunks):
        if counter is not None:
            counter.begin_chunk()
        t0 = time.perf_counter()
        meta = _plan_chunk(pool, names, cfg, c)
        for layer in range(cfg.layers):
            q, k, v = inputs(c, layer)
            out = pool.forward(q, k, v, meta, layer, commit=True, backend=backend)
        _sync(device)
        per_chunk_s.append(time.perf_counter() - t0)
        if c in keep:
            kept[c] = out.detach().clone()
        if c == cfg.fill and device.type == "cuda":
            mem_after_fill = torch.cuda.memory_allocated(device)
    return pool, per_chunk_s, kept, mem_after_fill


def _rollout_shift(cfg, device, inputs, *, chunks, counter=None, keep=()):
    cache = _shift_cache(cfg, device)
    if counter is not None:
        counter.watch(*cache.k, *cache.v)
    kept: dict[int, torch.Tensor] = {}
    per_chunk_s: list[float] = []
    mem_after_fill = None
    for c in range(chunks):
        if counter is not None:
            counter.begin_chunk()
        t0 = time.perf_counter()
        for layer in range(cfg.layers):
            q, k, v = inputs(c, layer)
            out = cache.forward(q, k, v, layer)
        _sync(device)
        per_chunk_s.append(time.perf_counter() - t0)
        if c in keep:
            kept[c] = out.detach().clone()
        if c == cfg.fill and device.type == "cuda":
            mem_after_fill = torch.cuda.memory_allocated(device)
    return cache, per_chunk_s, kept, mem_after_fill


def chunk_stepper(scheme: str, cfg: RecycleConfig | str = "quick", device="cpu", *, prefill: bool = True):
    """A callable that runs the next chunk of a rollout through every layer.

    Parameters
    ----------
    scheme : ``"kvarena"`` (slab ring: plan + ``forward(commit=True)`` per layer) or
        ``"shift_left"`` (the copy window).
    cfg : RecycleConfig or a key of :data:`CONFIGS`.
    prefill : run ``sinks + window`` chunks first, so every call is past the window
        filling (the kvarena ring recycles, the baseline shifts).

    Returns
    -------
    (step, state)
        ``step()`` returns the last layer's output of the chunk it ran; ``state`` is the
        ``SlabKVCache`` or ``ShiftLeftKVCache``. The rollout can go on indefinitely.
    """
    if isinstance(cfg, str):
        cfg = CONFIGS[cfg]
    device = torch.device(device)
    inputs = _Inputs(cfg, device)
    counter = [0]
    if scheme == "kvarena":
        state = _make_slab(cfg, device)
        names = [f"r{i}" for i in range(cfg.batch)]

        def step():
            c = counter[0]
            counter[0] += 1
            meta = _plan_chunk(state, names, cfg, c)
            for layer in range(cfg.layers):
                q, k, v = inputs(c, layer)
                out = state.forward(q, k, v, meta, layer, commit=True)
            return out
    elif scheme == "shift_left":
        state = _shift_cache(cfg, device)

        def step():
            c = counter[0]
            counter[0] += 1
            for layer in range(cfg.layers):
                q, k, v = inputs(c, layer)
                out = state.forward(q, k, v, layer)
            return out
    else:
        raise ValueError(f"scheme: expected 'kvarena' or 'shift_left', got {scheme!r}")
    if prefill:
        for _ in range(cfg.fill):
            step()
    return step, state


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return math.nan if n == 0 else (s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2]))


def _summarize_counts(per_chunk: list[dict[str, int]], fill: int) -> dict[str, Any]:
    steady = per_chunk[fill:]

    def stat(key, rows):
        vals = [r[key] for r in rows]
        return {"min": min(vals), "max": max(vals), "mean": sum(vals) / len(vals)} if vals else None

    return {
        "chunks_counted": len(per_chunk),
        "window_full_from_chunk": fill,
        # Per chunk, all layers, K and V together.
        "new_bytes_per_chunk": stat("new", steady),
        "retained_bytes_per_chunk": stat("retained", steady),
        "temp_bytes_per_chunk": stat("temp", steady),
        "retained_bytes_before_full": stat("retained", per_chunk[:fill]),
        "per_chunk": per_chunk,
    }


def run_recycle(cfg: RecycleConfig | str = "quick", device: str | torch.device = "cpu",
                *, log=print) -> dict[str, Any]:
    """Run both schemes over one rollout: bytes moved, memory, wall time, same output.

    Parameters
    ----------
    cfg : RecycleConfig or a key of :data:`CONFIGS`
    device : where to run the timed rollouts. The counting pass runs on the same device
        through the PyTorch path.
    log : callable for progress lines.

    Returns
    -------
    dict
        ``config``, and per scheme (``"kvarena"``, ``"shift_left"``): ``counts`` (bytes per
        chunk after the window fills: ``new``, ``retained``, ``temp``), ``memory``,
        ``time``; ``sanity`` (max relative difference of the last layer's output).
    """
    if isinstance(cfg, str):
        cfg = CONFIGS[cfg]
    device = torch.device(device)
    inputs = _Inputs(cfg, device)
    fill = cfg.fill  # chunk index from which the baseline shifts
    counted = min(cfg.chunks, cfg.counted or cfg.chunks)
    result: dict[str, Any] = {"config": asdict(cfg), "device": str(device)}
    # 1) counting pass (dispatch mode on, PyTorch path), also collecting outputs to compare.
    counts = _count_bytes(cfg, device, inputs, counted, log)
    result["sanity"] = counts.sanity
    # 2) timed pass (no mode; the default backend: Triton on CUDA).
    timed = {name: _time_rollout(name, fn, cfg, device, inputs, log)
             for name, fn in (("kvarena", _rollout_kvarena), ("shift_left", _rollout_shift))}
    result["kvarena"] = {"counts": _summarize_counts(counts.kvarena.per_chunk, fill), **timed["kvarena"]}
    result["shift_left"] = {"counts": _summarize_counts(counts.shift_left.per_chunk, fill), **timed["shift_left"]}
    el = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    token_bytes = cfg.batch * cfg.h_kv * cfg.head_dim * el
    # What the baseline must move per chunk once full: (window - 1) chunks of K and of V in
    # every layer, written back into the buffer ("retained") after being cloned ("temp":
    # the same amount again). A check on the counter itself.
    window_tokens = cfg.window_tokens if cfg.tokens else cfg.window * cfg.chunk
    result["expected_shift_retained_bytes_per_chunk"] = 2 * cfg.layers * (window_tokens - cfg.chunk) * token_bytes
    result["new_chunk_bytes"] = 2 * cfg.layers * cfg.chunk * token_bytes
    return result


@dataclass(frozen=True)
class _Counts:
    """The counting pass: each scheme's byte counter and the outputs' agreement."""

    kvarena: KVByteCounter
    shift_left: KVByteCounter
    sanity: dict


def _count_bytes(cfg: RecycleConfig, device: torch.device, inputs: _Inputs, counted: int, log) -> _Counts:
    """Both schemes over ``counted`` chunks under a :class:`KVByteCounter` (dispatch mode
    on, PyTorch path), with the outputs of a few chunks compared."""
    fill = cfg.fill
    keep = sorted({0, fill - 1, fill, fill + 1, counted - 1})
    log(f"recycle: counting bytes over {counted} chunks ({cfg.layers} layers) ...")
    c_kv = KVByteCounter()
    with c_kv:
        _, _, out_kv, _ = _rollout_kvarena(cfg, device, inputs, chunks=counted, counter=c_kv, keep=keep,
                                           backend="torch")
    c_sl = KVByteCounter()
    with c_sl:
        _, _, out_sl, _ = _rollout_shift(cfg, device, inputs, chunks=counted, counter=c_sl, keep=keep)
    errs = {}
    for c in keep:
        a, b = out_kv[c].float(), out_sl[c].float()
        errs[c] = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    tol = 3e-2 if cfg.dtype in ("bfloat16", "float16") else 1e-4
    sanity = {"max_rel_err_by_chunk": errs, "max_rel_err": max(errs.values()), "tolerance": tol,
              "same_output": max(errs.values()) <= tol}
    return _Counts(c_kv, c_sl, sanity)


def _time_rollout(name: str, fn, cfg: RecycleConfig, device: torch.device, inputs: _Inputs, log) -> dict:
    """One scheme's timed rollout over ``cfg.chunks`` chunks: its memory and times."""
    fill = cfg.fill
    log(f"recycle: timing {name} over {cfg.chunks} chunks ...")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    obj, per_chunk_s, _, mem_fill = fn(cfg, device, inputs, chunks=cfg.chunks)
    total = time.perf_counter() - t0
    mem = {}
    if name == "kvarena":
        mem["reserved_bytes"] = _slab_reserved_bytes(obj)
        mem["peak_kv_bytes"] = mem["reserved_bytes"]  # the arena never grows or copies
    else:
        mem["reserved_bytes"] = obj.reserved_bytes
        mem["peak_kv_bytes"] = obj.reserved_bytes + obj.transient_bytes
    if device.type == "cuda":
        mem["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) - base
        end = torch.cuda.memory_allocated(device)
        mem["cuda_growth_after_fill_bytes"] = None if mem_fill is None else end - mem_fill
    # Dropped here: the next scheme's memory is measured without this one's buffers.
    del obj
    return {
        "memory": mem,
        "time": {
            "total_s": total,
            "chunks": cfg.chunks,
            "per_chunk_ms_median": 1e3 * _median(per_chunk_s[fill:]),
            "per_chunk_ms_median_before_full": 1e3 * _median(per_chunk_s[:fill]),
        },
    }
