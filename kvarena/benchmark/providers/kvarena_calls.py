"""The ``kvarena`` providers: the per-layer call the pools make, with the spec and path
they launch (decode, slab chunk steps, a pool's own forward, a training step)."""

from __future__ import annotations

import torch

from kvarena.benchmark.cases import Case
from kvarena.benchmark.providers.data import Bench, CaseData, Skip, _newest_slab, _train_inputs


def _kvarena(case: Case, data: CaseData, *, plain: bool = False, backend: str = "auto") -> Bench:
    from kvarena.attention import dispatch, ops
    from kvarena.attention.backend import resolve_backend
    from kvarena.attention.batch import CacheView

    # Timed as the pools call it per layer: the public op runs once here (its checks, which
    # read the lengths and the block table, reject bad data before anything is timed), then
    # the trusted op with the validated spec and backend, as FlashInfer's run() after plan().
    # The overhead table reports what the public op's checks add per call.
    if case.kind == "store":
        slab = int(data.block_table[0, -1])  # the slot a ring would recycle next
        slots = (slab * case.chunk + torch.arange(case.chunk, device=data.device)).to(torch.int32)
        ops.store_kv(data.new_k, data.new_v, data.k_cache, data.v_cache, slots, backend=backend)
        store_backend = resolve_backend(backend, data.device, data.k_cache.dtype, False, what="k_cache")
        cache = CacheView(data.k_cache, data.v_cache)

        def fn():
            dispatch.store(data.new_k, data.new_v, cache, slots, store_backend)
            return data.k_cache[slab]

        return Bench(fn, to_ref=lambda out: out.reshape(data.new_k.shape), note="per-layer call (checked once)")
    if case.kind == "train":
        return _kvarena_train(case, data, backend)
    if data.pool_step is not None:
        # backend="auto" passes no option: the layer's own spec, as a model's forward calls it.
        options = {} if backend == "auto" else {"backend": backend}
        data.pool_step(**options)  # checked once (a refused backend raises here)
        return Bench(lambda: data.pool_step(**options),
                     note=f"PagedKVCache.forward, layer {case.layers - 1} of {case.layers}")
    call = _ChunkCall(case, data, plain) if case.kind == "chunk" else _DecodeCall(case, data, plain)
    call.check(backend)
    call.backend = resolve_backend(backend, data.device, data.q.dtype, False)
    return Bench(call.run, note=call.note)


class _DecodeCall:
    """The per-layer attention of a decode step, as ``PagedKVCache.forward`` attends."""

    def __init__(self, case: Case, data: CaseData, plain: bool) -> None:
        from kvarena.attention.batch import CacheView, KeySet, QueryRows
        from kvarena.attention.spec import AttentionSpec

        self.spec, self.note = AttentionSpec(), "per-layer call (checked once)"
        b = data.block_table.shape[0]
        self.cu = torch.arange(b + 1, dtype=torch.int32, device=data.device)
        self.kw = dict(max_seqlen_q=1, max_seqlen_k=case.kv_tokens)
        self.args = (data.q, data.k_cache, data.v_cache, data.block_table, data.seq_lens)
        self.scales = None
        if not plain and data.kv8 is not None:
            self.args = (data.q, data.kv8[0], data.kv8[1], data.block_table, data.seq_lens)
            self.scales = (data.kv8[2], data.kv8[3])
            self.note += ", fp8 KV + per-token scales"
        self.cache = CacheView(self.args[1], self.args[2], self.scales)
        self.keys = KeySet(data.block_table, data.seq_lens, case.kv_tokens)
        self.rows = QueryRows(self.cu, 1)
        self.backend = "auto"

    def check(self, backend: str) -> None:
        from kvarena.attention import ops

        fp8 = {} if self.scales is None else dict(k_scale=self.scales[0], v_scale=self.scales[1])
        ops.paged_attention(*self.args, self.cu, **self.kw, **fp8, backend=backend)

    def run(self):
        from kvarena.attention import dispatch

        return dispatch.attend(self.q, self.cache, self.keys, self.rows, spec=self.spec, backend=self.backend)

    @property
    def q(self):
        return self.args[0]


