"""Provider implementations: the data of a case and one callable per provider.

Every provider of a case reads the *same* tensors: one arena of K/V pages with the
sequence's pages scattered at random (``make_data``). A provider is built once per case
by ``build(provider, case, data)``, which returns a :class:`Bench`: ``fn()`` is what gets
timed, ``to_ref(out)`` turns its result into kvarena's layout for the correctness check
(outside the timing). ``build`` raises :class:`Skip` with a reason when a provider cannot
run here (library not installed, backend refused, ...).

What each provider times
------------------------
kvarena
    The per-layer call the pools make, with the spec and path the pool launches: decode
    as ``PagedKVCache.forward`` attends (``dispatch.attend``); a chunk's ``commit`` step as
    ``SlabKVCache.forward(commit=True)`` (``dispatch.store`` of the chunk into its slab,
    then ``dispatch.attend`` non-causal over the visible slabs), its ``denoise`` step as
    ``forward(commit=False)`` (``dispatch.attend`` with the step's own K/V after the
    history: one launch); ``guarded`` chunks as ``paged_attention(chunk_size=chunk)``.
    Triton on CUDA (or with ``backend="triton"`` under the interpreter), the PyTorch path
    on CPU. The public op runs once, untimed, to check the data (as FlashInfer's ``plan``
    before the timed ``run``); the overhead table (:mod:`kvarena.benchmark.overhead`)
    reports what its checks cost per call. Host maxima are passed, so the call never reads
    the device. ``-pool<L>`` decode cases time ``PagedKVCache.forward`` itself on the last
    layer of a real ``L``-layer arena (checks, store and attend).
gather_sdpa[_flash|_efficient]
    Gather the block table's pages into contiguous K/V (``index_select``), then
    ``scaled_dot_product_attention``; the suffixed ones force one backend through
    ``torch.nn.attention.sdpa_kernel``. The gather is timed: it is what a framework
    without a paged kernel pays.
sdpa_contiguous
    SDPA on K/V that are already contiguous (gathered once, untimed): docs/contract.md's 0.9x
    target baseline for chunk attention, where CUDA forces the flash backend; decode takes
    SDPA's own dispatch. GQA heads are expanded beforehand (untimed) where a forced backend
    cannot take them.
sdpa_cudnn
    The same with the cuDNN backend (CUDA only).
copy (decode)
    ``dst.copy_(src)`` of half the K/V bytes the step reads: as many bytes moved (read +
    write) as the step reads, so ``copy time / kvarena time`` is the fraction of this run's
    copy bandwidth.
gather_flex, flex_contiguous
    FlexAttention (compiled on CUDA, eager on CPU where it materializes the scores).
flash_attn
    ``flash_attn_with_kvcache`` when importable: paged when the page is a multiple of
    256 tokens (FlashAttention-2's requirement), else on the contiguous K/V.
flashinfer
    FlashInfer's paged decode / prefill wrappers on the same arena (NHD layout).
copy_, shift_left (store cases)
    ``slab.copy_(k)``: the floor for writing one chunk. ``shift_left``: Self-Forcing's
    window buffer (see :mod:`kvarena.benchmark.recycle`): clone the retained non-sink
    tokens one chunk to the left, then write the new chunk at the end.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvarena.benchmark.cases import Case

__all__ = ["Skip", "Bench", "CaseData", "make_data", "build", "work_of", "rel_err"]


class Skip(Exception):
    """A provider that cannot run here; ``str(exc)`` is the reason for the report."""


@dataclass
class Bench:
    """A built provider.

    Attributes
    ----------
    fn : callable
        The timed call; returns the provider's raw output.
    to_ref : callable
        Maps ``fn()``'s output to kvarena's layout (untimed, for the error check).
    note : str
        Shown in the report (e.g. "contiguous KV (paged needs page % 256 == 0)").
    """

    fn: Callable[[], Any]
    to_ref: Callable[[Any], torch.Tensor] = lambda out: out
    note: str = ""


@dataclass
class CaseData:
    """The tensors every provider of one case reads.

    Attributes
    ----------
    q : ``[total_q, H_q, D]`` (decode: one row per sequence; chunk: ``batch * chunk``).
    k_cache, v_cache : ``[num_pages, page, H_kv, D]`` arena views.
    block_table : int32 ``[B, pages_per_seq]`` (random page order).
    seq_lens : int32 ``[B]``; cu_seqlens_q : int32 ``[B + 1]`` or None (decode).
    new_k, new_v : ``[B * chunk, H_kv, D]`` (store cases only).
    kv8 : ``(k_cache, v_cache, k_scale, v_scale)`` fp8 caches with per-token scales, or None
        (cases with ``kv_dtype``; ``k_cache``/``v_cache`` then hold the same values
        dequantized to the case's dtype, for the other providers).
    rope : ``(q, k_cache, cos, sin)`` un-rotated q and keys and the interleaved table, or
        None (RoPE cases; ``q``/``k_cache`` then hold them rotated, for the other providers).
    own_kv : ``(k, v)`` each ``[B, chunk, H_kv, D]``: the newest slab's keys gathered
        (chunk cases): the step's own K/V of a denoising step, what a commit stores. RoPE
        cases: the un-rotated keys.
    own_slots : int32 ``[B * chunk]``: the arena slots of the newest slab (chunk cases).
    pool_step : the timed ``PagedKVCache.forward`` of a ``-pool<L>`` decode case (keyword
        arguments: the forward's per-call options).
    """

    case: Case
    device: torch.device
    q: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    new_k: torch.Tensor | None = None
    new_v: torch.Tensor | None = None
    kv8: tuple | None = None
    rope: tuple | None = None
    own_kv: tuple | None = None
    own_slots: torch.Tensor | None = None
    pool_step: Callable[..., torch.Tensor] | None = None
    _contig: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _bt_long: torch.Tensor | None = field(default=None, repr=False)

    @property
    def q_len(self) -> int:
        """Queries per sequence (1 for decode, the chunk otherwise)."""
        return 1 if self.case.kind == "decode" else self.case.chunk

    @property
    def bt_long(self) -> torch.Tensor:
        """The block table flattened as int64 (what ``index_select`` wants), built once."""
        if self._bt_long is None:
            self._bt_long = self.block_table.reshape(-1).long()
        return self._bt_long

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """Pages of every sequence copied contiguously: ``[B, H_kv, L, D]`` (a view of
        a ``[B, L, H_kv, D]`` tensor; the last dim stays contiguous, as SDPA needs)."""
        b = self.block_table.shape[0]
        _, page, h_kv, d = cache.shape
        g = cache.index_select(0, self.bt_long).view(b, -1, h_kv, d)
        return g[:, : self.case.kv_tokens].transpose(1, 2)

    def contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gathered once and kept (``[B, H_kv, L, D]``), for the contiguous baselines."""
        if self._contig is None:
            self._contig = (self.gather(self.k_cache), self.gather(self.v_cache))
        return self._contig

    def q_sdpa(self) -> torch.Tensor:
        """q as ``[B, H_q, q_len, D]`` (a view)."""
        b = self.block_table.shape[0]
        _, h_q, d = self.q.shape
        return self.q.view(b, self.q_len, h_q, d).transpose(1, 2)

    def from_sdpa(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, H_q, q_len, D]`` back to kvarena's ``[total_q, H_q, D]``."""
        return out.transpose(1, 2).reshape(self.q.shape)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"case dtype: expected a torch dtype name, got {name!r}")
    return dt


def make_data(case: Case, device: str | torch.device, *, seed: int = 0) -> CaseData:
    """Random data of one case on ``device``.

    The arena holds exactly the pages the batch needs plus one spare, shuffled: page
    ``i`` of sequence ``b`` sits at a random arena position, so a provider that silently
    assumed contiguity would read the wrong keys and show up in the error column.
    """
    device = torch.device(device)
    if case.layers:
        return _pool_data(case, device, seed)
    dtype = _dtype(case.dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, page, d = case.batch, case.page, case.head_dim
    if case.kind == "decode":
        pages_per_seq = -(-case.context // page)
    else:
        if case.chunk % page:
            raise ValueError(f"case {case.name}: page_tokens {page} must divide chunk {case.chunk}")
        pages_per_seq = (case.sinks + case.window) * (case.chunk // page)
    num_pages = b * pages_per_seq + 1
    perm = torch.randperm(num_pages, generator=gen)[: b * pages_per_seq]
    block_table = perm.view(b, pages_per_seq).to(torch.int32).to(device)

    def randn(*shape):
        # Generated on the device: 8 GiB of decode KV would take minutes through the host.
        return torch.randn(*shape, device=device, dtype=dtype)

    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    k_cache = randn(num_pages, page, case.h_kv, d)
    v_cache = randn(num_pages, page, case.h_kv, d)
    kv8 = None
    if case.kv_dtype:
        from kvarena.attention.fp8 import dequantize_fp8, fp8_row_scales, quantize_fp8

        if case.kv_dtype != "float8_e4m3fn":
            raise ValueError(f"case {case.name}: kv_dtype must be '' or 'float8_e4m3fn', got {case.kv_dtype!r}")
        parts = []
        for c in (k_cache, v_cache):
            sc = fp8_row_scales(c)
            parts.append((quantize_fp8(c, sc), sc))
        kv8 = (parts[0][0], parts[1][0], parts[0][1], parts[1][1])
        # The other providers read exactly the values kvarena stores, in the case's dtype.
        k_cache, v_cache = (dequantize_fp8(x, sc, torch.float32).to(dtype) for x, sc in parts)
    seq_lens = torch.full((b,), case.kv_tokens, dtype=torch.int32, device=device)
    if case.kind == "decode":
        q = randn(b, case.h_q, d)
        return CaseData(case, device, q, k_cache, v_cache, block_table, seq_lens, None, kv8=kv8)
    cu = torch.arange(0, (b + 1) * case.chunk, case.chunk, dtype=torch.int32, device=device)
    if case.kind == "chunk":
        q = randn(b * case.chunk, case.h_q, d)
        rope = None
        if case.rope:
            from kvarena.attention.reference import apply_rope
            from kvarena.attention.rope import rope_table

            cos, sin = (x.to(device) for x in rope_table(case.kv_tokens, d))
            rope = (q, k_cache, cos, sin)
            # Pre-rotated copies for the others: key t of a row at table row t (its index in
            # the row's visible keys: virtual positions), the chunk's queries at its last rows.
            pos = torch.arange(case.kv_tokens, device=device).view(-1, page)  # [pages_per_seq, page]
            k_rot = k_cache.clone()
            for row in range(b):
                ids = block_table[row].long()
                k_rot[ids] = apply_rope(k_cache[ids].float(), pos[:, :, None], cos, sin, True).to(dtype)
            qpos = torch.arange(case.kv_tokens - case.chunk, case.kv_tokens, device=device).repeat(b)
            q, k_cache = apply_rope(q.float(), qpos[:, None], cos, sin, True).to(dtype), k_rot
        own_kv, own_slots = _newest_slab(case, block_table, rope[1] if rope else k_cache, v_cache)
        return CaseData(case, device, q, k_cache, v_cache, block_table, seq_lens, cu, kv8=kv8, rope=rope,
                        own_kv=own_kv, own_slots=own_slots)
    if case.kind == "train":
        # The last page of each row stands for the step's own keys, given as new_k/new_v.
        q = randn(b * case.chunk, case.h_q, d)
        new_k, new_v = randn(b * case.chunk, case.h_kv, d), randn(b * case.chunk, case.h_kv, d)
        return CaseData(case, device, q, k_cache, v_cache, block_table, seq_lens, cu, new_k, new_v)
    new_k = randn(b * case.chunk, case.h_kv, d)
    new_v = randn(b * case.chunk, case.h_kv, d)
    return CaseData(case, device, None, k_cache, v_cache, block_table, seq_lens, cu, new_k, new_v)


def _newest_slab(case: Case, block_table, k_cache, v_cache):
    """The newest slab of every row (its last ``chunk`` keys): ``((k, v), slots)``, the
    keys ``[B, chunk, H_kv, D]`` gathered contiguous and their arena slots ``[B * chunk]``."""
    b, page = block_table.shape[0], k_cache.shape[1]
    pages = block_table[:, -(case.chunk // page):].reshape(-1).long()
    kv = tuple(c.index_select(0, pages).reshape(b, case.chunk, *c.shape[2:]) for c in (k_cache, v_cache))
    rows = torch.arange(page, device=pages.device)
    slots = (pages[:, None] * page + rows).reshape(-1).to(torch.int32)
    return kv, slots


def _pool_data(case: Case, device: torch.device, seed: int) -> CaseData:
    """A decode step on the last layer of a real ``case.layers``-layer ``PagedKVCache``.

    Every sequence holds ``context - 1`` tokens (planned, their bytes filled at random
    across the whole arena) and the step adds one; ``pool_step`` is the pool's forward of
    that step, and ``k_cache`` / ``block_table`` are the layer's own views and the plan's
    table, which the other providers gather from.
    """
    from kvarena.cache.arena import KVArena, KVLayout, RegionSpec
    from kvarena.cache.keys import CachePolicy
    from kvarena.cache.paged import PagedKVCache

    dtype = _dtype(case.dtype)
    torch.manual_seed(seed)
    b, page, layer = case.batch, case.block_size, case.layers - 1
    layout = KVLayout(case.layers, case.h_kv, case.head_dim, dtype)
    blocks = b * -(-case.context // page)
    budget = layout.block_bytes(page) * (blocks + 1)
    arena = KVArena({"paged_kv": RegionSpec(layout, page, budget)}, device=device)
    pool = PagedKVCache(CachePolicy("paged_kv", budget), layout=layout, block_size=page, arena=arena,
                        region="paged_kv")
    names = [f"seq{i}" for i in range(b)]
    pool.plan(dict.fromkeys(names, case.context - 1))  # the history: bytes filled below, never attended
    region = arena["paged_kv"]
    for i in range(case.layers):
        region.k(i).normal_()
        region.v(i).normal_()
    meta = pool.plan(dict.fromkeys(names, 1))
    q = torch.randn(b, case.h_q, case.head_dim, device=device, dtype=dtype)
    kn = torch.randn(b, case.h_kv, case.head_dim, device=device, dtype=dtype)
    vn = torch.randn_like(kn)

    def step(**options):
        return pool.forward(q, kn, vn, meta, layer, **options)

    step()  # stores the new token, so that the others gather the same keys
    return CaseData(case, device, q, region.k(layer), region.v(layer), meta.block_table, meta.seq_lens, None,
                    pool_step=step)


def work_of(case: Case) -> dict[str, float]:
    """Bytes and FLOPs one call of ``case`` must touch, for the throughput columns.

    Returns
    -------
    dict
        ``kv_bytes``: K+V bytes read (decode, chunk); ``flops``: 4 * q * k * H_q * D
        (QK^T and PV, every key visible); ``store_bytes``: the new chunk's K+V bytes,
        read once and written once (store).
    """
    el = _dtype(case.dtype).itemsize
    if case.kv_dtype:  # what kvarena reads: 1 byte per element plus a 4-byte scale per row
        el = 1 + 4 / case.head_dim
    kv = 2 * case.batch * case.kv_tokens * case.h_kv * case.head_dim * el
    if case.kind == "decode":
        return {"kv_bytes": kv, "flops": 4.0 * case.batch * case.kv_tokens * case.h_q * case.head_dim}
    if case.kind in ("chunk", "train"):
        # Training counts forward + backward as 3.5x the forward's FLOPs (the backward
        # recomputes QK^T and does four more matmuls: FlashAttention-2's convention).
        mult = 3.5 if case.kind == "train" else 1.0
        return {"kv_bytes": kv, "flops": mult * 4.0 * case.batch * case.chunk * case.kv_tokens * case.h_q * case.head_dim}
    chunk_kv = 2 * case.batch * case.chunk * case.h_kv * case.head_dim * el
    return {"store_bytes": 2 * chunk_kv, "new_bytes": chunk_kv}


# --- providers ---------------------------------------------------------------------------


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
        self.own, self.scales = data.own_kv, None
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


def _train_inputs(case: Case, data: CaseData):
    """Leaves with gradients: q ``[B*T, H_q, D]``, own k/v ``[B, T, H_kv, D]``, and dO."""
    b, t = case.batch, case.chunk
    q = data.q.detach().clone().requires_grad_(True)
    k2 = data.new_k.view(b, t, case.h_kv, case.head_dim).detach().clone().requires_grad_(True)
    v2 = data.new_v.view(b, t, case.h_kv, case.head_dim).detach().clone().requires_grad_(True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    do = torch.randn(q.shape, generator=gen).to(device=q.device, dtype=q.dtype)
    return q, k2, v2, do


def _kvarena_train(case: Case, data: CaseData, backend: str = "auto") -> Bench:
    from kvarena.attention import dispatch
    from kvarena.attention.backend import resolve_backend
    from kvarena.attention.batch import CacheView, KeySet, OwnKeys, QueryRows
    from kvarena.attention.spec import AttentionSpec

    b, t = case.batch, case.chunk
    q, k2, v2, do = _train_inputs(case, data)
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
        own = OwnKeys(k2, v2, KeySet(dense_table, own_lens, t))
        out = dispatch.attend(q, cache, keys, rows, spec=spec, backend=backend, own=own)
        return torch.autograd.grad(out, (q, k2, v2), do)[0]

    note = "Triton fwd + bwd" if backend == "triton" else "torch path fwd + autograd"
    return Bench(fn, note=note)


def _sdpa_train(case: Case, data: CaseData) -> Bench:
    import torch.nn.functional as F

    b, t = case.batch, case.chunk
    q, k2, v2, do = _train_inputs(case, data)
    hist = (case.sinks + case.window - 1) * case.chunk
    kh, vh = (x[:, :, :hist].detach() for x in data.contiguous())  # [B, H_kv, hist, D], constants
    backend = "flash" if data.device.type == "cuda" else None

    def fn():
        kk = torch.cat([kh, k2.transpose(1, 2)], 2)  # [B, H_kv, hist + T, D]
        vv = torch.cat([vh, v2.transpose(1, 2)], 2)
        qs = q.view(b, t, case.h_q, case.head_dim).transpose(1, 2)
        with _sdpa_ctx(backend):
            out = F.scaled_dot_product_attention(qs, kk, vv, enable_gqa=case.h_q != case.h_kv)
        return torch.autograd.grad(out, (q, k2, v2), do.view(b, t, case.h_q, case.head_dim).transpose(1, 2))[0]

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
    from kvarena.benchmark.recycle import ShiftLeftKVCache

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


_BUILDERS: dict[str, Callable[..., Bench]] = {
    "kvarena": _kvarena,
    "kvarena_plain": _kvarena_plain,
    "gather_sdpa": lambda c, d: _sdpa(c, d, gather=True, backend=None),
    "gather_sdpa_flash": lambda c, d: _sdpa(c, d, gather=True, backend="flash"),
    "gather_sdpa_efficient": lambda c, d: _sdpa(c, d, gather=True, backend="efficient"),
    "sdpa_contiguous": _contiguous,
    "sdpa_cudnn": lambda c, d: _sdpa(c, d, gather=False, backend="cudnn"),
    "copy": _copy,
    "gather_flex": lambda c, d: _flex(c, d, gather=True),
    "flex_contiguous": lambda c, d: _flex(c, d, gather=False),
    "flash_attn": _flash_attn,
    "flashinfer": _flashinfer,
    "copy_": _store_copy,
    "shift_left": _store_shift_left,
}
# Providers that take kvarena's backend choice (``kvarena bench --backend``).
_KVARENA = frozenset({"kvarena", "kvarena_plain"})


def build(provider: str, case: Case, data: CaseData, backend: str = "auto") -> Bench:
    """Build ``provider`` for ``case`` on ``data``; ``backend`` is kvarena's (``"auto"``,
    ``"torch"`` or ``"triton"``: the interpreter on CPU), ignored by the other providers.

    Raises
    ------
    KeyError
        For an unknown provider name.
    Skip
        When the provider cannot run here (the reason is the message).
    """
    if provider not in _BUILDERS:
        raise KeyError(f"provider: expected one of {sorted(_BUILDERS)}, got {provider!r}")
    if provider in _KVARENA:
        return _BUILDERS[provider](case, data, backend=backend)
    return _BUILDERS[provider](case, data)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` in fp32 (nan when shapes differ; NaN anywhere gives nan)."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.nan
    o, r = out.float(), ref.float()
    denom = r.abs().max().item()
    return (o - r).abs().max().item() / (denom if denom > 0 else 1.0)
