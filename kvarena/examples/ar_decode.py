"""A small Llama-like decoder (GQA, RoPE, SwiGLU) served from a ``PagedKVCache``.

Shows the AR-decode call pattern: one ``plan`` per step for the whole batch (chunked
prefill of some requests mixed with one-token decode of others), then every layer's
``forward`` reuses that metadata; a request forked into two continuations shares its
prompt blocks by reference count. ``run_ar_decode`` checks every step's logits against
a dense recomputation of the whole sequence with no cache.

``DecoderConfig(windows=...)`` makes it a hybrid model (:data:`GEMMA3_LIKE`: five sliding
layers per full one, Gemma 3's pattern): the cache then has a layer group per kind of
layer, the sliding groups return blocks that left the window, and the arena grows with
the full layers only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvarena.attention.spec import AttentionSpec
from kvarena.cache.arena import KVLayout, group_layers
from kvarena.cache.keys import CachePolicy
from kvarena.cache.paged import PagedKVCache
from kvarena.examples.common import apply_rope, rms_norm, rope_tables


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 97
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 1  # GQA 4
    head_dim: int = 16
    ffn: int = 128
    rope_base: float = 10000.0
    #: Per layer: the sliding window's ``window_left``, or None for a full-attention layer
    #: (empty: every layer full).
    windows: tuple = ()

    @property
    def layer_windows(self) -> tuple:
        return self.windows or (None,) * self.num_layers


#: Gemma 3's pattern at tiny size: 5 sliding layers (window 64) per full layer.
GEMMA3_LIKE = DecoderConfig(num_layers=6, windows=(63,) * 5 + (None,))


class TinyDecoder(nn.Module):
    """Llama-style decoder whose attention runs either over a paged cache or densely."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.wq = nn.ModuleList(nn.Linear(c.dim, c.num_heads * c.head_dim, bias=False) for _ in range(c.num_layers))
        self.wk = nn.ModuleList(nn.Linear(c.dim, c.num_kv_heads * c.head_dim, bias=False) for _ in range(c.num_layers))
        self.wv = nn.ModuleList(nn.Linear(c.dim, c.num_kv_heads * c.head_dim, bias=False) for _ in range(c.num_layers))
        self.wo = nn.ModuleList(nn.Linear(c.num_heads * c.head_dim, c.dim, bias=False) for _ in range(c.num_layers))
        self.w_gate = nn.ModuleList(nn.Linear(c.dim, c.ffn, bias=False) for _ in range(c.num_layers))
        self.w_up = nn.ModuleList(nn.Linear(c.dim, c.ffn, bias=False) for _ in range(c.num_layers))
        self.w_down = nn.ModuleList(nn.Linear(c.ffn, c.dim, bias=False) for _ in range(c.num_layers))
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def _qkv(self, layer: int, h: torch.Tensor, pos: torch.Tensor):
        c = self.cfg
        x = rms_norm(h)
        q = self.wq[layer](x).view(-1, c.num_heads, c.head_dim)
        k = self.wk[layer](x).view(-1, c.num_kv_heads, c.head_dim)
        v = self.wv[layer](x).view(-1, c.num_kv_heads, c.head_dim)
        cos, sin = rope_tables(pos, c.head_dim, c.rope_base)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h)
        return h + self.w_down[layer](F.silu(self.w_gate[layer](x)) * self.w_up[layer](x))

    def forward_cached(self, tokens: torch.Tensor, pos: torch.Tensor, cache: PagedKVCache, meta, **attn) -> torch.Tensor:
        """tokens, pos ``[total_q]`` in the plan's row order -> logits ``[total_q, vocab]``."""
        h = self.embed(tokens)
        for layer in range(self.cfg.num_layers):
            q, k, v = self._qkv(layer, h, pos)
            o = cache.forward(q, k, v, meta, layer, **attn)  # [total_q, H_q, D]
            h = self._mlp(layer, h + self.wo[layer](o.flatten(1)))
        return self.head(rms_norm(h))

    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """One whole sequence ``[L]`` with causal SDPA and no cache -> logits ``[L, vocab]``."""
        c = self.cfg
        pos = torch.arange(tokens.shape[0], device=tokens.device)
        h = self.embed(tokens)
        i, j = pos[:, None], pos[None, :]
        for layer, w in enumerate(c.layer_windows):
            q, k, v = self._qkv(layer, h, pos)
            group = c.num_heads // c.num_kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            mask = (j <= i) if w is None else (j <= i) & (j >= i - w)  # [L, L]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), attn_mask=mask
            ).transpose(0, 1).to(h.dtype)
            h = self._mlp(layer, h + self.wo[layer](o.flatten(1)))
        return self.head(rms_norm(h))


