"""A small Wan-like causal video DiT run as a Self-Forcing-style rollout over kvarena.

The model's self-attention gets its K/V through :mod:`kvarena.integrations.causal_wan`,
as Self-Forcing's blocks get their ``kv_cache`` dicts: each block calls
``kv_cache[layer](q, k, v, current_start)``. Sinks and the window are counted in frames
(Self-Forcing's ``sink_size`` / ``local_attn_size``), not whole chunks: with 2-frame chunks
after a 1-frame first chunk (image-to-video), a 2-frame sink and a 5-frame window, what a
chunk sees is not a union of whole chunks. Each chunk is denoised in a few steps that
attend to the cached history plus the chunk's own K/V without writing anything (a
``clean=False`` step), then a clean pass at timestep 0 commits the chunk's K/V into its
slab: sink slabs are kept forever and a slab no later chunk can see is overwritten in
place. Two rollouts x two CFG branches run as four namespaces in one batch; text K/V come from a :class:`FeatureCache` keyed by prompt
content and weights version; a DBCache-style residual reuse across denoising steps is kept
per request and branch in a :class:`ResidualCache`.

``run_causal_dit`` checks every pass against a dense recomputation of the whole video so
far with the explicit token mask (a query of the chunk ending at ``e`` sees ``t < e`` with
``t < S`` or ``t >= e - W``): each history chunk then attends to exactly the keys it saw when
it was committed, so the current chunk's output must match. The model and that dense
reference are :mod:`kvarena.examples.dit_model`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvarena.cache.feature import FeatureCache
from kvarena.cache.keys import CacheKey, CachePolicy, content_hash
from kvarena.cache.residual import ResidualCache
from kvarena.cache.slab import SlabKVCache
from kvarena.examples.dit_model import DiTConfig, TinyCausalDiT, dense_forward, sink_window_mask
from kvarena.integrations.causal_wan import CausalKVCache


@dataclass
class RolloutReport:
    chunks: int = 0
    passes: int = 0
    tokens: int = 0
    max_err: float = 0.0
    checked_passes: int = 0
    skipped_layer_evals: int = 0
    arena_reserved_bytes: int = 0
    arena_used_bytes: int = 0
    arena_used_bytes_after_window: list | None = None
    arena_ptr_stable: bool = True
    retained_bytes_moved: int = 0
    text_cache_hits: int = 0
    text_cache_misses: int = 0
    wall_s: float = 0.0
    visibility: str = ""


def _causal_kv(cfg: DiTConfig, dtype, device, rollouts: int, sink_frames: int, window_frames: int,
               backend: str) -> CausalKVCache:
    """The model's K/V: slabs for ``rollouts`` namespaces, sinks and window in frames."""
    return CausalKVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_heads, head_dim=cfg.head_dim,
                         frame_tokens=cfg.frame_tokens, frames_per_chunk=cfg.frames_per_chunk,
                         sink_frames=sink_frames, window_frames=window_frames, max_rollouts=rollouts,
                         dtype=dtype, device=device, backend=backend)


