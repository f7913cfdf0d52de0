"""Host overhead: microseconds per ``plan()`` and per-layer ``forward()`` call.

Shapes are tiny on purpose (2 layers, 4 q / 2 kv heads, head_dim 64, bf16; decode with
16-token pages and 17-30 keys per sequence; slab chunks of 16 tokens, window 3, one
sink), so that what is measured is the Python and dispatch cost that docs/contract.md bounds
(<= 30 us of Python per layer at decode), not attention arithmetic.

Rows
----
``*.plan``
    One ``plan`` per step (all layers share it), timed call by call. ``paged.plan (6 layer
    groups, ...)``: the same decode step of a Gemma-3-like layout (5 sliding layers with
    a 32-token window, 1 full; a layer group each) releasing out-of-window blocks, against
    the ungrouped row of the same run: the host cost of a block list per group.
``*.forward``
    One layer's ``forward`` (store + attend), timed call by call. On CPU this includes
    the PyTorch path's arithmetic; on CUDA the calls are not synchronized one by one, so
    it is the host time to issue them (launches are asynchronous).
``paged.plan (decode step, ops stubbed)``
    The same plans, timed between the stubbed forwards below: on CUDA a layer's
    arithmetic runs on the device, so the host's caches hold what the host touched; on
    CPU the plain row's forwards run the attention on the host first and evict them.
``*.forward, ops stubbed``
    The same call with the pool module's ``store_kv`` / ``paged_attention`` /
    ``attend`` replaced by stubs that return at once: the pool's own
    Python (argument checks, metadata checks, commit bookkeeping), independent of the
    device and of the kernels.
``*.forward triton, kernel stubbed (first layer: plans / other layers: read the plan)``
    The same call on the Triton backend (``AttentionSpec(backend="triton")``) with the
    jitted kernels' launches stubbed (``_paged_attn_kernel``, ``_split_reduce_kernel``,
    ``_store_kv_kernel``: ``kernel[grid](...)`` returns at once): the whole host side of a
    Triton layer (checks, route, store and attention launch preparation, the step's launch
    plan made by the step's first layer, read by the others), with no kernel run; on CPU
    it needs ``TRITON_INTERPRET=1`` (else skipped).
``*.forward triton, kernel stubbed, planned per layer``
    The same with the step's plan memo emptied before every layer
    (``meta.rows.launches``): what each layer paid when the launch plan was made per
    layer. Its gap to the row above is the plan's cost per layer, in the same run.
``paged_attention validated / attend trusted, impl stubbed``
    The public op with its implementation stubbed out: the cost of the wrapper with
    value checks (which read ``seq_lens`` etc.: on CPU tensors always, on CUDA only under
    ``KVARENA_DEBUG=1``), and of ``dispatch.attend`` with a ready ``AttentionSpec``, typed
    metadata and the call's route (what the pools call per layer).

The stubs are module-attribute patches restored on exit; if the names move, those rows
are reported as skipped rather than silently measuring something else.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable
from typing import Any

import torch

from kvarena.benchmark.runner import quantiles, sync

__all__ = ["run_overhead", "decode_pool", "rollout_pool", "BATCHES"]

BATCHES = (1, 64, 256)
_LAYERS, _H_Q, _H_KV, _D = 2, 4, 2, 64
_DTYPE = torch.bfloat16


def _row(what: str, batch: int, device, samples_s: list[float], note: str = "") -> dict[str, Any]:
    us = [1e6 * s for s in samples_s]
    med, p20, p80 = quantiles(us, (0.5, 0.2, 0.8))
    return {"what": what, "batch": batch, "device": str(device), "status": "ok", "us_median": med,
            "us_p20": p20, "us_p80": p80, "us_min": min(us), "n": len(us), "note": note}


def _skipped(what: str, batch: int, device, reason: str) -> dict[str, Any]:
    return {"what": what, "batch": batch, "device": str(device), "status": "skipped", "reason": reason}


def _reason(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"error: {type(exc).__name__}: {msg[0][:160] if msg else ''}"


def _time_call(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rnd(device):
    g = torch.Generator(device="cpu").manual_seed(0)
    return lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=_DTYPE)


def _stub_attention(q, *args, spec, **kwargs):
    if spec.return_lse:
        return q, q.new_zeros(q.shape[:2], dtype=torch.float32)
    return q


def _stub_store(*args):
    return None


@contextlib.contextmanager
def _patched(module: str, **stubs):
    """Replace ``module.<name>`` by the given stubs for the duration (names must exist)."""
    mod = importlib.import_module(module)
    missing = [n for n in stubs if not hasattr(mod, n)]
    if missing:
        raise AttributeError(f"{module} has no {missing} to stub (the pool's imports changed)")
    saved = {n: getattr(mod, n) for n in stubs}
    try:
        for n, f in stubs.items():
            setattr(mod, n, f)
        yield
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)


def _spec(backend: str):
    from kvarena.attention.spec import AttentionSpec

    return AttentionSpec(backend=backend)


class _NoLaunch:
    """A jitted kernel whose ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return _no_launch


