"""``KVArenaAttentionBackend``: kvarena's store and paged attention inside vLLM's v1 engine.

vLLM hands every layer a view ``[num_blocks, H_kv, block_size, 2 * D]`` of one buffer
that backs all layers; its last dim holds a token's key then its value, so
``kv_cache.transpose(1, 2)[..., :D]`` and ``[..., D:]`` are exactly the strided
``[num_blocks, block_size, H_kv, D]`` caches kvarena's ops take (no copy, any of vLLM's
layouts). Per step the metadata builder keeps what vLLM already planned (``query_start_loc``,
``seq_lens``, ``block_table``, the host bounds of the query and key lengths); per layer the
impl only calls :func:`kvarena.store_kv` (``do_kv_cache_update``) and
:func:`kvarena.paged_attention` over the whole step, prefill and decode rows in one call
(queries bottom-right aligned to ``seq_lens``, which is vLLM's convention).

CUDA graphs: the builder declares ``AttentionCGSupport.NEVER``. kvarena plans a launch
(tile, split-K) from the step's host lengths, which a captured graph would freeze, so vLLM
keeps attention out of its graphs (piecewise graphs still cover the rest of the model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from kvarena import __version__, paged_attention, store_kv
from kvarena.integrations.vllm import support
from kvarena.integrations.vllm.support import Unsupported

__all__ = ["KVArenaAttentionBackend", "KVArenaMetadata", "KVArenaMetadataBuilder", "KVArenaAttentionImpl",
           "log_registered"]

#: a ``vllm.*`` logger: vLLM's handler prints it in vLLM's format, in every engine process.
logger = logging.getLogger("vllm.kvarena")


def log_registered(cpu: bool) -> None:
    slots = "CUSTOM and CPU_ATTN (KVARENA_VLLM_CPU=1)" if cpu else "CUSTOM"
    logger.debug("kvarena %s registered KVArenaAttentionBackend for vLLM's %s attention backend slot", __version__, slots)


class KVArenaAttentionBackend(AttentionBackend):
    """kvarena's paged attention as a vLLM v1 attention backend (``--attention-backend CUSTOM``)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = list(support.MODEL_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *support.FP8_KV_DTYPES]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[KVArenaAttentionImpl]:
        return KVArenaAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVArenaMetadataBuilder]:
        return KVArenaMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Any block size works; 16 keeps a block a whole number of key tiles' rows.
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(support.HEAD_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return support.supports_head_size(head_size)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass(frozen=True, eq=False)
class KVArenaMetadata(AttentionMetadata):
    """One step's keys and query rows as vLLM planned them (int32 tensors on the device).

    ``max_query_len`` / ``max_seq_len`` are vLLM's host bounds, so no layer reads a length
    back from the device.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int


class KVArenaMetadataBuilder(AttentionMetadataBuilder[KVArenaMetadata]):
    """Once per step: vLLM's common metadata as :class:`KVArenaMetadata` (nothing copied)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        support.check_head_size(kv_cache_spec.head_size, getattr(kv_cache_spec, "head_size_v", None))
        if getattr(vllm_config.model_config, "is_mm_prefix_lm", False):
            raise Unsupported("kvarena: bidirectional multimodal prefixes (PrefixLM models) are not served")
        layers = _attention_layers(vllm_config, layer_names)
        for name, layer in layers.items():
            if support.check_kv_dtype(layer.kv_cache_dtype, vllm_config.model_config.dtype):
                support.check_kv_scale(f"{name}._k_scale", layer._k_scale)
                support.check_kv_scale(f"{name}._v_scale", layer._v_scale)
        logger.info("Using KVArenaAttentionBackend (kvarena %s) for %d attention layers, block size %d, KV cache %s",
                    __version__, len(layer_names), kv_cache_spec.block_size,
                    vllm_config.cache_config.cache_dtype)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVArenaMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise Unsupported("kvarena: non-causal decoder attention is not served")
        return KVArenaMetadata(
            num_actual_tokens=m.num_actual_tokens, query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
            block_table=m.block_table_tensor, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
        )


def _attention_layers(vllm_config: VllmConfig, layer_names: list[str]) -> dict[str, Attention]:
    layers = vllm_config.compilation_config.static_forward_context
    return {name: layers[name] for name in layer_names if isinstance(layers.get(name), Attention)}


def cache_views(kv_cache: torch.Tensor, head_size: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``[num_blocks, H_kv, block_size, 2 * D]`` layer cache as kvarena's K and V caches."""
    if fp8 and kv_cache.dtype == torch.uint8:  # vLLM allocates fp8 caches as bytes
        kv_cache = kv_cache.view(torch.float8_e4m3fn)
    kv = kv_cache.transpose(1, 2)
    return kv[..., :head_size], kv[..., head_size:]


class KVArenaAttentionImpl(AttentionImpl[KVArenaMetadata]):
    """One layer: its options are checked and fixed here; ``forward`` only calls the ops."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **extra) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.dcp_world_size > 1 or self.pcp_world_size > 1:
            raise Unsupported("kvarena: decode / prefill context parallelism is not served")
        self.options = support.layer_options(
            head_size=head_size, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
            alibi_slopes=alibi_slopes, sliding_window=sliding_window, kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=logits_soft_cap, attn_type=attn_type,
            model_dtype=get_current_vllm_config().model_config.dtype, extra=extra)
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise Unsupported(f"kvarena: sinks must hold one logit per query head ({num_heads}), got {tuple(sinks.shape)}")
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, float(scale), num_kv_heads
        self.sliding_window, self.logits_soft_cap, self.attn_type = sliding_window, logits_soft_cap, attn_type
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self.sink_logits: torch.Tensor | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """The learned sinks as the fp32 logits kvarena takes, refreshed after every weight load."""
        self.sink_logits = None if self.sinks is None else self.sinks.detach().to(torch.float32).contiguous()

    def _scales(self, layer) -> dict[str, torch.Tensor]:
        return {"k_scale": layer._k_scale, "v_scale": layer._v_scale} if self.options.fp8 else {}

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KVArenaMetadata | None, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise Unsupported("kvarena: fused output quantization is not served")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        if self.sinks is not None and self.sink_logits is None:
            self.process_weights_after_loading(query.dtype)
        md, n, o = attn_metadata, attn_metadata.num_actual_tokens, self.options
        k_cache, v_cache = cache_views(kv_cache, self.head_size, o.fp8)
        paged_attention(
            query[:n], k_cache, v_cache, md.block_table, md.seq_lens, md.query_start_loc,
            scale=o.scale, window_left=o.window_left, softcap=o.softcap, sink_logits=self.sink_logits,
            max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len, out=output[:n], **self._scales(layer),
        )
        return output

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        n = slot_mapping.shape[0]
        k_cache, v_cache = cache_views(kv_cache, self.head_size, self.options.fp8)
        store_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping, **self._scales(layer))
