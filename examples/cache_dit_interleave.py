"""Two requests with CFG interleaved call by call on one cache-dit transformer, scoped and not.

cache-dit keeps one context per transformer and tells the CFG branches apart by the
parity of a call counter, so a server that interleaves requests on one transformer feeds
each request the other's residuals. ``kvarena.integrations.cache_dit.CacheDiTScope`` gives
every (request, branch) its own cache-dit state in a ``kvarena.ResidualCache``. This
script runs a tiny random ``WanTransformer3DModel`` (CPU, seconds, nothing downloaded):
each request alone on unmodified cache-dit, then both interleaved without and with the
scope, and prints how far each request's outputs move (max abs).

    python examples/cache_dit_interleave.py            # needs pip install -e ".[cache-dit]"
"""

from __future__ import annotations

import os

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # cache-dit logs every enable at info

import cache_dit  # noqa: E402
import torch  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402

from kvarena import CachePolicy, ResidualCache  # noqa: E402
from kvarena.integrations.cache_dit import CacheDiTScope  # noqa: E402

STEPS, GUIDANCE = 6, 3.0


def cached_wan() -> WanTransformer3DModel:
    """A tiny random Wan with cache-dit's DBCache on it (the same weights every time)."""
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                  in_channels=4, out_channels=4, text_dim=24, freq_dim=16, ffn_dim=32,
                                  num_layers=4, cross_attn_norm=True, rope_max_seq_len=64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cache_dit.enable_cache(model, cache_config=cache_dit.DBCacheConfig(
        max_warmup_steps=1, Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.3,
        max_continuous_cached_steps=2, enable_separate_cfg=True))
    return model


def request(model, seed: int, around):
    """A CFG denoising loop that yields after each transformer call, then its outputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 2, 6, 10, generator=g)
    prompt, negative = torch.randn(1, 7, 24, generator=g), torch.randn(1, 7, 24, generator=g)
    outs = []
    for step in range(STEPS):
        t = torch.tensor([1000 - 150 * step])
        branch_out = {}
        for branch, emb in (("cond", prompt), ("uncond", negative)):
            with around(branch):
                branch_out[branch] = model(hidden_states=x, timestep=t, encoder_hidden_states=emb,
                                           return_dict=False)[0]
            outs.append(branch_out[branch])
            yield None
        cond, uncond = branch_out["cond"], branch_out["uncond"]
        x = x - 0.1 * (uncond + GUIDANCE * (cond - uncond))
    yield outs


def interleave(*requests) -> list[list[torch.Tensor]]:
    done: dict[int, list[torch.Tensor]] = {}
    while len(done) < len(requests):
        for i, req in enumerate(requests):
            if i not in done and (got := next(req)) is not None:
                done[i] = got
    return [done[i] for i in range(len(requests))]


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def main() -> None:
    unscoped = lambda branch: torch.no_grad()
    with torch.no_grad():
        alone = [interleave(request(cached_wan(), seed, unscoped))[0] for seed in (1, 2)]
        model = cached_wan()
        mixed = interleave(request(model, 1, unscoped), request(model, 2, unscoped))
        model = cached_wan()
        cache = ResidualCache(CachePolicy("residual", max_bytes=64 << 20))
        scope = CacheDiTScope(model, cache)
        scoped = interleave(*(request(model, seed, lambda b, r=f"req{seed}": scope.call(r, b))
                              for seed in (1, 2)))
        print(f"cache-dit state of both requests in the ResidualCache: {len(cache)} contexts, "
              f"{cache.used_bytes} bytes")
        for name, a, m, s in zip(("request A", "request B"), alone, mixed, scoped):
            print(f"{name}: interleaved vs alone, max abs: unscoped cache-dit {gap(m, a):.3f}, "
                  f"CacheDiTScope {gap(s, a):.3g}")
        for rid in ("req1", "req2"):
            scope.end_request(rid)
        scope.close()


if __name__ == "__main__":
    main()
