"""Original Wan / Self-Forcing / CausVid checkpoints into diffusers' ``WanTransformer3DModel``.

Self-Forcing's ``self_forcing_dmd.pt`` holds ``{"generator": ..., "generator_ema": ...}``,
each the state dict of a wrapper whose ``model`` is a ``CausalWanModel`` (keys
``model.blocks.0.self_attn.q.weight``, ...). The original Wan 2.1 release and CausVid use
the same module names without (or with other) prefixes. The causal model has the same
parameters as the bidirectional one: only the attention pattern differs, so the
converted weights load into diffusers' transformer as they are (``strict=True``).

Names (per block ``i``; see :data:`BLOCK_NAMES` and :data:`TOP_NAMES`)::

    self_attn.{q,k,v,o,norm_q,norm_k}  -> attn1.{to_q,to_k,to_v,to_out.0,norm_q,norm_k}
    cross_attn.{...}                   -> attn2.{...}   (k_img, v_img, norm_k_img: add_k_proj, ...)
    norm3 (cross-attention norm)       -> norm2         (the FFN norm has no weights)
    ffn.0 / ffn.2                      -> ffn.net.0.proj / ffn.net.2
    modulation                         -> scale_shift_table
    time_embedding.0/2                 -> condition_embedder.time_embedder.linear_1/2
    time_projection.1                  -> condition_embedder.time_proj
    text_embedding.0/2                 -> condition_embedder.text_embedder.linear_1/2
    head.head / head.modulation        -> proj_out / scale_shift_table
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from kvarena.argcheck import check_bool, check_int

__all__ = ["BLOCK_NAMES", "TOP_NAMES", "convert_self_forcing_state_dict", "wan_config_from_state_dict"]

#: Module paths inside ``blocks.<i>.``: original name -> diffusers name.
BLOCK_NAMES: dict[str, str] = {
    **{f"self_attn.{a}": f"attn1.{b}" for a, b in
       (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("norm_q", "norm_q"), ("norm_k", "norm_k"))},
    **{f"cross_attn.{a}": f"attn2.{b}" for a, b in
       (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("norm_q", "norm_q"), ("norm_k", "norm_k"),
        ("k_img", "add_k_proj"), ("v_img", "add_v_proj"), ("norm_k_img", "norm_added_k"))},
    "norm3": "norm2",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
    "modulation": "scale_shift_table",
}

#: Top-level module paths: original name -> diffusers name.
TOP_NAMES: dict[str, str] = {
    "patch_embedding": "patch_embedding",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "head.head": "proj_out",
    "head.modulation": "scale_shift_table",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}

# Wrappers that training code puts into names (FSDP, activation checkpointing, compile, DDP).
_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_PREFIXES = ("module.", "model.", "diffusion_model.")
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def _strip(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def _rename(name: str) -> str | None:
    """The diffusers name of one (prefix-free) original name; None if it has none."""
    m = _BLOCK.fullmatch(name)
    table, head, rest = (BLOCK_NAMES, f"blocks.{m.group(1)}.", m.group(2)) if m else (TOP_NAMES, "", name)
    module, _, leaf = rest.rpartition(".")
    if module in table:
        return f"{head}{table[module]}.{leaf}"
    if rest in table:  # a parameter that is a module path of its own (modulation)
        return f"{head}{table[rest]}"
    return None


def _pick(state_dict: Mapping[str, Any], use_ema: bool) -> Mapping[str, Any]:
    """The generator's state dict inside a Self-Forcing / CausVid training checkpoint."""
    for key in (("generator_ema", "generator") if use_ema else ("generator", "generator_ema")):
        if isinstance(state_dict.get(key), Mapping):
            return state_dict[key]
    for key in ("state_dict", "model"):
        if isinstance(state_dict.get(key), Mapping):
            return state_dict[key]
    return state_dict