class _ChunkCall:
    """One step of a slab chunk, with the spec and path ``SlabKVCache.forward`` launches.

    ``commit``: the chunk's K/V stored into its slab (the newest one here, so the values
    stay what the others read), then non-causal attention over every visible slab.
    ``denoise``: the history (all slabs but the newest) from the arena and the newest
    slab's keys as the step's own K/V, one launch. ``guarded``: the block-causal
    functional op over the same keys (``chunk_size=chunk``).
    """

    def __init__(self, case: Case, data: CaseData, plain: bool) -> None:
        from kvarena.attention.spec import AttentionSpec

        self.case, self.data, self.step = case, data, case.step
        self.spec = AttentionSpec(causal=False)  # what SlabKVCache.forward passes the op
        if self.step == "guarded":
            self.spec = AttentionSpec(chunk_size=case.chunk)
        self.note = {"commit": "SlabKVCache.forward(commit=True): store + attend",
                     "denoise": "SlabKVCache.forward(commit=False): history + own k/v",
                     "guarded": "paged_attention(chunk_size=chunk): the guarded page path"}[self.step]
        self.q, self.k_cache, self.v_cache = data.q, data.k_cache, data.v_cache
        self.own, self.scales = data.own, None
        if data.rope is not None and not plain:
            self.q, self.k_cache, cos, sin = data.rope
            self.spec = self.spec.replace(rope_cos=cos, rope_sin=sin, rope_interleaved=True)
            self.note += ", RoPE on read (un-rotated keys)"
        elif data.rope is not None:  # kvarena_plain: the rotated keys the others read
            self.own, _ = _newest_slab(case, data.block_table, data.k_cache, data.v_cache)
        if data.kv8 is not None and not plain:
            self.k_cache, self.v_cache = data.kv8[0], data.kv8[1]
            self.scales = (data.kv8[2], data.kv8[3])
            self.note += ", fp8 history + per-token scales"
        b, page, t = data.block_table.shape[0], data.k_cache.shape[1], case.chunk
        self.hist = case.kv_tokens - t
        self.hist_table = data.block_table[:, : self.hist // page].contiguous()
        self.hist_lens = torch.full((b,), self.hist, dtype=torch.int32, device=data.device)
        self.own_table = torch.arange(b, dtype=torch.int32, device=data.device)[:, None]
        self.own_lens = torch.full((b,), t, dtype=torch.int32, device=data.device)
        self.own_flat = tuple(x.reshape(b * t, *x.shape[2:]) for x in self.own)
        self._seam(b, t)
        self.backend = "auto"

    def _seam(self, b: int, t: int) -> None:
        """The typed metadata the pool's plan would build for this step."""
        from kvarena.attention.batch import CacheView, KeySet, OwnKeys, QueryRows

        d = self.data
        q_pos = own_shift = None
        if self.spec.rope_cos is not None:
            # Virtual positions, as the pool plans them: the chunk's queries and its own keys
            # continue after the history (history key t at table row t).
            q_pos = torch.full((b,), self.hist, dtype=torch.int32, device=d.device)
            own_shift = q_pos[:, None].contiguous()
        self.cache = CacheView(self.k_cache, self.v_cache, self.scales)
        self.rows = QueryRows(d.cu_seqlens_q, t, q_pos)
        self.hist_keys = KeySet(self.hist_table, self.hist_lens, self.hist)
        self.all_keys = KeySet(d.block_table, d.seq_lens, self.case.kv_tokens)
        self.own_keys = OwnKeys(*self.own, KeySet(self.own_table, self.own_lens, t, None, own_shift))

    def check(self, backend: str) -> None:
        from kvarena.attention import ops

        if self.scales is not None and self.step == "commit":
            raise ValueError("chunk case: an fp8 cache is benchmarked as a denoising step (the pool stores the "
                             "commit's clean keys quantized; the others would read other values)")
        d = self.data
        fp8 = {} if self.scales is None else dict(k_scale=self.scales[0], v_scale=self.scales[1])
        rope = {} if self.spec.rope_cos is None else dict(rope_cos=self.spec.rope_cos, rope_sin=self.spec.rope_sin,
                                                          rope_interleaved=True)
        ops.paged_attention(self.q, self.k_cache, self.v_cache, d.block_table, d.seq_lens, d.cu_seqlens_q,
                            chunk_size=self.spec.chunk_size, causal=self.spec.causal, max_seqlen_q=self.case.chunk,
                            max_seqlen_k=self.case.kv_tokens, backend=backend, **fp8, **rope)
        if self.step == "commit":
            ops.store_kv(*self.own_flat, self.k_cache, self.v_cache, d.own_slots, backend=backend)

    def run(self):
        from kvarena.attention import dispatch

        if self.step == "denoise":
            return dispatch.attend(self.q, self.cache, self.hist_keys, self.rows, spec=self.spec,
                                   backend=self.backend, own=self.own_keys)
        if self.step == "commit":
            dispatch.store(*self.own_flat, self.cache, self.data.own_slots, self.backend)
        return dispatch.attend(self.q, self.cache, self.all_keys, self.rows, spec=self.spec, backend=self.backend)


def _kvarena_plain(case: Case, data: CaseData, backend: str = "auto") -> Bench:
    if data.kv8 is None and data.rope is None:
        raise Skip("fp8 and RoPE-on-read cases only")
    b = _kvarena(case, data, plain=True, backend=backend)
    what = f"the {case.dtype} copy of the same values" if data.kv8 is not None else "keys rotated beforehand"
    return Bench(b.fn, note=f"kvarena on {what}")


def _kvarena_train(case: Case, data: CaseData, backend: str = "auto") -> Bench:
    from kvarena.attention import dispatch
    from kvarena.attention.backend import resolve_backend
    from kvarena.attention.batch import CacheView, KeySet, OwnKeys, QueryRows
    from kvarena.attention.spec import AttentionSpec

    b, t = case.batch, case.chunk
    q, own_k, own_v, do = _train_inputs(case, data)
    hist_table = data.block_table[:, :-1].contiguous()  # the last page stands for the own keys
    hist = (case.sinks + case.window - 1) * case.chunk
    hist_lens = torch.full((b,), hist, dtype=torch.int32, device=data.device)
    cu = data.cu_seqlens_q
    spec = AttentionSpec(causal=False)  # a slab step sees its whole history and itself
    backend = resolve_backend(backend, data.device, q.dtype, True, triton_grad=True)
    dense_table = torch.arange(b, dtype=torch.int32, device=data.device)[:, None]
    own_lens = torch.full((b,), t, dtype=torch.int32, device=data.device)
    cache, keys, rows = CacheView(data.k_cache, data.v_cache), KeySet(hist_table, hist_lens, hist), QueryRows(cu, t)

    def fn():  # what SlabKVCache.forward(commit=False) runs
        own = OwnKeys(own_k, own_v, KeySet(dense_table, own_lens, t))
        out = dispatch.attend(q, cache, keys, rows, spec=spec, backend=backend, own=own)
        return torch.autograd.grad(out, (q, own_k, own_v), do)[0]

    note = "Triton fwd + bwd" if backend == "triton" else "torch path fwd + autograd"
    return Bench(fn, note=note)
