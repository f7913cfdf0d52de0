"""A tiny random Wan under cache-dit, and requests driven one transformer call at a time.

A request is a short denoising loop (CFG or not) over its own latents and prompts; it is
a generator that yields after every transformer call, so a test can interleave several
requests call by call in any order (:func:`interleave`) and compare each with the same
request run alone. Every tensor is built here from seeds: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import cache_dit
import torch
from cache_dit import DBCacheConfig
from diffusers import WanTransformer3DModel

C, TEXT, LAT_H, LAT_W = 4, 24, 6, 10

# Chosen so that one request mixes cached and computed steps (threshold 0.3 caches every
# step after warmup on this model; max_continuous_cached_steps=2 forces a compute every
# third step), and so that unscoped interleaving serves another request's residuals.
CACHE_KW = dict(max_warmup_steps=1, Fn_compute_blocks=1, Bn_compute_blocks=0,
                residual_diff_threshold=0.3, max_continuous_cached_steps=2)


def tiny_wan(seed: int = 0) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=C,
        out_channels=C, text_dim=TEXT, freq_dim=16, ffn_dim=32, num_layers=4,
        cross_attn_norm=True, rope_max_seq_len=64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def cached_wan(separate_cfg: bool = True, **config) -> WanTransformer3DModel:
    """A fresh tiny Wan with cache-dit's DBCache enabled on it (transformer-only)."""
    model = tiny_wan()
    cache_dit.enable_cache(
        model, cache_config=DBCacheConfig(**{**CACHE_KW, **config}, enable_separate_cfg=separate_cfg))
    return model


@dataclass(frozen=True)
class Request:
    seed: int
    steps: int = 6
    cfg: bool = True
    start: int = 0  # idle turns before its first call, when interleaved

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(1, C, 2, LAT_H, LAT_W, generator=g)
        return x, torch.randn(1, 7, TEXT, generator=g), torch.randn(1, 7, TEXT, generator=g)


Branch = Callable[[str], contextlib.AbstractContextManager]


def no_scope(branch: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def call(model, x, t, emb) -> torch.Tensor:
    return model(hidden_states=x, timestep=t, encoder_hidden_states=emb, return_dict=False)[0]


def drive(model, req: Request, around: Branch = no_scope) -> Iterator[list[torch.Tensor] | None]:
    """Yield ``None`` after each transformer call, then the list of every call's output."""
    for _ in range(req.start):
        yield None
    x, emb, neg = req.inputs()
    outs: list[torch.Tensor] = []
    for step in range(req.steps):
        t = torch.tensor([1000 - 150 * step])
        with around("cond"):
            cond = call(model, x, t, emb)
        outs.append(cond)
        yield None
        if req.cfg:
            with around("uncond"):
                uncond = call(model, x, t, neg)
            outs.append(uncond)
            yield None
            x = x - 0.1 * (uncond + 3.0 * (cond - uncond))
        else:
            x = x - 0.1 * cond
    yield outs


def run(model, req: Request, around: Branch = no_scope) -> list[torch.Tensor]:
    """``req`` alone, start to end."""
    return interleave([drive(model, req, around)])[0]


def interleave(requests: list[Iterator]) -> list[list[torch.Tensor]]:
    """Advance each request one transformer call in turn until all are done."""
    outs: list = [None] * len(requests)
    live = list(range(len(requests)))
    while live:
        for i in list(live):
            got = next(requests[i])
            if got is not None:
                outs[i] = got
                live.remove(i)
    return outs


def max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b), f"{len(a)} calls vs {len(b)}"
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def first_mismatch(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    """'' when ``a`` and ``b`` are bitwise equal call by call, else where they first differ."""
    if len(a) != len(b):
        return f"{len(a)} calls vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x, y):
            return f"call {i} differs first, max abs {(x - y).abs().max().item():.3g}"
    return ""


def fbc_wan(threshold: float = 0.5) -> WanTransformer3DModel:
    """A fresh tiny Wan with diffusers' own FirstBlockCache hook (no cache-dit). At 0.5 a
    request caches most steps after the first, and unscoped interleaving reads the other
    request's residuals."""
    from diffusers.hooks import FirstBlockCacheConfig

    model = tiny_wan()
    model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    return model


def resets(model, turns: int) -> Iterator[list | None]:
    """Another pipeline's ends, one per turn: diffusers resets every hook state of the model."""
    for _ in range(turns):
        model._reset_stateful_cache()
        yield None
    yield []
