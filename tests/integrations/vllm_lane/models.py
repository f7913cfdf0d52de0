"""Tiny decoders with seeded random weights, written as safetensors checkpoints for vLLM.

vLLM's ``load_format="dummy"`` fills every tensor from one fixed seed, which leaves every
logprob tied and no attention bug visible; these checkpoints are random enough for
attention to be sharp: projections drawn with ``initializer_range`` 0.1, 8 query heads over
2 KV heads (GQA 4), head dim 32, vocabulary 512. Each family carries the feature the lane
tests through it: Mistral a sliding window shorter than the prompts (vLLM 0.32 refuses
Qwen2's partial sliding windows, and Qwen2 without one is Llama's attention), Gemma 2
logit softcapping with alternating window/full layers, gpt-oss learned sinks (and its
alternating windows; both of its 2 experts active, since a top-k choice among more would
turn bf16 rounding noise into a different expert at a near-tie and a different token).

Run as a script (``python models.py OUT_DIR FAMILY...``) in the lane's environment, where
transformers is vLLM's; the checkpoint of a family is a function of this file and the seed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, initializer_range=0.1,
              tie_word_embeddings=False)
WINDOW = 24  # shorter than the lane's prompts, longer than a block of 16 rows

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": WINDOW, "attn_logit_softcapping": 5.0,
                                                     "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 32,
                                                     "tie_word_embeddings": True}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"sliding_window": WINDOW, "num_local_experts": 2,
                                                      "num_experts_per_tok": 2, "intermediate_size": 256,
                                                      "layer_types": ["sliding_attention", "full_attention"]}),
}


def write(out: Path, family: str, seed: int = 0) -> Path:
    import torch
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.bfloat16)
    if family == "gpt_oss":  # sinks start at zero: draw them so they matter
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 1.0)
    path = out / family
    model.save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


if __name__ == "__main__":
    for fam in sys.argv[2:]:
        print(write(Path(sys.argv[1]), fam))
