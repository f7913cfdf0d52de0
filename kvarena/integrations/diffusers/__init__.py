"""Causal (Self-Forcing-style) rollouts of diffusers' ``WanTransformer3DModel`` on kvarena.

The adapter for the model people load from diffusers (0.42.1): a rollout installs kvarena
attention processors on the transformer; inside ``rollout.step(...)`` its self-attention
attends causally through a slab KV cache (Self-Forcing's sink/window rule, RoPE by absolute
frame index) and its cross-attention reuses the prompt's K/V; outside a step the
transformer behaves exactly as before:

.. code-block:: python

    from kvarena.integrations.diffusers import CausalWanRollout
    rollout = CausalWanRollout(transformer, num_frame_per_block=3, local_attn_size=-1,
                               sink_size=0, max_frames=21, batch_size=1)
    with rollout.step(start_frame=f0, clean=False):
        out = transformer(hidden_states=x, timestep=t, encoder_hidden_states=emb,
                          return_dict=False)[0]

:func:`convert_self_forcing_state_dict` maps original Wan / Self-Forcing / CausVid
checkpoints to diffusers' parameter names; :func:`wan_config_from_state_dict` reads the
transformer's config off such a state dict. Importing this package does not import
diffusers (the rollout does, when it is built). :func:`cache_prompts` serves a pipeline's
``encode_prompt`` from a :class:`~kvarena.FeatureCache` (bitwise the uncached result, keyed
by the call and the text encoders' state). See ``docs/diffusers.md``.
"""

from kvarena.integrations.diffusers.convert import (
    convert_self_forcing_state_dict,
    wan_config_from_state_dict,
)
from kvarena.integrations.diffusers.prompt_cache import PromptCacheHandle, cache_prompts
from kvarena.integrations.diffusers.rollout import CausalWanRollout, RolloutStep

__all__ = [
    "CausalWanRollout",
    "PromptCacheHandle",
    "RolloutStep",
    "cache_prompts",
    "convert_self_forcing_state_dict",
    "wan_config_from_state_dict",
]
