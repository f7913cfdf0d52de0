"""The data every provider of a case reads (one arena of K/V pages, shuffled), what a
built provider is (:class:`Bench`, or :class:`Skip` with a reason), and the work of one
call for the throughput columns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvarena.benchmark.cases import Case

__all__ = ["Bench", "CaseData", "Skip", "make_data", "work_of"]


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
    own : ``(own_k, own_v)`` each ``[B, chunk, H_kv, D]``: the newest slab's keys gathered
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
    own: tuple | None = None
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
            from kvarena.attention.rope import rope_table
            from kvarena.attention.rules import apply_rope

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
        own, own_slots = _newest_slab(case, block_table, rope[1] if rope else k_cache, v_cache)
        return CaseData(case, device, q, k_cache, v_cache, block_table, seq_lens, cu, kv8=kv8, rope=rope,
                        own=own, own_slots=own_slots)
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



def _train_inputs(case: Case, data: CaseData):
    """Leaves with gradients: q ``[B*T, H_q, D]``, own k/v ``[B, T, H_kv, D]``, and dO."""
    b, t = case.batch, case.chunk
    q = data.q.detach().clone().requires_grad_(True)
    own_k = data.new_k.view(b, t, case.h_kv, case.head_dim).detach().clone().requires_grad_(True)
    own_v = data.new_v.view(b, t, case.h_kv, case.head_dim).detach().clone().requires_grad_(True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    do = torch.randn(q.shape, generator=gen).to(device=q.device, dtype=q.dtype)
    return q, own_k, own_v, do
