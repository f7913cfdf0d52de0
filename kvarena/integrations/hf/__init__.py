"""Hugging Face ``transformers`` (>= 5) on kvarena's attention.

:func:`register` adds the attention implementation ``"kvarena"`` and its mask hook, so any
decoder whose attention goes through ``transformers.AttentionInterface`` runs kvarena's
block-table attention (Triton on CUDA, the PyTorch path on CPU)::

    from kvarena.integrations import hf
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvarena")
    # or: model.set_attn_implementation("kvarena")
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

With transformers' own cache, the dense K/V ``[B, H_kv, L, D]`` a layer hands over is
attended in place as a paged cache with one block per row (a strided view: nothing is
copied); left padding becomes ``kv_start``. Any other 2-D padding mask (right padding,
holes) is unpadded as flash_attention_2 does: each row's real keys gathered, its real
queries packed, or, where that reading would differ from eager (a hole inside a sliding
window, padding queries that eager attends too), one sequence per query (see
:func:`_unpad`). Options map one to one: ``scaling`` -> ``scale``, ``sliding_window=W`` ->
``window_left=W - 1`` (HF's window sees ``kv > q - W``), ``softcap`` -> ``softcap``,
gpt-oss's ``s_aux`` -> ``sink_logits``.

Packed sequences (``position_ids`` restarting inside a row, no padding mask and no cache:
transformers folds them into the mask) are one kvarena sequence each (``kv_start`` its
first token, see :func:`.mask._segments_of`).

4-D masks (boolean, True = attend, or additive) reach the attention function as given:
read into kvarena sequences where each query row sees one interval of keys, else served
by the exact masked path (:mod:`.masked`). A static cache (``StaticCache``) is attended
over its slots that hold tokens, and its compiled decode step (``generate(...,
compile_config=...)``) traces without a graph break: nothing is read on the host under
``torch.compile`` (docs/hf.md says which input takes which path).

What it cannot serve is an error whose message starts with ``kvarena:`` and names it,
never a silent fallback to another implementation: mask functions that need vmap
(``or_mask_function`` / ``and_mask_function``), packed sequences transformers did not fold
into the mask (a cache, a padding mask, or a model such as gpt-oss that does not pass
``position_ids`` to its mask), a 4-D mask with :class:`KVArenaCache`,
``output_attentions=True``, dropout while training.

The modules: :mod:`.mask` (the mask hook), :mod:`.attention` (the attention function),
:mod:`.masked` (4-D masks and the masked path), :mod:`.cache` (:class:`KVArenaCache`),
:mod:`.layers` (its per-layer view) and :mod:`.positions` (which of its positions hold a
stored token: what ``crop`` counts by); this package registers them (:func:`register`).
"""

from __future__ import annotations

from kvarena.attention.spec import check_backend
from kvarena.integrations.hf._common import NAME
from kvarena.integrations.hf.attention import kvarena_attention
from kvarena.integrations.hf.cache import DEFAULT_MAX_TOKENS_PER_ROW, KVArenaCache  # noqa: F401
from kvarena.integrations.hf.mask import kvarena_mask

__all__ = ["KVArenaCache", "register", "kvarena_attention", "kvarena_mask"]


def register(*, backend: str = "auto") -> None:
    """Register ``"kvarena"`` with transformers' attention and mask interfaces (idempotent).

    ``backend``: kvarena's (``"auto"``: Triton on CUDA, the PyTorch path on CPU; a later
    call with another value replaces the registration).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_backend(backend)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return kvarena_attention(module, query, key, value, attention_mask, backend=backend, **kwargs)

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, kvarena_mask)