@torch.no_grad()
def run_causal_dit(
    *,
    num_chunks: int = 6,
    rollouts: int = 2,
    steps: int = 4,
    sink_frames: int = 2,
    window_frames: int = 5,
    cfg_scale: float = 3.0,
    residual_threshold: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    seed: int = 0,
    check: bool = True,
    progress=None,
) -> RolloutReport:
    """Generate ``num_chunks`` chunks for ``rollouts`` videos x {cond, uncond}.

    ``sink_frames`` / ``window_frames``: frames kept forever / frames a chunk attends back
    from its end (its own included).

    ``residual_threshold`` > 0 turns on DBCache-style reuse: at a denoising step whose
    first-layer residual moved less than that (relative) since the previous step, the
    remaining layers are skipped and their cached residual is added instead (never on the
    commit pass, which must write every layer's K/V). Passes that skipped layers are not
    compared with the dense reference (reuse is an approximation by design).
    """
    torch.manual_seed(seed)
    cfg = DiTConfig()
    model = TinyCausalDiT(cfg).to(device=device, dtype=dtype).eval()
    namespaces = [f"video{r}/{br}" for r in range(rollouts) for br in ("cond", "uncond")]
    kv = _causal_kv(cfg, dtype, device, len(namespaces), sink_frames, window_frames, backend)
    pool = kv.pool
    features = FeatureCache(CachePolicy("feature", max_bytes=1 << 24))
    report = RolloutReport(arena_reserved_bytes=pool.arena.reserved_bytes, visibility=(
        f"sinks {sink_frames} + window {window_frames} frames ({pool.sink_tokens} + {pool.window_tokens} tokens)"))
    report.arena_used_bytes_after_window = []

    gen = torch.Generator().manual_seed(seed + 1)
    prompts = {r: torch.randint(1, cfg.vocab, (cfg.text_len,), generator=gen) for r in range(rollouts)}
    opts = _RolloutOptions(rollouts=rollouts, steps=steps, sink_frames=sink_frames, window_frames=window_frames,
                           cfg_scale=cfg_scale, residual_threshold=residual_threshold, dtype=dtype, device=device,
                           check=check)
    roll = _Rollout(model, kv, features, report, namespaces, gen, prompts, opts)
    t0 = time.perf_counter()
    for c in range(num_chunks):
        roll.chunk(c)
        if progress is not None:
            progress(c + 1, num_chunks)
    report.wall_s = time.perf_counter() - t0
    st = features.stats()
    report.text_cache_hits, report.text_cache_misses = st["hits"], st["misses"]
    kv.reset()
    return report


@dataclass(frozen=True)
class _RolloutOptions:
    """The options of one :func:`run_causal_dit` that its chunks read."""

    rollouts: int
    steps: int
    sink_frames: int
    window_frames: int
    cfg_scale: float
    residual_threshold: float
    dtype: torch.dtype
    device: object  # str or torch.device
    check: bool


