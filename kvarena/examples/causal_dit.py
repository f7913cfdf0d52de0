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
it was committed, so the current chunk's output must match.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvarena.cache.feature import FeatureCache
from kvarena.cache.keys import CacheKey, CachePolicy, content_hash
from kvarena.cache.residual import ResidualCache
from kvarena.cache.slab import SlabKVCache
from kvarena.examples.common import apply_rope, rms_norm, rope_tables
from kvarena.integrations.causal_wan import CausalKVCache


@dataclass(frozen=True)
class DiTConfig:
    channels: int = 8  # latent channels per token
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 16
    ffn: int = 128
    text_len: int = 7
    vocab: int = 50
    frame_tokens: int = 6
    frames_per_chunk: int = 2
    first_chunk_frames: int = 1  # image-to-video style short first chunk
    rope_base: float = 10000.0

    @property
    def chunk_tokens(self) -> int:
        return self.frame_tokens * self.frames_per_chunk

    def chunk_len(self, c: int) -> int:
        return self.frame_tokens * (self.first_chunk_frames if c == 0 else self.frames_per_chunk)

    def chunk_start(self, c: int) -> int:
        """Global position of chunk c's first token (RoPE and the dense check use it)."""
        return 0 if c == 0 else self.chunk_len(0) + (c - 1) * self.chunk_tokens


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    ang = t.float()[..., None] * 1000.0 * freqs
    return torch.cat((ang.cos(), ang.sin()), dim=-1)


class TinyCausalDiT(nn.Module):
    """adaLN blocks of self-attention (RoPE before caching), text cross-attention and FFN."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        c = cfg
        self.cfg = cfg
        hd = c.num_heads * c.head_dim
        self.patch_in = nn.Linear(c.channels, c.dim)
        self.patch_out = nn.Linear(c.dim, c.channels)
        self.t_mlp = nn.Sequential(nn.Linear(c.dim, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.ada = nn.ModuleList(nn.Linear(c.dim, 6 * c.dim) for _ in range(c.num_layers))
        self.qkv = nn.ModuleList(nn.Linear(c.dim, 3 * hd) for _ in range(c.num_layers))
        self.proj = nn.ModuleList(nn.Linear(hd, c.dim) for _ in range(c.num_layers))
        self.cross_q = nn.ModuleList(nn.Linear(c.dim, hd) for _ in range(c.num_layers))
        self.cross_kv = nn.ModuleList(nn.Linear(c.dim, 2 * hd) for _ in range(c.num_layers))
        self.cross_o = nn.ModuleList(nn.Linear(hd, c.dim) for _ in range(c.num_layers))
        self.ffn = nn.ModuleList(
            nn.Sequential(nn.Linear(c.dim, c.ffn), nn.GELU(), nn.Linear(c.ffn, c.dim)) for _ in range(c.num_layers)
        )
        self.text_embed = nn.Embedding(c.vocab, c.dim)
        self.text_mlp = nn.Sequential(nn.Linear(c.dim, c.dim), nn.GELU(), nn.Linear(c.dim, c.dim))
        for m in self.ada:  # small modulation, as adaLN-zero-like init keeps activations tame
            nn.init.normal_(m.weight, std=0.02)

    # -- text encoder + per-layer text K/V (what FeatureCache stores) ---------------------
    def text_kv(self, prompt: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """prompt ids ``[text_len]`` -> per layer (k, v), each ``[text_len, H, D]``."""
        c = self.cfg
        e = self.text_mlp(self.text_embed(prompt))
        out = []
        for layer in range(c.num_layers):
            k, v = self.cross_kv[layer](e).view(-1, 2, c.num_heads, c.head_dim).unbind(1)
            out.append((k, v))
        return tuple(out)

    # -- one layer, split so that DBCache can stop after the first block -----------------
    def block(self, layer: int, h: torch.Tensor, temb: torch.Tensor, pos: torch.Tensor, text, attn_fn) -> torch.Tensor:
        """h ``[B, T, dim]``, temb ``[B, T, dim]``, pos ``[B, T]``, text: per-row (k, v) ``[B, S, H, D]``."""
        c = self.cfg
        b, t, _ = h.shape
        sh1, sc1, g1, sh2, sc2, g2 = self.ada[layer](temb).chunk(6, dim=-1)
        x = rms_norm(h) * (1 + sc1) + sh1
        q, k, v = self.qkv[layer](x).view(b, t, 3, c.num_heads, c.head_dim).unbind(2)
        cos, sin = rope_tables(pos.reshape(-1), c.head_dim, c.rope_base)
        q = apply_rope(q.reshape(b * t, c.num_heads, c.head_dim), cos, sin).view(b, t, c.num_heads, c.head_dim)
        k = apply_rope(k.reshape(b * t, c.num_heads, c.head_dim), cos, sin).view(b, t, c.num_heads, c.head_dim)
        o = attn_fn(layer, q, k, v)  # [B, T, H, D]
        h = h + g1 * self.proj[layer](o.reshape(b, t, -1))
        # text cross-attention (full, no mask)
        tq = self.cross_q[layer](rms_norm(h)).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        tk, tv = text[layer]
        co = F.scaled_dot_product_attention(tq, tk.transpose(1, 2), tv.transpose(1, 2))
        h = h + self.cross_o[layer](co.transpose(1, 2).reshape(b, t, -1))
        x = rms_norm(h) * (1 + sc2) + sh2
        return h + g2 * self.ffn[layer](x)

    def embed(self, x: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[B, T, C]``, sigma ``[B, T]`` -> (h, temb), both ``[B, T, dim]``."""
        temb = _timestep_embedding(sigma, self.cfg.dim).to(x.dtype)
        return self.patch_in(x), self.t_mlp(temb)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.patch_out(rms_norm(h))


