"""Negative controls: kvarena's vLLM backend with one thing wrong, which the lane must catch."""

from __future__ import annotations

import dataclasses

from kvarena.integrations.vllm import backend as kv


class _NoWindowImpl(kv.KVArenaAttentionImpl):
    """Attends every key: the layer's sliding window is dropped."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = dataclasses.replace(self.options, window_left=None)


class _NoSeqLensBuilder(kv.KVArenaMetadataBuilder):
    """Every sequence attends as many keys as the step's shortest one has (``seq_lens`` ignored)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
        lens = md.seq_lens.min().clamp(min=1) + q_lens - q_lens.min()
        lens = lens.clamp(max=md.seq_lens).to(md.seq_lens.dtype)
        return dataclasses.replace(md, seq_lens=lens)


class NoWindowBackend(kv.KVArenaAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return _NoWindowImpl


class NoSeqLensBackend(kv.KVArenaAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return _NoSeqLensBuilder


BACKENDS = {"no-window": "broken.NoWindowBackend", "no-seq-lens": "broken.NoSeqLensBackend"}
