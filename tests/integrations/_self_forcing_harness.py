"""Self-Forcing's own ``CausalWanModel`` (from a checkout; never vendored) for a parity test.

``KVARENA_SELF_FORCING_SRC`` names a checkout of github.com/guandeh17/Self-Forcing. Only
``wan/modules/{attention,model,causal_model}.py`` are imported (the package ``__init__``
files pull the T5 / VAE / pipelines in, so stub parents stand in for them). What is
changed, and why (none of it is the causal rule under test):

* ``flash_attention`` / ``attention`` run SDPA in the inputs' dtype: the originals need
  flash-attn on CUDA and cast to bf16, and the test compares fp32;
* ``max_attention_size`` and the cache sizes use the tiny model's frame tokens where
  Self-Forcing hard-codes Wan 1.3B's 1560 (``local_attn_size * 1560``, 32760).

The loop is ``CausalInferencePipeline.inference``'s (denoising calls, then the clean pass
at ``context_noise``; ``current_start = start_frame * frame_seq_length``) written against
the model directly, as the pipeline's wrapper pulls in the text encoder and VAE.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch


def load_causal_model(src: str):
    """The ``wan.modules.causal_model`` module of the checkout at ``src``."""
    root = Path(src)
    for name, sub in (("wan", "wan"), ("wan.modules", "wan/modules")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root / sub)]
            sys.modules[name] = pkg
    model = importlib.import_module("wan.modules.model")
    causal = importlib.import_module("wan.modules.causal_model")

    def sdpa(q, k, v, *args, **kwargs):  # [B, L, H, D] in, [B, L, H, D] out, the inputs' dtype
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2).contiguous()

    model.flash_attention = sdpa
    causal.attention = sdpa
    return causal


def build(causal, *, dim, heads, layers, in_dim, text_dim, text_len, ffn_dim, freq_dim, local_attn_size, sink_size,
          frame_tokens, seed=0):
    torch.manual_seed(seed)
    m = causal.CausalWanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=text_len, in_dim=in_dim, dim=dim,
                              ffn_dim=ffn_dim, freq_dim=freq_dim, text_dim=text_dim, out_dim=in_dim, num_heads=heads,
                              num_layers=layers, local_attn_size=local_attn_size, sink_size=sink_size).eval()
    with torch.no_grad():  # init_weights zeroes the head: perturb every weight so outputs are not trivial
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    size = 32760 if local_attn_size == -1 else local_attn_size * frame_tokens
    for block in m.blocks:
        block.self_attn.max_attention_size = size
    return m, size


def caches(m, batch, size, heads, head_dim, text_len):
    kv = [{"k": torch.zeros(batch, size, heads, head_dim), "v": torch.zeros(batch, size, heads, head_dim),
           "global_end_index": torch.tensor([0]), "local_end_index": torch.tensor([0])} for _ in m.blocks]
    cross = [{"k": torch.zeros(batch, text_len, heads, head_dim), "v": torch.zeros(batch, text_len, heads, head_dim),
              "is_init": False} for _ in m.blocks]
    return kv, cross


def call(m, x, t_value, context, kv, cross, current_start):
    """One ``CausalWanModel`` inference call: ``x [B, C, F, H, W]``, timestep ``[B, F]``."""
    t = torch.full((x.shape[0], x.shape[2]), float(t_value))
    return m(x, t, context, seq_len=1 << 20, kv_cache=kv, crossattn_cache=cross, current_start=current_start)