# --- dense reference ------------------------------------------------------------------


def sink_window_mask(cfg: DiTConfig, n_chunks: int, sink_frames: int, window_frames: int, device) -> torch.Tensor:
    """Boolean ``[N, N]`` over the tokens of chunks ``0..n_chunks-1``: a query of the chunk
    ending at token ``e`` sees key ``t`` iff ``t < e`` and (``t < S`` or ``t >= e - W``), with
    ``S``, ``W`` the sink and window frames in tokens."""
    s, w = sink_frames * cfg.frame_tokens, window_frames * cfg.frame_tokens
    ends = torch.cat([torch.full((cfg.chunk_len(c),), cfg.chunk_start(c) + cfg.chunk_len(c), device=device)
                      for c in range(n_chunks)])
    e, t = ends[:, None], torch.arange(ends.shape[0], device=device)[None, :]
    return (t < e) & ((t < s) | (t >= e - w))


def dense_forward(model: TinyCausalDiT, x: torch.Tensor, sigma: torch.Tensor, text, mask: torch.Tensor,
                  *, detach_keys_before: int = 0) -> torch.Tensor:
    """The whole sequence ``x [1, N, C]`` through every layer with masked SDPA -> ``[1, N, C]``.

    ``detach_keys_before``: the K/V of tokens before it are constants to autograd (what a
    cached history is to a training step: computed earlier, under no_grad).
    """
    c = model.cfg
    n = x.shape[1]
    pos = torch.arange(n, device=x.device)[None]
    h, temb = model.embed(x, sigma)
    cut = detach_keys_before

    def attn(layer, q, k, v):
        if cut:
            k = torch.cat([k[:, :cut].detach(), k[:, cut:]], 1)
            v = torch.cat([v[:, :cut].detach(), v[:, cut:]], 1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double(), attn_mask=mask
        )
        return o.transpose(1, 2).to(q.dtype)

    for layer in range(c.num_layers):
        h = model.block(layer, h, temb, pos, text, attn)
    return model.head(h)