@dataclass
class DecodeReport:
    steps: int = 0
    tokens: int = 0
    requests: int = 0
    max_logit_err: float = 0.0
    greedy_match: bool = True
    arena_reserved_bytes: int = 0
    arena_used_bytes_peak: int = 0
    #: Per layer group: the most blocks it held, and its release window (None: full history).
    group_blocks_peak: tuple = ()
    group_windows: tuple = ()
    block_bytes: int = 0
    wall_s: float = 0.0
    outputs: dict[str, list[int]] = field(default_factory=dict)


@torch.no_grad()
def run_ar_decode(
    *,
    prompt_lens: tuple[int, ...] = (5, 17, 30),
    new_tokens: int = 6,
    prefill_chunk: int = 8,
    block_size: int = 16,
    num_blocks: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    seed: int = 0,
    check: bool = True,
    progress=None,
    config: DecoderConfig | None = None,
) -> DecodeReport:
    """Serve several requests of different lengths with chunked prefill, decode and a fork.

    Request ``r0`` is forked after its prompt into ``r0.fork``, which continues with the
    second-most-likely token instead of the greedy one. Every step's logits are compared
    with :meth:`TinyDecoder.forward_dense` on the request's whole sequence. A hybrid
    ``config`` (sliding and full layers) gets a layer group per kind with the sliding
    groups' old blocks released; ``num_blocks`` is then per group.
    """
    torch.manual_seed(seed)
    cfg = config or DecoderConfig()
    model = TinyDecoder(cfg).to(device=device, dtype=dtype).eval()
    cache = _make_cache(cfg, block_size, num_blocks, dtype, device)
    report = DecodeReport(requests=len(prompt_lens) + 1)
    report.arena_reserved_bytes = cache.arena.reserved_bytes

    gen = torch.Generator().manual_seed(seed + 1)
    prompts = {f"r{i}": torch.randint(0, cfg.vocab, (n,), generator=gen).tolist() for i, n in enumerate(prompt_lens)}
    run = _Decoding(model, cache, report, prompts, device=device, backend=backend, check=check)
    t0 = time.perf_counter()
    while run.unfinished(new_tokens):
        run.sample(run.step(run.next_batch(prefill_chunk, new_tokens)))
        if progress is not None:
            progress(report)
    if check:
        _check_against_dense(model, run.seqs, run.cached, report, device)
    report.wall_s = time.perf_counter() - t0
    report.group_windows = tuple(g["window_left"] for g in cache.stats()["groups"])
    report.block_bytes = cache.block_bytes
    report.outputs = {ns: s for ns, s in run.seqs.items()}
    for ns in list(run.seqs):
        cache.free_namespace(ns)
    if cache.free != cache.total_blocks:
        raise RuntimeError(f"paged cache leaked blocks: {cache.total_blocks - cache.free} still used")
    return report


def _make_cache(cfg: DecoderConfig, block_size: int, num_blocks: int, dtype: torch.dtype, device) -> PagedKVCache:
    """The run's paged cache: a layer group per kind of layer for a hybrid ``cfg`` (the
    sliding groups' old blocks released), ``num_blocks`` blocks per group."""
    windows = cfg.layer_windows
    sliding = any(w is not None for w in windows)
    groups = group_layers(windows) if sliding and None in windows else None
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, groups=groups)
    n_groups = len(layout.layer_groups)
    policy = CachePolicy("paged_kv", max_bytes=num_blocks * n_groups * layout.block_bytes(block_size))
    return PagedKVCache(policy, layout=layout, block_size=block_size, device=device,
                        attention=[AttentionSpec(window_left=w) for w in windows], free_out_of_window=sliding)


