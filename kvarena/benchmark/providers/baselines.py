"""The baseline providers: SDPA (gathered or contiguous, a forced backend), a device copy,
FlexAttention, FlashAttention, FlashInfer, and the store floors (``copy_``, Self-Forcing's
shift-left window)."""

from __future__ import annotations

import contextlib
import warnings

import torch

from kvarena.benchmark.cases import Case
from kvarena.benchmark.providers.data import Bench, CaseData, Skip, _train_inputs, work_of


def _sdpa_train(case: Case, data: CaseData) -> Bench:
    import torch.nn.functional as F

    b, t = case.batch, case.chunk
    q, own_k, own_v, do = _train_inputs(case, data)
    hist = (case.sinks + case.window - 1) * case.chunk
    kh, vh = (x[:, :, :hist].detach() for x in data.contiguous())  # [B, H_kv, hist, D], constants
    backend = "flash" if data.device.type == "cuda" else None

    def fn():
        kk = torch.cat([kh, own_k.transpose(1, 2)], 2)  # [B, H_kv, hist + T, D]
        vv = torch.cat([vh, own_v.transpose(1, 2)], 2)
        qs = q.view(b, t, case.h_q, case.head_dim).transpose(1, 2)
        with _sdpa_ctx(backend):
            out = F.scaled_dot_product_attention(qs, kk, vv, enable_gqa=case.h_q != case.h_kv)
        return torch.autograd.grad(out, (q, own_k, own_v), do.view(b, t, case.h_q, case.head_dim).transpose(1, 2))[0]

    return Bench(fn, note=f"{backend or 'default'} SDPA fwd + bwd, history gathered once (untimed)")


_SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH",
                  "cudnn": "CUDNN_ATTENTION"}


def _sdpa_ctx(backend: str | None):
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _SDPA_BACKENDS[backend])])


def _sdpa(case: Case, data: CaseData, *, gather: bool, backend: str | None) -> Bench:
    import torch.nn.functional as F

    if case.kind == "store":
        raise Skip("not a store provider")
    if backend in ("cudnn", "efficient") and data.device.type != "cuda":
        raise Skip(f"SDPA's {backend} backend needs CUDA")
    gqa = case.h_q != case.h_kv
    q = data.q_sdpa()
    note = f"{backend} backend forced" if backend else "default SDPA dispatch"
    if not gather:
        k, v = data.contiguous()
        if gqa and backend in ("flash", "cudnn"):
            # Heads expanded once (untimed) rather than relying on enable_gqa support of a
            # forced backend, which varies by version: the same attention, the same reads.
            group = case.h_q // case.h_kv
            k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
            gqa, note = False, note + ", GQA heads expanded beforehand"

    def fn():
        kk, vv = (data.gather(data.k_cache), data.gather(data.v_cache)) if gather else (k, v)
        with _sdpa_ctx(backend):
            # Every key is visible in both kinds (decode's one query is the last position;
            # a chunk sees sinks + window + itself fully), so no mask and no causal flag.
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)

    return Bench(fn, to_ref=data.from_sdpa, note=note)


def _copy(case: Case, data: CaseData) -> Bench:
    if case.kind != "decode":
        raise Skip("decode cases only")
    half = int(work_of(case)["kv_bytes"]) // 2
    src = torch.empty(half, dtype=torch.uint8, device=data.device).fill_(1)
    dst = torch.empty_like(src)

    def fn():
        dst.copy_(src)

    return Bench(fn, to_ref=lambda out: None,
                 note=f"copy_ of {half / 2**20:.1f} MiB: read + write = the K/V bytes the step reads")


_FLEX = {}


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention  # eager: unfused, materializes the scores (no C++ build on CPU)
    if "cuda" not in _FLEX:
        # Default (automatic) dynamic shapes: the second shape recompiles with dynamic
        # sizes, later ones reuse it, so a sweep pays ~2 compiles rather than one per shape.
        _FLEX["cuda"] = torch.compile(flex_attention)
    return _FLEX["cuda"]


def _flex(case: Case, data: CaseData, *, gather: bool) -> Bench:
    if case.kind == "store":
        raise Skip("not a store provider")
    try:
        flex = _flex_fn(data.device)
    except ImportError as exc:
        raise Skip(f"FlexAttention unavailable: {exc}") from exc
    gqa = case.h_q != case.h_kv
    q = data.q_sdpa()
    if not gather:
        k, v = data.contiguous()

    def fn():
        kk, vv = (data.gather(data.k_cache), data.gather(data.v_cache)) if gather else (k, v)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile()" on CPU, once per call
            return flex(q, kk, vv, enable_gqa=gqa)

    note = "torch.compile" if data.device.type == "cuda" else "eager (unfused, CPU)"
    return Bench(fn, to_ref=data.from_sdpa, note=note)