# --- the rollout ----------------------------------------------------------------------


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
    residuals = ResidualCache(CachePolicy("residual", max_bytes=1 << 24))
    report = RolloutReport(arena_reserved_bytes=pool.arena.reserved_bytes, visibility=(
        f"sinks {sink_frames} + window {window_frames} frames ({pool.sink_tokens} + {pool.window_tokens} tokens)"))
    report.arena_used_bytes_after_window = []

    gen = torch.Generator().manual_seed(seed + 1)
    prompts = {r: torch.randint(1, cfg.vocab, (cfg.text_len,), generator=gen) for r in range(rollouts)}
    null_prompt = torch.zeros(cfg.text_len, dtype=torch.long)

    def text_for(ns: str):
        r, br = int(ns.split("/")[0][5:]), ns.split("/")[1]
        prompt = prompts[r] if br == "cond" else null_prompt
        key = CacheKey("dit.text_kv", content_hash(prompt), weights_version="dit-v1")
        return features.get_or_compute(key, lambda: model.text_kv(prompt.to(device)))

    clean: dict[str, list[torch.Tensor]] = {ns: [] for ns in namespaces}  # committed latents (dense check)
    arena_ptr = None
    t0 = time.perf_counter()
    for c in range(num_chunks):
        t_len, start = cfg.chunk_len(c), cfg.chunk_start(c)
        before = _retained_state(pool, namespaces)
        ptr = pool.arena.data_ptr()
        arena_ptr = ptr if arena_ptr is None else arena_ptr
        report.arena_ptr_stable &= ptr == arena_ptr
        texts = [text_for(ns) for ns in namespaces]
        text = tuple(
            (torch.stack([t[layer][0] for t in texts]), torch.stack([t[layer][1] for t in texts]))
            for layer in range(cfg.num_layers)
        )
        pos = (cfg.chunk_start(c) + torch.arange(t_len, device=device))[None].expand(len(namespaces), -1)
        noise = torch.randn(rollouts, t_len, cfg.channels, generator=gen).to(device=device, dtype=dtype)
        x = noise
        sigmas = [1.0 - i / steps for i in range(steps)]
        with contextlib.ExitStack() as stack:
            for r in range(rollouts):  # residuals live for this chunk's denoising steps only
                stack.enter_context(residuals.scope(f"video{r}"))
            for i, sigma in enumerate(sigmas):
                xb = x.repeat_interleave(2, dim=0)  # [B=rollouts*2, T, C]: cond, uncond per video
                sig = torch.full(xb.shape[:2], sigma, device=device, dtype=dtype)
                with kv.step(namespaces, clean=False) as layers:
                    velocity, skipped = _forward_pass(
                        model, layers, start, xb, sig, pos, text,
                        residuals=residuals if residual_threshold > 0 else None, namespaces=namespaces,
                        threshold=residual_threshold,
                    )
                report.passes += 1
                report.skipped_layer_evals += skipped
                if check and not skipped:
                    report.max_err = max(report.max_err, _dense_check(model, clean, namespaces, c, xb, sig, text, velocity,
                                                                      sink_frames, window_frames))
                    report.checked_passes += 1
                v = velocity[0::2] + cfg_scale * (velocity[0::2] - velocity[1::2])
                x0 = x - sigma * v
                nxt = sigmas[i + 1] if i + 1 < steps else 0.0
                fresh = torch.randn(x.shape, generator=gen).to(device=device, dtype=dtype)
                x = x0 if nxt == 0.0 else (1 - nxt) * x0 + nxt * fresh
        # clean pass: timestep 0, commits every layer's K/V into the chunk's slab
        xb = x.repeat_interleave(2, dim=0)
        sig = torch.zeros(xb.shape[:2], device=device, dtype=dtype)
        with kv.step(namespaces, clean=True) as layers:
            out, _ = _forward_pass(model, layers, start, xb, sig, pos, text, residuals=None, namespaces=namespaces,
                                   threshold=0.0)
        report.passes += 1
        if check:
            report.max_err = max(report.max_err, _dense_check(model, clean, namespaces, c, xb, sig, text, out,
                                                              sink_frames, window_frames))
            report.checked_passes += 1
        for j, ns in enumerate(namespaces):
            clean[ns].append(xb[j])
        report.retained_bytes_moved += _retained_moved(before, _retained_state(pool, namespaces))
        report.chunks += 1
        report.tokens += t_len * len(namespaces)
        report.arena_used_bytes = max(report.arena_used_bytes, kv.used_bytes)
        if start >= (sink_frames + window_frames) * cfg.frame_tokens:  # the window has moved past the sinks
            report.arena_used_bytes_after_window.append(kv.used_bytes)
        if progress is not None:
            progress(c + 1, num_chunks)
    report.wall_s = time.perf_counter() - t0
    st = features.stats()
    report.text_cache_hits, report.text_cache_misses = st["hits"], st["misses"]
    kv.reset()
    return report


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
