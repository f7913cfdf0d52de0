"""pytest plugin for ``bench/hf_model_tests.py``: runs transformers' own model tests with
every model built under ``attn_implementation="kvarena"``.

Loaded with ``-p _hf_force_kvarena`` (this folder on ``PYTHONPATH``); what it does is read
from the environment at load time:

``KVARENA_HF_FORCE=1``
    :func:`kvarena.integrations.hf.register` is called and
    ``PreTrainedModel.get_correct_attn_implementation`` answers ``"kvarena"`` wherever
    transformers would have chosen by itself (no request: sdpa, or eager on a model sdpa
    cannot serve, e.g. Gemma 2, gpt-oss) or been asked for ``"sdpa"``. ``"eager"`` stays eager: it is the reference the tests compare against
    (``test_eager_matches_sdpa_inference`` then compares eager with kvarena). Flash, flex
    and hub kernels are left alone (the runner deselects their tests).
``KVARENA_HF_CACHE=kvarena``
    With the above, ``generate`` builds a ``KVArenaCache`` wherever it would have built a
    plain ``DynamicCache`` itself (no cache passed, ``cache_implementation`` unset or
    ``"dynamic"``, not an assistant model); a cache the test passes is kept.

Without ``KVARENA_HF_FORCE`` (the default run) it changes nothing but the shim below, so
both runs see the same test tree.

Shim: a transformers test tree newer or older than the installed transformers may import
``transformers.testing_utils._TEXT_MODEL_TESTER_DEFAULTS`` (the model testers' defaults,
present in some releases only); when the installed package lacks it, the values of the
5.16 tree are put there.
"""

from __future__ import annotations

import os

_TEXT_MODEL_TESTER_DEFAULTS = {
    "batch_size": 13,
    "seq_length": 7,
    "is_training": True,
    "use_input_mask": True,
    "use_labels": True,
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "expert_interval": 1,
    "moe_layer_start_index": 0,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 36,
    "shared_expert_gate": True,
    "moe_num_shared_experts": 2,
    "num_experts_per_tok": 2,
    "num_experts": 8,
}

def _shim_testing_utils() -> None:
    import transformers.testing_utils as tu

    if not hasattr(tu, "_TEXT_MODEL_TESTER_DEFAULTS"):
        tu._TEXT_MODEL_TESTER_DEFAULTS = dict(_TEXT_MODEL_TESTER_DEFAULTS)


def _force_attention() -> None:
    from transformers import PreTrainedModel

    from kvarena.integrations import hf

    hf.register()
    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "_kvarena_forced", False):
        return

    def get_correct_attn_implementation(self, requested_attention=None, is_init_check=False):
        if requested_attention is None or (requested_attention == "sdpa" and getattr(self, "_supports_sdpa", False)):
            return hf.NAME
        return original(self, requested_attention, is_init_check)

    get_correct_attn_implementation._kvarena_forced = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def _force_cache() -> None:
    from transformers.cache_utils import DynamicCache
    from transformers.generation.utils import GenerationMixin

    from kvarena.integrations.hf import KVArenaCache

    original = GenerationMixin._prepare_cache_for_generation
    if getattr(original, "_kvarena_forced", False):
        return

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        user_defined = model_kwargs.get("cache") is not None
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        made = model_kwargs.get("cache")
        if (
            not user_defined
            and type(made) is DynamicCache
            and generation_config.cache_implementation in (None, "dynamic")
            and not generation_config.is_assistant
            and getattr(self.config, "_attn_implementation", None) == "kvarena"
        ):
            model_kwargs["cache"] = KVArenaCache(self.config.get_text_config(decoder=True))
        return result

    _prepare_cache_for_generation._kvarena_forced = True
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation


def pytest_configure(config) -> None:
    _shim_testing_utils()
    if os.environ.get("KVARENA_HF_FORCE") == "1":
        _force_attention()
        if os.environ.get("KVARENA_HF_CACHE") == "kvarena":
            _force_cache()