def _no_launch(*args, **kwargs):
    return None


@contextlib.contextmanager
def _kernels_stubbed():
    """The attention, split-reduce and store kernels' launches stubbed (host cost only)."""
    with _patched("kvarena.kernels.paged_attention", _paged_attn_kernel=_NoLaunch()), \
            _patched("kvarena.kernels.split_reduce", _split_reduce_kernel=_NoLaunch()), \
            _patched("kvarena.kernels.store", _store_kv_kernel=_NoLaunch()):
        yield


def _triton_rows(kind: str, batch: int, device: torch.device, make, warm: int, reps: int) -> list[dict]:
    """The ``{kind}.forward triton, kernel stubbed`` rows. ``make()`` builds the pool (kernels
    stubbed) and returns ``step(layer_call)``, which plans one step and calls
    ``layer_call(layer, rows, call)`` for each layer (``rows``: the step's query rows, which
    hold its plans); ``call()`` runs that layer's forward."""
    what = f"{kind}.forward triton, kernel stubbed"
    first: list[float] = []
    rest: list[float] = []
    per_layer: list[float] = []

    def timed(into_first, into_rest, fresh: bool):
        def layer_call(layer, rows, call):
            if fresh:
                rows.launches.clear()  # the old rule: every layer plans
            dt = _time_call(call)
            (into_first if layer == 0 else into_rest).append(dt)
        return layer_call

    try:
        with _kernels_stubbed():
            step = make()
            for i in range(warm + reps):
                step(timed(first, rest, False) if i >= warm else (lambda layer, rows, call: call()))
    except Exception as exc:
        return [_skipped(what, batch, device, _reason(exc))]
    rows = [_row(f"{what} (first layer: plans)", batch, device, first, "plan once per step"),
            _row(f"{what} (other layers: read the plan)", batch, device, rest, "plan once per step")]
    try:
        with _kernels_stubbed():
            for i in range(warm + reps):
                step(timed(per_layer, per_layer, True) if i >= warm else (lambda layer, rows, call: call()))
        rows.append(_row(f"{what}, planned per layer", batch, device, per_layer,
                         "the step's plan memo emptied before every layer: the old per-layer plan"))
    except Exception as exc:
        rows.append(_skipped(f"{what}, planned per layer", batch, device, _reason(exc)))
    return rows


def _paged_triton(batch: int, device: torch.device, warm: int, reps: int) -> list[dict]:
    def make():
        pool, names, q, k, v = decode_pool(batch, device, extra_tokens=4 * (warm + reps) + 1, backend="triton")
        step_of = dict.fromkeys(names, 1)

        def step(layer_call):
            meta = pool.plan(step_of)
            for layer in range(_LAYERS):
                layer_call(layer, getattr(meta, "rows", None), lambda layer=layer: pool.forward(q, k, v, meta, layer))
            sync(device)
        return step

    return _triton_rows("paged", batch, device, make, warm, reps)