def convert_self_forcing_state_dict(state_dict: Mapping[str, Any], *, use_ema: bool = False,
                                    strict: bool = True) -> dict[str, Any]:
    """A Wan / Self-Forcing / CausVid state dict under diffusers' ``WanTransformer3DModel`` names.

    Parameters
    ----------
    state_dict : Mapping
        The model's state dict, or a training checkpoint holding it under ``"generator"`` /
        ``"generator_ema"`` (Self-Forcing, CausVid), ``"state_dict"`` or ``"model"``.
        Prefixes ``model.``, ``diffusion_model.``, ``module.`` and FSDP / checkpoint /
        compile wrapper names are dropped.
    use_ema : bool, default False
        Take ``"generator_ema"`` when the checkpoint has both (Self-Forcing's
        ``--use_ema``).
    strict : bool, default True
        Raise on a name the table does not map (else such names are left out).

    Returns
    -------
    dict
        New names to the same tensor objects (nothing is copied):
        ``transformer.load_state_dict(convert_self_forcing_state_dict(sd), strict=True)``.

    Raises
    ------
    TypeError
        ``state_dict`` is not a mapping, or ``use_ema`` / ``strict`` is not a bool.
    ValueError
        ``strict`` and a name has no diffusers counterpart, or two names map to one.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    source = _pick(state_dict, check_bool("use_ema", use_ema))  # "false" is truthy: a str must not pick the EMA
    check_bool("strict", strict)
    out: dict[str, Any] = {}
    unknown: list[str] = []
    for name, value in source.items():
        new = _rename(_strip(str(name)))
        if new is None:
            unknown.append(str(name))
            continue
        if new in out:
            raise ValueError(f"state_dict: two names map to {new!r} (one of them is {name!r})")
        out[new] = value
    if unknown and strict:
        shown = ", ".join(repr(n) for n in unknown[:5])
        raise ValueError(f"state_dict: {len(unknown)} names have no diffusers counterpart (e.g. {shown}); "
                         "pass strict=False to leave them out")
    return out


def wan_config_from_state_dict(state_dict: Mapping[str, Any], *, attention_head_dim: int = 128) -> dict[str, Any]:
    """``WanTransformer3DModel(**config)`` arguments read off a diffusers-named state dict.

    The head count is not stored in the weights: it is ``dim // attention_head_dim``
    (128 for every Wan 2.1 model: 12 heads at 1.3B, 40 at 14B). ``attention_head_dim``
    must be an int >= 1 that divides the width (else ``TypeError`` / ``ValueError``).
    """
    check_int("attention_head_dim", attention_head_dim, 1)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    sd = state_dict
    for need in ("patch_embedding.weight", "proj_out.weight", "blocks.0.ffn.net.0.proj.weight",
                 "condition_embedder.text_embedder.linear_1.weight", "condition_embedder.time_embedder.linear_1.weight"):
        if need not in sd:
            raise ValueError(f"state_dict: {need!r} missing (convert the original names first with "
                             "convert_self_forcing_state_dict)")
    dim, in_ch, *patch = sd["patch_embedding.weight"].shape
    if dim % attention_head_dim:
        raise ValueError(f"attention_head_dim: the model width {dim} is not a multiple of {attention_head_dim}")
    layers = 1 + max(int(m.group(1)) for m in (_BLOCK.fullmatch(k) for k in sd) if m)
    cfg = {
        "patch_size": tuple(int(p) for p in patch),
        "num_attention_heads": dim // attention_head_dim,
        "attention_head_dim": attention_head_dim,
        "in_channels": int(in_ch),
        "out_channels": int(sd["proj_out.weight"].shape[0]) // math.prod(patch),
        "text_dim": int(sd["condition_embedder.text_embedder.linear_1.weight"].shape[1]),
        "freq_dim": int(sd["condition_embedder.time_embedder.linear_1.weight"].shape[1]),
        "ffn_dim": int(sd["blocks.0.ffn.net.0.proj.weight"].shape[0]),
        "num_layers": layers,
        "cross_attn_norm": "blocks.0.norm2.weight" in sd,
    }
    if "condition_embedder.image_embedder.norm1.weight" in sd:
        cfg["image_dim"] = int(sd["condition_embedder.image_embedder.norm1.weight"].shape[0])
        cfg["added_kv_proj_dim"] = dim
    return cfg
