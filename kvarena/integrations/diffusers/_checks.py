"""What the rollout checks, before anything touches the cache: the transformer, each call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvarena.argcheck import check_bool, check_int

__all__ = ["CallArgs", "ChunkShape", "WanGeometry", "check_bool", "check_call", "check_int", "inspect_transformer"]


@dataclass(frozen=True)
class WanGeometry:
    """The parts of a ``WanTransformer3DModel`` the cache is made for."""

    num_layers: int
    heads: int
    head_dim: int
    patch: tuple[int, int, int]
    in_channels: int
    text_dim: int
    rope_frames: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class ChunkShape:
    """One call's chunk: rows, latent frames, latent patches per frame (height x width)."""

    batch: int
    frames: int
    height: int
    width: int

    @property
    def frame_tokens(self) -> int:
        return self.height * self.width


@dataclass(frozen=True)
class CallArgs:
    """The arguments of one transformer call, as the rollout reads them."""

    shape: ChunkShape
    encoder_hidden_states: torch.Tensor


def inspect_transformer(transformer: Any) -> WanGeometry:
    """The transformer's layout; TypeError / ValueError naming ``transformer`` if it is not
    a text-to-video Wan 2.1-style ``WanTransformer3DModel`` this adapter supports."""
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise ImportError("kvarena.integrations.diffusers needs diffusers: pip install 'kvarena[diffusers]'") from exc
    if not isinstance(transformer, WanTransformer3DModel):
        raise TypeError(f"transformer: expected a diffusers WanTransformer3DModel, got {type(transformer).__name__}")
    cfg = transformer.config
    patch = tuple(int(p) for p in cfg.patch_size)
    if len(patch) != 3 or patch[0] != 1:
        raise ValueError(f"transformer: expected a temporal patch size of 1 (patch_size (1, h, w), Self-Forcing's "
                         f"(1, 2, 2)), got patch_size {patch}: a chunk's frames would not be latent frames")
    if cfg.added_kv_proj_dim is not None or cfg.image_dim is not None:
        raise ValueError("transformer: an image-to-video Wan (image_dim / added_kv_proj_dim set) is not supported: "
                         "the rollout caches text cross-attention only")
    heads, head_dim = int(cfg.num_attention_heads), int(cfg.attention_head_dim)
    attn = transformer.blocks[0].attn1
    if attn.heads != heads or attn.inner_dim != heads * head_dim:
        raise ValueError(f"transformer: attn1 has {attn.heads} heads of width {attn.inner_dim}, the config says "
                         f"{heads} x {head_dim}")
    p = next(transformer.parameters())
    return WanGeometry(num_layers=len(transformer.blocks), heads=heads, head_dim=head_dim, patch=patch,
                       in_channels=int(cfg.in_channels), text_dim=int(cfg.text_dim),
                       rope_frames=int(transformer.rope.max_seq_len), dtype=p.dtype, device=p.device)


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    if len(args) > index:
        return args[index]
    raise TypeError(f"{name}: the transformer call inside a rollout step needs it")


def _shape(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_placed(name: str, t: torch.Tensor, dtype: torch.dtype | None, device: torch.device, what: str) -> None:
    """``t`` on ``device`` with ``dtype`` (None: any real number type; under autocast on the
    device, any floating type: autocast casts the inputs of the convolution and the
    projections itself); TypeError / ValueError."""
    if dtype is not None and torch.is_autocast_enabled(device.type):
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point dtype, got {t.dtype}")
    elif dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} ({what}), got {t.dtype}")
    if dtype is None and (t.dtype == torch.bool or t.is_complex()):
        raise TypeError(f"{name}: expected a real number dtype, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the transformer's device), got {t.device}")


def _check_dtypes(geom: WanGeometry, transformer: Any, x: torch.Tensor, t: torch.Tensor, emb: torch.Tensor) -> None:
    """Dtypes and devices as the transformer's weights are now (read at each call), and the
    self-attention's as the rollout's cache was made for."""
    attn = next(transformer.blocks[0].attn1.parameters())
    if (attn.dtype, attn.device) != (geom.dtype, geom.device):
        raise ValueError(f"transformer: its attention weights are {attn.dtype} on {attn.device} now, the rollout's "
                         f"cache was made for {geom.dtype} on {geom.device}; build a new CausalWanRollout after .to()")
    patch = transformer.patch_embedding.weight
    text = transformer.condition_embedder.text_embedder.linear_1.weight
    _check_placed("hidden_states", x, patch.dtype, patch.device, "patch_embedding's weights")
    _check_placed("timestep", t, None, patch.device, "")
    _check_placed("encoder_hidden_states", emb, text.dtype, text.device, "the text embedder's weights")


def check_call(geom: WanGeometry, args: tuple, kwargs: dict, batch: int, transformer: Any) -> CallArgs:
    """The call's chunk shape; ValueError / TypeError naming the argument that does not fit
    (shape, dtype, device: everything the transformer would refuse mid-call, checked before
    the step is planned)."""
    x = _arg(args, kwargs, 0, "hidden_states")
    t = _arg(args, kwargs, 1, "timestep")
    emb = _arg(args, kwargs, 2, "encoder_hidden_states")
    _, ph, pw = geom.patch
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        raise ValueError(f"hidden_states: expected a [B, C, F, H, W] tensor of one chunk's latents, got {_shape(x)}")
    b, c, f, h, w = x.shape
    if b != batch:
        raise ValueError(f"hidden_states: expected {batch} rows (the rollout's batch_size), got {b}")
    if c != geom.in_channels or h % ph or w % pw or h == 0 or w == 0 or f == 0:
        raise ValueError(f"hidden_states: expected [B, {geom.in_channels}, F, H, W] with H, W multiples of the patch "
                         f"({ph}, {pw}), got {tuple(x.shape)}")
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != b:
        raise ValueError(f"timestep: expected a [B] = [{b}] tensor (one value per row), got {_shape(t)}; "
                         "Self-Forcing's [B, F] timestep holds one value per chunk in inference: pass "
                         "timestep[:, 0] (diffusers reads a 2-D timestep as Wan 2.2's per-token timestep)")
    if not isinstance(emb, torch.Tensor) or emb.dim() != 3 or emb.shape[0] != b or emb.shape[2] != geom.text_dim:
        raise ValueError(f"encoder_hidden_states: expected a [B, L, text_dim] = [{b}, L, {geom.text_dim}] tensor, "
                         f"got {_shape(emb)}")
    _check_dtypes(geom, transformer, x, t, emb)
    if kwargs.get("encoder_hidden_states_image") is not None or len(args) > 3 and args[3] is not None:
        raise ValueError("encoder_hidden_states_image: not supported inside a rollout step (text-to-video only)")
    return CallArgs(shape=ChunkShape(batch=b, frames=f, height=h // ph, width=w // pw), encoder_hidden_states=emb)
