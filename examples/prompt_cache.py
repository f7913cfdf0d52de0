"""Prompt embeddings served from a ``kvarena.FeatureCache`` under a diffusers pipeline.

    python examples/prompt_cache.py          # a tiny offline WanPipeline, CPU, seconds

The pipeline's text encoder is a 2-layer UMT5 built from a config and its tokenizer a
word-level one built in memory (nothing is downloaded). It shows: a repeated prompt is a
hit (the encoder does not run; the result is bitwise the uncached call), a weight change
torch can see (an in-place op) is a miss with no call, and a write it cannot see
(``weight.data``: an RL weight sync, a hand-made LoRA merge) needs
``handle.invalidate_weights(version)``, the weight-sync hook.
"""

from __future__ import annotations

import torch
from diffusers import WanPipeline
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from kvarena import CachePolicy, FeatureCache
from kvarena.integrations.diffusers import cache_prompts

WORDS = ("a", "red", "fox", "in", "snow", "blue", "cat", "on", "mat")


def tiny_pipeline() -> WanPipeline:
    """A WanPipeline with only a text side: a tiny random UMT5 and an in-memory tokenizer."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=16, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    return WanPipeline(tokenizer=tokenizer, text_encoder=encoder.eval().requires_grad_(False),
                       transformer=None, vae=None, scheduler=None)


def main() -> None:
    pipe = tiny_pipeline()
    runs = []
    pipe.text_encoder.register_forward_hook(lambda *_: runs.append(1))
    cache = FeatureCache(CachePolicy("feature", max_bytes=64 << 20))
    args = dict(prompt="a red fox in snow", negative_prompt="blue cat", max_sequence_length=16)
    with torch.no_grad(), cache_prompts(pipe, cache) as handle:
        first, _ = pipe.encode_prompt(**args)
        again, _ = pipe.encode_prompt(**args)
        print(f"repeated prompt: hit, bitwise equal {torch.equal(first, again)}, encoder runs {len(runs)}")

        pipe.text_encoder.encoder.final_layer_norm.weight.mul_(1.1)  # torch sees it: a new version
        changed, _ = pipe.encode_prompt(**args)
        print(f"after an in-place weight update: miss, embedding changed {not torch.equal(changed, first)}")

        pipe.text_encoder.encoder.final_layer_norm.weight.data.mul_(1.1)  # unseen by torch's counters
        stale, _ = pipe.encode_prompt(**args)
        dropped = handle.invalidate_weights("rl-step-1")  # the weight-sync hook
        fresh, _ = pipe.encode_prompt(**args)
        print(f"after a .data write: served the old entry {torch.equal(stale, changed)} until "
              f"invalidate_weights dropped {dropped}; then fresh {not torch.equal(fresh, changed)}")
        print("stats:", handle.stats())


if __name__ == "__main__":
    main()