def _flash_attn(case: Case, data: CaseData) -> Bench:
    if case.kind == "store":
        raise Skip("not a store provider")
    if data.device.type != "cuda":
        raise Skip("flash_attn needs CUDA")
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as exc:
        raise Skip(f"flash_attn not installed ({exc})") from exc
    b = data.block_table.shape[0]
    q = data.q.view(b, data.q_len, case.h_q, case.head_dim)
    if case.page % 256 == 0:
        def fn():
            return flash_attn_with_kvcache(q, data.k_cache, data.v_cache, cache_seqlens=data.seq_lens,
                                           block_table=data.block_table, causal=False)
        note = "paged"
    else:
        k, v = data.contiguous()
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, L, H_kv, D], as flash_attn wants

        def fn():
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=data.seq_lens, causal=False)
        note = "contiguous KV (paged needs page % 256 == 0)"
    return Bench(fn, to_ref=lambda out: out.reshape(data.q.shape), note=note)


def _flashinfer(case: Case, data: CaseData) -> Bench:
    if case.kind == "store":
        raise Skip("not a store provider")
    if data.device.type != "cuda":
        raise Skip("flashinfer needs CUDA")
    try:
        import flashinfer
    except ImportError as exc:
        raise Skip(f"flashinfer not installed ({exc})") from exc
    b, per_seq = data.block_table.shape
    dev = data.device
    indptr = torch.arange(0, (b + 1) * per_seq, per_seq, dtype=torch.int32, device=dev)
    indices = data.block_table.reshape(-1).contiguous()
    last = case.kv_tokens - (per_seq - 1) * case.page
    last_len = torch.full((b,), last, dtype=torch.int32, device=dev)
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    dt = data.q.dtype
    if case.kind == "decode":
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        args = (indptr, indices, last_len, case.h_q, case.h_kv, case.head_dim, case.page)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        args = (data.cu_seqlens_q, indptr, indices, last_len, case.h_q, case.h_kv, case.head_dim, case.page)
    try:
        extra = {} if case.kind == "decode" else {"causal": False}
        w.plan(*args, q_data_type=dt, kv_data_type=dt, **extra)
    except TypeError:  # flashinfer < 0.2 names it data_type
        w.plan(*args, data_type=dt, **({} if case.kind == "decode" else {"causal": False}))

    def fn():
        return w.run(data.q, (data.k_cache, data.v_cache))

    return Bench(fn, note="paged, NHD")


def _store_copy(case: Case, data: CaseData) -> Bench:
    if case.kind != "store":
        raise Skip("store cases only")
    slab = int(data.block_table[0, -1])
    kc, vc = data.k_cache[slab], data.v_cache[slab]

    def fn():
        kc.copy_(data.new_k.view_as(kc))
        vc.copy_(data.new_v.view_as(vc))
        return kc

    return Bench(fn, to_ref=lambda out: out.reshape(data.new_k.shape), note="contiguous copy: the floor")


def _store_shift_left(case: Case, data: CaseData) -> Bench:
    if case.kind != "store":
        raise Skip("store cases only")
    from kvarena.benchmark.shift_left import ShiftLeftKVCache

    cache = ShiftLeftKVCache(1, case.batch, case.chunk, window=case.window, sinks=case.sinks,
                             num_kv_heads=case.h_kv, head_dim=case.head_dim, dtype=data.new_k.dtype,
                             device=data.device)
    # Fill the window once (untimed) so that every timed call takes the shifting branch.
    k = data.new_k.view(case.batch, case.chunk, case.h_kv, case.head_dim)
    v = data.new_v.view_as(k)
    for _ in range(case.sinks + case.window):
        cache.store(k, v, 0)

    def fn():
        cache.store(k, v, 0)
        return cache.k[0][:, -case.chunk:]

    rolled = (case.window - 1) * case.chunk
    return Bench(fn, to_ref=lambda out: out.reshape(data.new_k.shape),
                 note=f"clones {rolled} retained tokens per K and V per chunk")


def _contiguous(c: Case, d: CaseData) -> Bench:
    if c.kind == "train":
        return _sdpa_train(c, d)
    # Chunks: the flash backend on CUDA (docs/contract.md's target), the default dispatch
    # on CPU (the CPU flash kernel when it applies) and for decode.
    flash = d.device.type == "cuda" and c.kind == "chunk"
    return _sdpa(c, d, gather=False, backend="flash" if flash else None)