class _Rollout:
    """The state of one :func:`run_causal_dit` across chunks: the model, its caches, the
    report, and every stream's committed latents (for the dense check)."""

    def __init__(self, model: TinyCausalDiT, kv: CausalKVCache, features: FeatureCache, report: RolloutReport,
                 namespaces: list, gen: torch.Generator, prompts: dict, opts: _RolloutOptions) -> None:
        self.model, self.kv, self.features, self.report = model, kv, features, report
        self.namespaces, self.gen, self.prompts, self.opts = namespaces, gen, prompts, opts
        self.residuals = ResidualCache(CachePolicy("residual", max_bytes=1 << 24))
        self.null_prompt = torch.zeros(model.cfg.text_len, dtype=torch.long)
        self.clean: dict[str, list[torch.Tensor]] = {ns: [] for ns in namespaces}  # committed latents (dense check)
        self.arena_ptr = None

    def _text_for(self, ns: str):
        r, br = int(ns.split("/")[0][5:]), ns.split("/")[1]
        prompt = self.prompts[r] if br == "cond" else self.null_prompt
        key = CacheKey("dit.text_kv", content_hash(prompt), weights_version="dit-v1")
        return self.features.get_or_compute(key, lambda: self.model.text_kv(prompt.to(self.opts.device)))

    def _randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(device=self.opts.device, dtype=self.opts.dtype)

    def chunk(self, c: int) -> None:
        """Chunk ``c`` of every stream: its denoising steps, then the pass that commits it."""
        cfg, pool, report, o = self.model.cfg, self.kv.pool, self.report, self.opts
        t_len, start = cfg.chunk_len(c), cfg.chunk_start(c)
        before = _retained_state(pool, self.namespaces)
        ptr = pool.arena.data_ptr()
        self.arena_ptr = ptr if self.arena_ptr is None else self.arena_ptr
        report.arena_ptr_stable &= ptr == self.arena_ptr
        texts = [self._text_for(ns) for ns in self.namespaces]
        text = tuple(
            (torch.stack([t[layer][0] for t in texts]), torch.stack([t[layer][1] for t in texts]))
            for layer in range(cfg.num_layers)
        )
        pos = (cfg.chunk_start(c) + torch.arange(t_len, device=o.device))[None].expand(len(self.namespaces), -1)
        x = self._denoise(c, self._randn(o.rollouts, t_len, cfg.channels), pos, text)
        self._commit(c, x, pos, text)
        report.retained_bytes_moved += _retained_moved(before, _retained_state(pool, self.namespaces))
        report.chunks += 1
        report.tokens += t_len * len(self.namespaces)
        report.arena_used_bytes = max(report.arena_used_bytes, self.kv.used_bytes)
        if start >= (o.sink_frames + o.window_frames) * cfg.frame_tokens:  # the window has moved past the sinks
            report.arena_used_bytes_after_window.append(self.kv.used_bytes)

    def _check(self, c: int, xb, sig, text, pred) -> None:
        self.report.max_err = max(self.report.max_err, _dense_check(
            self.model, self.clean, self.namespaces, c, xb, sig, text, pred, self.opts.sink_frames,
            self.opts.window_frames))
        self.report.checked_passes += 1

    def _denoise(self, c: int, x: torch.Tensor, pos, text) -> torch.Tensor:
        """The chunk's denoising steps (``clean=False``: nothing written); the denoised latents."""
        o, report, start = self.opts, self.report, self.model.cfg.chunk_start(c)
        sigmas = [1.0 - i / o.steps for i in range(o.steps)]
        with contextlib.ExitStack() as stack:
            for r in range(o.rollouts):  # residuals live for this chunk's denoising steps only
                stack.enter_context(self.residuals.scope(f"video{r}"))
            for i, sigma in enumerate(sigmas):
                xb = x.repeat_interleave(2, dim=0)  # [B=rollouts*2, T, C]: cond, uncond per video
                sig = torch.full(xb.shape[:2], sigma, device=o.device, dtype=o.dtype)
                with self.kv.step(self.namespaces, clean=False) as layers:
                    velocity, skipped = _forward_pass(
                        self.model, layers, start, xb, sig, pos, text,
                        residuals=self.residuals if o.residual_threshold > 0 else None, namespaces=self.namespaces,
                        threshold=o.residual_threshold,
                    )
                report.passes += 1
                report.skipped_layer_evals += skipped
                if o.check and not skipped:
                    self._check(c, xb, sig, text, velocity)
                v = velocity[0::2] + o.cfg_scale * (velocity[0::2] - velocity[1::2])
                x0 = x - sigma * v
                nxt = sigmas[i + 1] if i + 1 < o.steps else 0.0
                fresh = self._randn(*x.shape)
                x = x0 if nxt == 0.0 else (1 - nxt) * x0 + nxt * fresh
        return x

    def _commit(self, c: int, x: torch.Tensor, pos, text) -> None:
        """The clean pass: timestep 0, commits every layer's K/V into the chunk's slab."""
        o = self.opts
        xb = x.repeat_interleave(2, dim=0)
        sig = torch.zeros(xb.shape[:2], device=o.device, dtype=o.dtype)
        with self.kv.step(self.namespaces, clean=True) as layers:
            out, _ = _forward_pass(self.model, layers, self.model.cfg.chunk_start(c), xb, sig, pos, text,
                                   residuals=None, namespaces=self.namespaces, threshold=0.0)
        self.report.passes += 1
        if o.check:
            self._check(c, xb, sig, text, out)
        for j, ns in enumerate(self.namespaces):
            self.clean[ns].append(xb[j])


@dataclass
class TrainStepReport:
    loss: float = 0.0
    dense_loss: float = 0.0
    max_grad_rel_err: float = 0.0  # worst parameter tensor: ||g - g_dense|| / ||g_dense||
    params_with_grad: int = 0
    history_chunks: int = 0


