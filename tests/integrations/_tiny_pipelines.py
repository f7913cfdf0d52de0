"""Tiny diffusers pipelines built offline (tests and the example): config-built models and an
in-memory tokenizer, so nothing is downloaded."""

from __future__ import annotations

import torch

WORDS = ("a", "red", "fox", "jumps", "over", "the", "lazy", "dog", "in", "snow", "at", "night", "blue", "cat",
         "sits", "on", "mat", "bright", "sunny", "day", "green", "forest", "river", "city", "street", "rain")


def tiny_tokenizer():
    """A word-level fast tokenizer over ``WORDS`` (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_umt5(seed: int = 0):
    """A 2-layer UMT5 encoder (d_model 32), eval mode, parameters not requiring grad."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    cfg = UMT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16,
                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return UMT5EncoderModel(cfg).eval().requires_grad_(False)


def tiny_wan_pipeline(seed: int = 0, text_encoder=None, tokenizer=None):
    """A ``WanPipeline`` whose every component is tiny and random (text_dim 32)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                        in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32,
                                        num_layers=1, rope_max_seq_len=32).eval()
    vae = AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1], num_res_blocks=1,
                           temperal_downsample=[False]).eval()
    return WanPipeline(tokenizer=tokenizer or tiny_tokenizer(), text_encoder=text_encoder or tiny_umt5(seed),
                       transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler())


def tiny_flux_pipeline(seed: int = 0):
    """A ``FluxPipeline`` with a 1-layer CLIP and T5 (width 16) and a 1-block transformer; no VAE
    (``encode_prompt`` and the LoRA API do not use it). Flux's loader puts LoRA on text encoders."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=16, projection_dim=16,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=0))
    t5 = T5EncoderModel(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
                                 relative_attention_num_buckets=8))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                         pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    tokenizer = tiny_tokenizer()
    tokenizer.model_max_length = 8  # Flux pads CLIP input to the tokenizer's max length
    return FluxPipeline(scheduler=None, vae=None, text_encoder=clip.eval().requires_grad_(False), tokenizer=tokenizer,
                        text_encoder_2=t5.eval().requires_grad_(False), tokenizer_2=tiny_tokenizer(),
                        transformer=transformer.eval())


def clip_lora(seed: int = 0, rank: int = 2) -> dict:
    """A LoRA on the tiny CLIP's q/v projections, in the pipeline's ``text_encoder.`` key format."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for proj in ("q_proj", "v_proj"):
        prefix = f"text_encoder.text_model.encoder.layers.0.self_attn.{proj}"
        sd[f"{prefix}.lora_A.weight"] = torch.randn(rank, 16, generator=g)
        sd[f"{prefix}.lora_B.weight"] = torch.randn(16, rank, generator=g)
    return sd