class _Decoding:
    """The requests of one :func:`run_ar_decode`: their tokens, how many of each the cache
    holds, and (with ``check``) each step's logits, kept for the dense comparison."""

    def __init__(self, model: TinyDecoder, cache: PagedKVCache, report: DecodeReport, prompts: dict, *, device,
                 backend: str, check: bool) -> None:
        self.model, self.cache, self.report = model, cache, report
        self.device, self.backend, self.check = device, backend, check
        self.seqs = prompts
        self.prefilled = dict.fromkeys(prompts, 0)  # tokens of each sequence already in the cache
        self.produced = {ns: 0 for ns in prompts}
        self.forked = False
        # Per sequence: (first position, the cached run's logits of that step's rows).
        self.cached: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def unfinished(self, new_tokens: int) -> bool:
        return any(self.produced[ns] < new_tokens for ns in self.seqs)

    def next_batch(self, prefill_chunk: int, new_tokens: int) -> dict[str, int]:
        """Each unfinished request's next rows: a prompt chunk, or its last sampled token."""
        batch = {}
        for ns in self.seqs:
            pending = len(self.seqs[ns]) - self.prefilled[ns]  # prompt remainder, or the last sampled token
            if pending > 0 and self.produced[ns] < new_tokens:
                batch[ns] = min(prefill_chunk, pending)
        return batch

    def step(self, batch: dict[str, int]) -> dict[str, torch.Tensor]:
        """One plan and one cached forward over ``batch``; each sequence's last logits."""
        cache, report, prefilled = self.cache, self.report, self.prefilled
        meta = cache.plan(batch)
        toks, pos = [], []
        for ns, n in batch.items():
            start = prefilled[ns]
            toks += self.seqs[ns][start:start + n]
            pos += list(range(start, start + n))
        logits = self.model.forward_cached(
            torch.tensor(toks, device=self.device), torch.tensor(pos, device=self.device), cache, meta,
            backend=self.backend,
        )
        report.steps += 1
        report.tokens += len(toks)
        report.arena_used_bytes_peak = max(report.arena_used_bytes_peak, cache.used_bytes)
        report.group_blocks_peak = tuple(map(max, zip(report.group_blocks_peak or cache.group_used_blocks,
                                                      cache.group_used_blocks)))
        last, row = {}, 0
        for ns, n in batch.items():
            start = prefilled[ns]
            prefilled[ns] += n
            last[ns] = logits[row + n - 1]
            if self.check:  # compared with the dense model once per sequence, after the run
                self.cached.setdefault(ns, []).append((start, logits[row:row + n].float().clone()))
            row += n
        return last

    def sample(self, last: dict[str, torch.Tensor]) -> None:
        """Greedy tokens for the sequences past their prompt; ``r0`` forks after its prompt."""
        for ns, logit in last.items():
            if self.prefilled[ns] < len(self.seqs[ns]):
                continue  # still prefilling: this logit predicts a prompt token
            top2 = logit.float().topk(2).indices.tolist()
            if ns == "r0" and not self.forked:
                # Fork after the prompt: the fork shares r0's blocks and takes the runner-up token.
                self.cache.fork("r0", "r0.fork")
                self.seqs["r0.fork"] = list(self.seqs["r0"]) + [top2[1]]
                self.prefilled["r0.fork"] = self.prefilled["r0"]
                self.produced["r0.fork"] = 1
                self.forked = True
            self.seqs[ns].append(top2[0])
            self.produced[ns] += 1


def _check_against_dense(model: TinyDecoder, seqs: dict, cached: dict, report: DecodeReport, device) -> None:
    """Every step's logits vs :meth:`TinyDecoder.forward_dense` over each whole sequence.

    The dense model is causal (and its sliding layers look back only), so the logits at
    position ``p`` of the whole final sequence are those of its prefix ``[: p + 1]``: one
    dense pass per sequence checks every step it took, rather than one pass per step.
    """
    for ns, steps in cached.items():
        dense = model.forward_dense(torch.tensor(seqs[ns], device=device)).float()
        for start, rows in steps:
            ref = dense[start:start + rows.shape[0]]
            report.max_logit_err = max(report.max_logit_err, (rows - ref).abs().max().item())
            if int(ref[-1].argmax()) != int(rows[-1].argmax()):
                report.greedy_match = False


def summary(report: DecodeReport) -> str:
    """A few readable lines about a :func:`run_ar_decode` run (what ``python -m`` prints)."""
    lines = [
        f"{report.requests} requests (one a fork), {report.steps} steps, {report.tokens} tokens in {report.wall_s:.2f} s",
        f"max logit error vs dense {report.max_logit_err:.2e}, greedy tokens match dense: {report.greedy_match}",
        f"arena: {report.arena_used_bytes_peak} of {report.arena_reserved_bytes} bytes used at peak "
        f"({report.block_bytes} bytes per block)",
    ]
    if len(report.group_windows) > 1:
        kinds = ", ".join(f"{'full' if w is None else f'window {w + 1}'}: {b}"
                          for w, b in zip(report.group_windows, report.group_blocks_peak))
        lines.append(f"blocks per layer group at peak: {kinds}")
    for ns, toks in report.outputs.items():
        lines.append(f"  {ns}: ... {toks[-6:]} ({len(toks)} tokens)")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(summary(run_ar_decode()))