def run_training_step(
    *,
    history_chunks: int = 4,
    sink_frames: int = 2,
    window_frames: int = 5,
    sigma: float = 0.6,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    seed: int = 0,
) -> TrainStepReport:
    """One Self-Forcing-style training step through the slab pool.

    The history (``history_chunks`` chunks, the first one short) is rolled out under
    ``no_grad`` and committed; the next chunk's denoising step runs with gradients
    (``commit=False``: the step's own k/v are given, the history is read from the arena)
    and a flow-matching loss is backpropagated to the parameters. The same model run
    densely over the whole sequence with the sink + window mask and the history's K/V
    detached must give the same parameter gradients. ``backend="triton"`` runs the Triton
    forward and backward (the interpreter on CPU).
    """
    torch.manual_seed(seed)
    cfg = DiTConfig()
    model = TinyCausalDiT(cfg).to(device=device, dtype=dtype)
    kv = _causal_kv(cfg, dtype, device, 1, sink_frames, window_frames, backend)
    ns = "video0"
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(1, cfg.vocab, (cfg.text_len,), generator=gen).to(device)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def positions(c: int) -> torch.Tensor:
        return (cfg.chunk_start(c) + torch.arange(cfg.chunk_len(c), device=device))[None]

    def text_rows(text):
        return tuple((k[None], v[None]) for k, v in text)

    history = []
    with torch.no_grad():  # the rollout that produced the history: constants to the step
        text = text_rows(model.text_kv(prompt))
        for c in range(history_chunks):
            x = rand(1, cfg.chunk_len(c), cfg.channels)
            sig = torch.zeros(x.shape[:2], device=device, dtype=dtype)
            with kv.step([ns], clean=True) as layers:
                _forward_pass(model, layers, cfg.chunk_start(c), x, sig, positions(c), text, residuals=None,
                              namespaces=[ns], threshold=0.0)
            history.append(x[0])
    c = history_chunks
    t_len = cfg.chunk_len(c)
    x0, noise = rand(1, t_len, cfg.channels), rand(1, t_len, cfg.channels)
    xt = (1 - sigma) * x0 + sigma * noise
    target = noise - x0  # flow-matching velocity
    sig = torch.full(xt.shape[:2], sigma, device=device, dtype=dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    text = text_rows(model.text_kv(prompt))
    with kv.step([ns], clean=False) as layers:
        pred, _ = _forward_pass(model, layers, cfg.chunk_start(c), xt, sig, positions(c), text, residuals=None,
                                namespaces=[ns], threshold=0.0)
    loss = F.mse_loss(pred.float(), target.float())
    grads = torch.autograd.grad(loss, params, allow_unused=True)

    n_hist = sum(h.shape[0] for h in history)
    seq = torch.cat([*history, xt[0]])[None]
    sig_seq = torch.cat([torch.zeros(n_hist, device=device, dtype=dtype), sig[0]])[None]
    mask = sink_window_mask(cfg, c + 1, sink_frames, window_frames, device)
    text = text_rows(model.text_kv(prompt))  # a fresh graph for the dense run
    dense = dense_forward(model, seq, sig_seq, text, mask, detach_keys_before=n_hist)[:, n_hist:]
    dense_loss = F.mse_loss(dense.float(), target.float())
    dense_grads = torch.autograd.grad(dense_loss, params, allow_unused=True)
    rep = TrainStepReport(loss=float(loss.detach()), dense_loss=float(dense_loss.detach()),
                          history_chunks=history_chunks)
    for g, r in zip(grads, dense_grads):
        if r is None and g is None:
            continue
        if g is None or r is None:
            rep.max_grad_rel_err = float("inf")  # a parameter that only one run reaches
            continue
        rep.params_with_grad += 1
        err = float((g.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30))
        rep.max_grad_rel_err = max(rep.max_grad_rel_err, err)
    kv.reset()
    return rep


def _retained_state(kv: SlabKVCache, namespaces) -> dict:
    """(namespace, chunk) -> (address of its K view, copy of its K and V) for every kept slab."""
    state = {}
    for ns in namespaces:
        for slab in kv.get(ns):
            state[(ns, slab.chunk_index)] = (slab.k.data_ptr(), slab.k.clone(), slab.v.clone())
    return state


def _retained_moved(before: dict, after: dict) -> int:
    """Bytes of slabs kept across a chunk step whose address or content changed (the ring: 0;
    a shift-left window moves every retained token each chunk)."""
    moved = 0
    for key, (ptr, k, v) in before.items():
        if key not in after:
            continue  # evicted by the recycle: its slot now holds the new chunk
        ptr2, k2, v2 = after[key]
        if ptr2 != ptr or not (torch.equal(k, k2) and torch.equal(v, v2)):
            moved += k.nbytes + v.nbytes
    return moved


def _forward_pass(model, layers, current_start, xb, sig, pos, text, *, residuals, namespaces, threshold):
    """One model pass over the batch; returns (prediction ``[B, T, C]``, layers skipped).

    ``layers``: the step's per-layer K/V (a :class:`~kvarena.integrations.causal_wan.CausalStep`),
    what a Self-Forcing model receives as its list of ``kv_cache`` dicts.
    """
    h, temb = model.embed(xb, sig)

    def attn(layer, q, k, v):
        return layers[layer](q, k, v, current_start=current_start)

    h0 = h
    h = model.block(0, h, temb, pos, text, attn)
    n_rest = model.cfg.num_layers - 1
    if residuals is not None and n_rest > 0:
        first = h - h0
        prev_first = [residuals.get(ns.split("/")[0], ns.split("/")[1], "first") for ns in namespaces]
        prev_tail = [residuals.get(ns.split("/")[0], ns.split("/")[1], "tail") for ns in namespaces]
        if all(p is not None for p in prev_first + prev_tail):
            pf = torch.stack(prev_first)
            change = ((first - pf).flatten(1).norm(dim=1) / pf.flatten(1).norm(dim=1).clamp_min(1e-12)).max()
            if float(change) < threshold:  # host decision once per pass, not per layer
                return model.head(h + torch.stack(prev_tail)), n_rest
        h1 = h
        for layer in range(1, model.cfg.num_layers):
            h = model.block(layer, h, temb, pos, text, attn)
        for j, ns in enumerate(namespaces):
            req, br = ns.split("/")
            residuals.put(req, br, "first", first[j])
            residuals.put(req, br, "tail", (h - h1)[j])
        return model.head(h), 0
    for layer in range(1, model.cfg.num_layers):
        h = model.block(layer, h, temb, pos, text, attn)
    return model.head(h), 0


def _dense_check(model, clean, namespaces, c, xb, sig, text, pred, sink_frames, window_frames) -> float:
    """Max abs error of ``pred`` (the cached pass) vs the dense masked recomputation."""
    cfg = model.cfg
    mask = sink_window_mask(cfg, c + 1, sink_frames, window_frames, xb.device)
    worst = 0.0
    for j, ns in enumerate(namespaces):
        hist = clean[ns]
        seq = torch.cat([*hist, xb[j]])[None]
        sigma = torch.cat([torch.zeros(sum(h.shape[0] for h in hist), device=xb.device, dtype=xb.dtype), sig[j]])[None]
        row_text = tuple((tk[j:j + 1], tv[j:j + 1]) for tk, tv in text)
        ref = dense_forward(model, seq, sigma, row_text, mask)[0, -xb.shape[1]:]
        worst = max(worst, (ref.float() - pred[j].float()).abs().max().item())
    return worst


def summary(report: RolloutReport) -> str:
    """A few readable lines about a :func:`run_causal_dit` run (what the examples print)."""
    after = report.arena_used_bytes_after_window or []
    flat = "the window never filled" if not after else \
        ("flat after the window" if len(set(after)) == 1 else f"NOT flat after the window: {after}")
    return "\n".join([
        f"{report.chunks} chunks, {report.passes} passes, {report.tokens} tokens in {report.wall_s:.2f} s "
        f"({report.visibility})",
        f"max error vs dense {report.max_err:.2e} over {report.checked_passes} checked passes "
        f"({report.skipped_layer_evals} layer evaluations reused residuals)",
        f"arena: {report.arena_used_bytes} of {report.arena_reserved_bytes} bytes used at peak, {flat}; retained KV bytes moved: {report.retained_bytes_moved}; arena address stable: "
        f"{report.arena_ptr_stable}",
        f"text K/V cache: {report.text_cache_hits} hits, {report.text_cache_misses} misses",
    ])


if __name__ == "__main__":  # pragma: no cover
    print(summary(run_causal_dit()))