def _slab_triton(batch: int, device: torch.device, warm: int, reps: int) -> list[dict]:
    def make():
        pool, names, q, k, v, nxt = rollout_pool(batch, device, backend="triton")
        chunk = [nxt]

        def step(layer_call):
            meta = pool.plan(dict.fromkeys(names, chunk[0]))
            chunk[0] += 1
            for layer in range(_LAYERS):
                layer_call(layer, meta.seam.rows,
                           lambda layer=layer: pool.forward(q, k, v, meta, layer, commit=True))
            sync(device)
        return step

    return _triton_rows("slab", batch, device, make, warm, reps)


def _layout():
    from kvarena.cache.arena import KVLayout

    return KVLayout(_LAYERS, _H_KV, _D, _DTYPE)


def decode_pool(batch: int, device, *, extra_tokens: int = 64, backend: str = "auto"):
    """A tiny prefilled ``PagedKVCache`` for decode-step timing (its layers on ``backend``).

    Returns
    -------
    (pool, names, q, k, v)
        ``batch`` sequences of 16 prefilled tokens, room for ``extra_tokens`` more each;
        ``q [batch, 4, 64]``, ``k, v [batch, 2, 64]`` bf16 for one decode step.
    """
    from kvarena.cache.keys import CachePolicy
    from kvarena.cache.paged import PagedKVCache

    device = torch.device(device)
    lay = _layout()
    blocks_per_seq = -(-(16 + extra_tokens) // 16) + 1
    policy = CachePolicy("paged_kv", max_bytes=batch * blocks_per_seq * lay.block_bytes(16))
    pool = PagedKVCache(policy, layout=lay, block_size=16, device=device, attention=_spec(backend))
    names = [f"s{i}" for i in range(batch)]
    rnd = _rnd(device)
    # Prefill one page per sequence (untimed), so decode attends over 17+ keys.
    meta = pool.plan(dict.fromkeys(names, 16))
    qp, kp = rnd(batch * 16, _H_Q, _D), rnd(batch * 16, _H_KV, _D)
    for layer in range(_LAYERS):
        pool.forward(qp, kp, kp, meta, layer)
    return pool, names, rnd(batch, _H_Q, _D), rnd(batch, _H_KV, _D), rnd(batch, _H_KV, _D)


SLAB_CHUNK, SLAB_WINDOW, SLAB_SINKS = 16, 3, 1


def rollout_pool(batch: int, device, backend: str = "auto"):
    """A tiny ``SlabKVCache`` whose window is already full (chunks 0..3 committed), its layers
    on ``backend``.

    Returns
    -------
    (pool, names, q, k, v, next_chunk)
        ``q [batch, 16, 4, 64]``, ``k, v [batch, 16, 2, 64]`` bf16; ``next_chunk`` is the
        first chunk index whose plan recycles a slab.
    """
    from kvarena.cache.keys import CachePolicy
    from kvarena.cache.slab import SlabKVCache

    device = torch.device(device)
    lay = _layout()
    chunk, window, sinks = SLAB_CHUNK, SLAB_WINDOW, SLAB_SINKS
    policy = CachePolicy("slab_kv", max_bytes=batch * (sinks + window) * lay.block_bytes(chunk),
                         per_component={"window": window, "sinks": sinks})
    pool = SlabKVCache(policy, layout=lay, slab_tokens=chunk, device=device, attention=_spec(backend))
    names = [f"r{i}" for i in range(batch)]
    rnd = _rnd(device)
    q, k, v = rnd(batch, chunk, _H_Q, _D), rnd(batch, chunk, _H_KV, _D), rnd(batch, chunk, _H_KV, _D)
    for c in range(sinks + window):
        meta = pool.plan(dict.fromkeys(names, c))
        for layer in range(_LAYERS):
            pool.forward(q, k, v, meta, layer, commit=True)
    return pool, names, q, k, v, sinks + window


def _grouped_plans(batch: int, device: torch.device, warm: int, reps: int) -> list[float]:
    """Seconds per decode-step plan of a 6-group pool (the sliding groups releasing)."""
    from kvarena.attention.spec import AttentionSpec
    from kvarena.cache.arena import KVLayout, group_layers
    from kvarena.cache.keys import CachePolicy
    from kvarena.cache.paged import PagedKVCache

    windows = (31,) * 5 + (None,)
    lay = KVLayout(6, _H_KV, _D, _DTYPE, groups=group_layers(windows))
    steps = warm + reps
    blocks = batch * (6 * 3 + -(-(16 + steps) // 16) + 1)
    pool = PagedKVCache(CachePolicy("paged_kv", max_bytes=blocks * lay.block_bytes(16)), layout=lay, block_size=16,
                        device=device, attention=[AttentionSpec(window_left=w) for w in windows],
                        free_out_of_window=True)
    names = [f"s{i}" for i in range(batch)]
    pool.plan(dict.fromkeys(names, 16))
    step = dict.fromkeys(names, 1)
    out = []
    for i in range(steps):
        t0 = time.perf_counter()
        pool.plan(step)
        if i >= warm:
            out.append(time.perf_counter() - t0)
    return out


def _paged(batch: int, device: torch.device, warm: int, reps: int) -> list[dict]:
    from kvarena.attention import checks, dispatch, ops
    from kvarena.attention.batch import CacheView, KeySet, QueryRows
    from kvarena.attention.route import route

    steps = warm + reps
    pool, names, q, k, v = decode_pool(batch, device, extra_tokens=2 * steps + 1)
    step = dict.fromkeys(names, 1)
    meta = None

    def decode(t_plan, t_fwd):
        nonlocal meta
        for i in range(steps):
            t0 = time.perf_counter()
            meta = pool.plan(step)
            dt = time.perf_counter() - t0
            if i >= warm and t_plan is not None:
                t_plan.append(dt)
            for layer in range(_LAYERS):
                dt = _time_call(lambda layer=layer, meta=meta: pool.forward(q, k, v, meta, layer))
                if i >= warm:
                    t_fwd.append(dt)
            sync(device)

    t_plan, t_fwd, t_stub = [], [], []
    decode(t_plan, t_fwd)
    rows = [
        _row("paged.plan (decode step)", batch, device, t_plan, "once per step, all layers"),
        _row("paged.plan (6 layer groups, release)", batch, device, _grouped_plans(batch, device, warm, reps),
             "Gemma-3-like: 5 sliding (window 32) + 1 full"),
        _row("paged.forward (per layer)", batch, device, t_fwd,
             f"store + attend, up to {pool.seq_len(names[0])} keys/seq"),
    ]
    t_plan_host = []
    try:
        with _patched("kvarena.cache.paged.local", store=_stub_store, attend=_stub_attention):
            decode(t_plan_host, t_stub)
        rows.append(_row("paged.forward, ops stubbed", batch, device, t_stub, "the pool's own Python"))
        rows.append(_row("paged.plan (decode step, ops stubbed)", batch, device, t_plan_host,
                         "between the stubbed forwards: no attention arithmetic on this host"))
    except Exception as exc:
        rows.append(_skipped("paged.forward, ops stubbed", batch, device, _reason(exc)))

    region = next(iter(pool.arena.regions.values()))
    args = (q, region.k(0), region.v(0), meta.block_table, meta.seq_lens, meta.cu_seqlens_q)
    kw = dict(max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k)
    spec = pool.attention_spec(0)
    call = route(spec.backend, q.device, q.dtype)  # what a pool hands attend, made before its store
    seam = (CacheView(region.k(0), region.v(0)), KeySet(meta.block_table, meta.seq_lens, meta.max_seqlen_k),
            QueryRows(meta.cu_seqlens_q, meta.max_seqlen_q))
    t_val, t_tr = [], []
    try:
        with _patched("kvarena.attention.dispatch", run_attention=lambda q, *a: (q, None),
                      launch_triton=lambda *a, **k: None):
            for i in range(steps):
                dt_v = _time_call(lambda: ops.paged_attention(*args, **kw))
                dt_t = _time_call(lambda: dispatch.attend(q, *seam, spec=spec, route=call))
                if i >= warm:
                    t_val.append(dt_v)
                    t_tr.append(dt_t)
        checks = "value checks on" if device.type == "cpu" or checks.debug_enabled() else "no value checks (CUDA)"
        rows.append(_row("paged_attention validated, impl stubbed", batch, device, t_val, checks))
        rows.append(_row("attend trusted, impl stubbed", batch, device, t_tr, "what the pools call"))
    except Exception as exc:
        rows.append(_skipped("paged_attention wrapper", batch, device, _reason(exc)))
    return rows


def _slab(batch: int, device: torch.device, warm: int, reps: int) -> list[dict]:
    pool, names, q, k, v, nxt = rollout_pool(batch, device)
    chunk, window, sinks = SLAB_CHUNK, SLAB_WINDOW, SLAB_SINKS

    def rollout(n_chunks, t_plan, t_fwd, timed_from):
        nonlocal nxt
        for i in range(n_chunks):
            c = nxt
            nxt += 1
            t0 = time.perf_counter()
            meta = pool.plan(dict.fromkeys(names, c))
            dt = time.perf_counter() - t0
            if i >= timed_from and t_plan is not None:
                t_plan.append(dt)
            for layer in range(_LAYERS):
                dt = _time_call(lambda layer=layer, meta=meta: pool.forward(q, k, v, meta, layer, commit=True))
                if i >= timed_from:
                    t_fwd.append(dt)
            sync(device)

    t_plan, t_fwd, t_stub = [], [], []
    # The window is already full: every timed plan recycles a slab in place.
    rollout(warm + reps, t_plan, t_fwd, warm)
    rows = [
        _row("slab.plan (new chunk)", batch, device, t_plan,
             f"chunk {chunk}, window {window}, sinks {sinks}; recycles a slab"),
        _row("slab.forward commit (per layer)", batch, device, t_fwd,
             f"store + attend {(sinks + window) * chunk} keys"),
    ]
    try:
        with _patched("kvarena.cache.slab.local", store=_stub_store, attend=_stub_attention):
            rollout(warm + reps, None, t_stub, warm)
        rows.append(_row("slab.forward commit, ops stubbed", batch, device, t_stub, "the pool's own Python"))
    except Exception as exc:
        rows.append(_skipped("slab.forward commit, ops stubbed", batch, device, _reason(exc)))
    return rows


def run_overhead(device: str | torch.device = "cpu", *, batches=BATCHES, warm: int = 3,
                 reps: int = 20, deadline: float = float("inf")) -> list[dict[str, Any]]:
    """Host cost per call of the pools and of the public op, at each batch size.

    Parameters
    ----------
    device : where the pools live.
    batches : sequences (paged) / rollouts (slab) per step.
    warm, reps : untimed then timed steps.
    deadline : ``time.monotonic()`` past which the remaining rows are skipped.

    Returns
    -------
    list of dict
        Rows ``what, batch, device, us_median, us_p20, us_p80, us_min, n, note`` (or
        ``status`` "skipped" with a ``reason``).
    """
    device = torch.device(device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # One thread: on tiny tensors intra-op threads only add wake-up jitter (measured
        # here on 2 shared cores: 0.9 ms calls turning into 5-60 ms with 2 threads).
        torch.set_num_threads(1)
    try:
        rows: list[dict[str, Any]] = []
        for batch in batches:
            for name, fn in (("paged", _paged), ("paged.triton", _paged_triton), ("slab", _slab),
                             ("slab.triton", _slab_triton)):
                if time.monotonic() > deadline:
                    rows.append(_skipped(f"{name}.*", batch, device, "time budget exhausted"))
                    continue
                try:
                    rows += fn(batch, device, warm, reps)
                except Exception as exc:  # a pool not built yet, an API change: report, go on
                    rows.append(_skipped(f"{name}.*", batch, device, _reason(exc)))
        return rows
    finally:
        torch.set_num_threads(threads)
