"""Context parallel (issue 16: heads and tokens modes) on 2 and 3 CPU processes over gloo.

One process group per world size for the whole module (fork start: ~0.3 s to spawn,
plus gloo's rendezvous). Each worker runs every scenario below; a scenario builds the
single-process pool and the sharded one from the same seed, feeds the sharded one its
rank's rows, and compares with the same rows of the single-process output (fp64: 1e-12
relative, fp32: 1e-5). Results come back as JSON per rank; a scenario that raised
reports its traceback. Gloo collectives time out after 60 s, so a rank stuck in a
collective fails the module instead of hanging it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvarena import AttentionSpec, CacheFullError, CachePolicy, KVLayout, PagedKVCache, SlabKVCache
from kvarena.distributed import ContextParallel

WORLDS = (2, 3)
L, H_Q, H_KV, D = 2, 12, 6, 8  # 6 kv heads: split over 2 and over 3 ranks
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _check(what: str, got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    err = _rel(got, want)
    if not (torch.isfinite(got).all() and err <= TOL[dtype]):
        raise AssertionError(f"{what}: relative error {err:.3e} > {TOL[dtype]:.0e} (finite: {bool(torch.isfinite(got).all())})")


def _raises(make, exc, needle: str) -> None:
    """``make()`` raises ``exc`` whose message contains ``needle`` (pytest.raises is not
    there in the workers' plain scenario functions)."""
    try:
        make()
    except exc as e:
        assert needle in str(e), str(e)
    else:
        raise AssertionError(f"no {exc.__name__} naming {needle}")


def _pools(cp, per: dict, slab_tokens: int, slots: int, dtype, **kw):
    lay = KVLayout(num_layers=L, num_kv_heads=H_KV, head_dim=D, dtype=dtype)
    policy = CachePolicy("slab_kv", slots * lay.block_bytes(slab_tokens), per_component=per)
    ref = SlabKVCache(policy, layout=lay, slab_tokens=slab_tokens, **kw)
    pool = SlabKVCache(policy, layout=lay, slab_tokens=slab_tokens, context_parallel=cp, **kw)
    return ref, pool


def _run(cp, ref, pool, batches, denoise: int, dtype, *, seed: int, lse: bool = False) -> None:
    """Plan each batch on both pools; ``denoise`` commit=False passes then the clean pass."""
    g = torch.Generator().manual_seed(seed)
    for step, batch in enumerate(batches):
        m_ref, m = ref.plan(batch), pool.plan(batch)
        b, t = m_ref.num_seqs, m_ref.n_tokens
        for p in range(denoise + 1):
            commit = p == denoise
            for layer in range(L):
                q = torch.randn(b, t, H_Q, D, generator=g, dtype=dtype)
                k, v = (torch.randn(b, t, H_KV, D, generator=g, dtype=dtype) for _ in range(2))
                opts = dict(return_lse=True) if lse else {}
                want = ref.forward(q, k, v, m_ref, layer, commit=commit, backend="torch", **opts)
                got = pool.forward(cp.shard(q), cp.shard(k), cp.shard(v), m, layer, commit=commit, backend="torch",
                                   **opts)
                where = f"step {step} pass {p} layer {layer} rank {cp.rank}"
                if lse:
                    _check(where + " out", got[0], cp.shard(want[0]), dtype)
                    _check(where + " lse", got[1], cp.shard(want[1]), dtype)
                else:
                    _check(where, got, cp.shard(want), dtype)


# ---------------------------------------------------------------------------- scenarios
def case_chunk_window_past_recycling_cfg(cp):
    """Sinks 1 + window 2 (chunks), two CFG namespaces, 7 chunks: slabs recycled in place;
    7-token chunks split unevenly (4/3, 3/2/2)."""
    ref, pool = _pools(cp, {"sinks": 1, "window": 2}, 7, 8, torch.float64)
    batches = [{"cond": c, "uncond": c} for c in range(7)]
    _run(cp, ref, pool, batches, 2, torch.float64, seed=1)
    n = cp.world_size
    assert pool.arena.reserved_bytes * n == ref.arena.reserved_bytes, (pool.arena.reserved_bytes, n)
    assert pool.num_slots == ref.num_slots and pool.used_bytes * n == ref.used_bytes


def case_token_window_short_first_chunk_fp32(cp):
    """Self-Forcing's token rule (sink 3 tokens, window 11), a short first chunk (2 tokens:
    a rank with no row when N = 3), fp32, the lse too."""
    ref, pool = _pools(cp, {"sink_tokens": 3, "window_tokens": 11}, 5, 12, torch.float32)
    batches = [{"a": (0, 2)}] + [{"a": c} for c in range(1, 6)]
    _run(cp, ref, pool, batches, 1, torch.float32, seed=2, lse=True)


def case_multi_chunk_run(cp):
    """A run of three chunks in one step (conditioning prefill), then single chunks."""
    ref, pool = _pools(cp, {"sinks": 1, "window": 3}, 4, 10, torch.float64)
    batches = [{"a": range(0, 3)}, {"a": 3}, {"a": 4}]
    _run(cp, ref, pool, batches, 1, torch.float64, seed=3)


def case_comm_bytes_formula(cp):
    """Bytes sent per layer == q, k, v and out rows that leave the rank, constant as the
    history grows; nothing in plan."""
    ref, pool = _pools(cp, {"sinks": 1, "window": 2}, 7, 8, torch.float64)
    n, es = cp.world_size, 8
    sizes = cp.split_sizes(7)
    t_r = sizes[cp.rank]
    per_layer = []
    g = torch.Generator().manual_seed(4)
    for c in range(5):
        cp.stats.reset()
        m = pool.plan({"x": c, "y": c})
        assert cp.stats.calls == 0
        q = torch.randn(2, 7, H_Q, D, generator=g, dtype=torch.float64)
        k = torch.randn(2, 7, H_KV, D, generator=g, dtype=torch.float64)
        pool.forward(cp.shard(q), cp.shard(k), cp.shard(k), m, 0, commit=True, backend="torch")
        per_layer.append(cp.stats.per_layer[0])
    want = 2 * t_r * (H_Q + 2 * H_KV) * D * es * (n - 1) // n + 2 * (7 - t_r) * (H_Q // n) * D * es
    assert per_layer == [want] * 5, (per_layer, want)
    assert cp.stats.calls == 4


def _gradient_rollout(cp, seed: int, each_chunk=None) -> None:
    """Four chunks: denoising-step gradients (commit=False) w.r.t. the rank's q, k, v rows
    equal the rank's rows of the single-process gradients; then a clean pass commits."""
    ref, pool = _pools(cp, {"sinks": 1, "window": 2}, 5, 8, torch.float64)
    g = torch.Generator().manual_seed(seed)
    for c in range(4):
        m_ref, m = ref.plan({"a": c}), pool.plan({"a": c})
        q = torch.randn(1, 5, H_Q, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(1, 5, H_KV, D, generator=g, dtype=torch.float64) for _ in range(2))
        w = torch.randn(1, 5, H_Q, D, generator=g, dtype=torch.float64)
        qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
        (ref.forward(qa, ka, va, m_ref, 0, commit=False, backend="torch") * w).sum().backward()
        qs, ks, vs = (cp.shard(x).clone().requires_grad_() for x in (q, k, v))
        (pool.forward(qs, ks, vs, m, 0, commit=False, backend="torch") * cp.shard(w)).sum().backward()
        for name, got, want in (("dq", qs.grad, qa.grad), ("dk", ks.grad, ka.grad), ("dv", vs.grad, va.grad)):
            _check(f"chunk {c} {name}", got, cp.shard(want), torch.float64)
        with torch.no_grad():
            cp.stats.reset()
            for layer in range(L):  # commit so the next chunk has history
                ref.forward(q, k, v, m_ref, layer, backend="torch")
                pool.forward(cp.shard(q), cp.shard(k), cp.shard(v), m, layer, backend="torch")
        if each_chunk is not None:
            each_chunk()


def case_gradients_equal_single_process(cp):
    """Heads mode: gradients through the all-to-alls."""
    _gradient_rollout(cp, 5)


def case_errors(cp):
    lay = KVLayout(num_layers=1, num_kv_heads=H_KV, head_dim=D, dtype=torch.float64)
    pol = CachePolicy("slab_kv", 1 << 16, per_component={"window": 2})
    bad = KVLayout(num_layers=1, num_kv_heads=cp.world_size + 1, head_dim=D, dtype=torch.float64)
    for make, exc, needle in (
        (lambda: ContextParallel(mode="ring"), ValueError, "mode"),
        (lambda: ContextParallel(group=3), TypeError, "group"),
        (lambda: SlabKVCache(pol, layout=bad, slab_tokens=4, context_parallel=cp), ValueError, "num_kv_heads"),
        (lambda: SlabKVCache(pol, slab_tokens=4, context_parallel=cp), ValueError, "layout"),
        (lambda: SlabKVCache(pol, layout=lay, slab_tokens=4, context_parallel="cp"), TypeError, "context_parallel"),
        (lambda: SlabKVCache(CachePolicy("slab_kv", 1 << 16, per_component={"window_tokens": 8}), layout=lay,
                             slab_tokens=4, context_parallel=ContextParallel(mode="tokens")),
         ValueError, "context_parallel.mode"),
        (lambda: SlabKVCache(pol, layout=lay, slab_tokens=cp.world_size - 1,
                             context_parallel=ContextParallel(mode="tokens")), ValueError, "slab_tokens"),
    ):
        _raises(make, exc, needle)
    pool = SlabKVCache(pol, layout=lay, slab_tokens=4, context_parallel=cp)
    m = pool.plan({"a": 0})
    q = torch.randn(1, 4, H_Q, D, dtype=torch.float64)  # the whole chunk, not the rank's rows
    try:
        pool.forward(q, q[..., :H_KV, :], q[..., :H_KV, :], m, 0)
    except ValueError as e:
        assert "rank" in str(e) and "shape" in str(e), str(e)
    else:
        raise AssertionError("whole-chunk rows on a rank: no ValueError")
    assert cp.split_sizes(7) == [7 // cp.world_size + (i < 7 % cp.world_size) for i in range(cp.world_size)]


def case_sub_group_and_device_mesh(cp):
    """A sub-group (the last two ranks: shards follow the rank within it; a rank outside
    cannot make one) and a 1-D DeviceMesh give the single-process result."""
    from torch.distributed.device_mesh import init_device_mesh

    n = cp.world_size
    members = list(range(n - 2, n))
    sub = dist.new_group(members)  # every rank takes part in making it
    if cp.rank in members:
        scp = ContextParallel(sub)
        assert (scp.world_size, scp.rank) == (2, members.index(cp.rank))
        ref, pool = _pools(scp, {"sinks": 1, "window": 2}, 5, 6, torch.float64)
        _run(scp, ref, pool, [{"a": c} for c in range(4)], 1, torch.float64, seed=6)
    else:
        try:
            ContextParallel(sub)
        except ValueError as e:
            assert "group" in str(e), str(e)
        else:
            raise AssertionError("a rank outside the group made a ContextParallel")
    dist.barrier()
    mcp = ContextParallel(init_device_mesh("cpu", (n,)))
    assert (mcp.world_size, mcp.rank) == (n, cp.rank)
    ref, pool = _pools(mcp, {"sinks": 1, "window": 2}, 5, 6, torch.float64)
    _run(mcp, ref, pool, [{"a": c} for c in range(3)], 0, torch.float64, seed=7)


def _tokens(cp):
    return ContextParallel(cp.group, mode="tokens")


def case_tokens_chunk_window_past_recycling_cfg(cp):
    """Tokens mode: each rank stores its rows of every 7-token chunk (4/3, 3/2/2), sinks 1 +
    window 2, two CFG namespaces, denoising steps and clean passes, the lse too; the rank's
    pool has as many slabs as the single-process one, of its rows only."""
    tcp = _tokens(cp)
    ref, pool = _pools(tcp, {"sinks": 1, "window": 2}, 7, 8, torch.float64)
    _run(tcp, ref, pool, [{"cond": c, "uncond": c} for c in range(7)], 2, torch.float64, seed=11, lse=True)
    t_r = tcp.split_sizes(7)[tcp.rank]
    assert pool.num_slots == ref.num_slots and pool.slab_tokens == t_r
    assert pool.arena.reserved_bytes == ref.arena.reserved_bytes * t_r // 7


def case_tokens_short_first_chunk_fp32(cp):
    """A short first chunk (4 tokens: 2/2, 2/1/1) in fp32, then whole chunks of 5."""
    tcp = _tokens(cp)
    ref, pool = _pools(tcp, {"sinks": 1, "window": 3}, 5, 10, torch.float32)
    _run(tcp, ref, pool, [{"a": (0, 4)}] + [{"a": c} for c in range(1, 7)], 1, torch.float32, seed=12)


def case_tokens_gradients_and_bytes(cp):
    """Tokens mode: gradients equal the single-process ones (the merge weights carry a
    gradient on each partial lse); bytes per layer == the q all-gather plus the partial
    out / lse rows, with K/V never sent."""
    tcp = _tokens(cp)
    n, t_r = tcp.world_size, tcp.split_sizes(5)[tcp.rank]
    want = (n - 1) * t_r * H_Q * D * 8 + (5 - t_r) * H_Q * (D * 8 + 8)

    def bytes_per_layer():
        assert tcp.stats.per_layer == {0: want, 1: want}, (tcp.stats.per_layer, want)

    _gradient_rollout(tcp, 13, bytes_per_layer)


def case_tokens_errors(cp):
    tcp = _tokens(cp)
    ref, pool = _pools(tcp, {"sinks": 1, "window": 2}, 5, 8, torch.float64)
    # Each refused on every rank (the chunk's own lengths are checked, not the rank's share,
    # which two lengths can have in common).
    for batch, needle in (({"a": range(0, 2)}, "a run of chunks"), ({"a": (0, cp.world_size - 1)}, "n_tokens >="),
                          ({"a": (0, 6)}, "longer than a slab (5)"), ({"a": (1, 4)}, "only chunk 0 may be shorter")):
        _raises(lambda batch=batch: pool.plan(batch), ValueError, needle)
    assert "a" not in pool and pool.used_bytes == 0
    pool.plan({"a": (0, 4)})
    _raises(lambda: pool.plan({"a": (0, 5)}), ValueError, "chunk 0 was planned with 4 tokens")
    # Token counts in the chunks' own sizes (as the single-process pool answers them).
    assert pool.chunks_for_tokens("a", 4, 10) == (range(1, 3), 10)
    assert pool.slabs_per_rollout(first_chunk_tokens=4) == ref.slabs_per_rollout(first_chunk_tokens=4)
    lay = KVLayout(num_layers=1, num_kv_heads=H_KV, head_dim=D, dtype=torch.float64)
    rope = AttentionSpec(rope_cos=torch.ones(64, D // 2), rope_sin=torch.zeros(64, D // 2))
    _raises(lambda: SlabKVCache(CachePolicy("slab_kv", 1 << 16, per_component={"window": 2}), layout=lay,
                                slab_tokens=4, attention=rope, context_parallel=tcp), ValueError, "rope_cos")


def case_paged_decode_prefill_fork_truncate(cp):
    """Decode context parallel: q, k, v replicated, block j stored by rank j % N; chunked
    prefill, decode, a fork (copy-on-write of a shared partial block) and a truncate, equal
    to the single-process pool; the output the same bits on every rank; bytes by the
    formula; each rank holds only its blocks."""
    tcp = _tokens(cp)
    lay = KVLayout(num_layers=L, num_kv_heads=H_KV, head_dim=D, dtype=torch.float64)
    policy = CachePolicy("paged_kv", 96 * lay.block_bytes(4))
    spec = AttentionSpec(softcap=20.0)
    ref = PagedKVCache(policy, layout=lay, block_size=4, attention=spec)
    pool = PagedKVCache(policy, layout=lay, block_size=4, attention=spec, context_parallel=tcp)
    assert type(pool) is PagedKVCache and pool.context_parallel is tcp
    assert pool.total_blocks == -(-96 // tcp.world_size) and ref.context_parallel is None
    g = torch.Generator().manual_seed(21)

    def step(batch):
        m_ref, m = ref.plan(batch), pool.plan(batch)
        rows = m_ref.total_q
        for layer in range(L):
            q = torch.randn(rows, H_Q, D, generator=g, dtype=torch.float64)
            k, v = (torch.randn(rows, H_KV, D, generator=g, dtype=torch.float64) for _ in range(2))
            tcp.stats.reset()
            with torch.no_grad():
                want = ref.forward(q, k, v, m_ref, layer, backend="torch")
                got = pool.forward(q, k, v, m, layer, backend="torch")
            _check(f"{batch} layer {layer}", got, want, torch.float64)
            sent = tcp.stats.bytes_sent
            assert sent == (tcp.world_size - 1) * rows * H_Q * (D + 1) * 8, sent
            every = tcp.all_gather(got, layer)
            assert all(torch.equal(every[0], every[r]) for r in range(tcp.world_size)), "ranks differ"

    step({"a": 7, "b": 13})
    for _ in range(9):
        step({"a": 1, "b": 1})
    step({"a": 6, "b": 1})  # chunked prefill next to decode
    pool.fork("a", "c")
    ref.fork("a", "c")
    for _ in range(5):
        step({"a": 1, "c": 1})
    n = pool.seq_len("b")
    pool.truncate("b", n - 5)
    ref.truncate("b", n - 5)
    for _ in range(3):
        step({"b": 1, "c": 2})
    n = tcp.world_size
    for ns, first in (("a", 0), ("b", 1 % n), ("c", 0)):  # block 0 on rank (creation count % N); a fork: its source's
        assert pool.seq_len(ns) == ref.seq_len(ns)
        held = len(pool.block_ids(ns))
        total = -(-ref.seq_len(ns) // 4)
        assert held == len(range((tcp.rank - first) % n, total, n)), (ns, held, total)
    for ns in ("a", "b", "c"):
        pool.free_namespace(ns)
    assert pool.used_bytes == 0


def case_paged_errors(cp):
    tcp = _tokens(cp)
    lay = KVLayout(num_layers=1, num_kv_heads=H_KV, head_dim=D, dtype=torch.float64)
    pol = CachePolicy("paged_kv", 64 * lay.block_bytes(4))
    for make, exc, needle in (
        (lambda: PagedKVCache(pol, layout=lay, block_size=4, context_parallel=cp), ValueError,
         "context_parallel.mode"),
        (lambda: PagedKVCache(pol, layout=lay, block_size=4, attention=AttentionSpec(window_left=3),
                              context_parallel=tcp), ValueError, "window_left"),
        (lambda: PagedKVCache(pol, layout=lay, block_size=4, graph_capacity=(2, 8), context_parallel=tcp),
         ValueError, "graph_capacity"),
        (lambda: PagedKVCache(pol, layout=lay, block_size=4, context_parallel=tcp).plan({"a": 2}, pad_to=4),
         ValueError, "pad_to"),
    ):
        _raises(make, exc, needle)
    # A step only rank 0 cannot hold (2N + 1 blocks, 2 per rank): every rank refuses it,
    # unchanged, so none goes on into a collective alone.
    n = tcp.world_size
    small = PagedKVCache(CachePolicy("paged_kv", 2 * n * lay.block_bytes(4)), layout=lay, block_size=4,
                         context_parallel=tcp)
    try:
        small.plan({"a": (2 * n + 1) * 4})
    except CacheFullError as e:
        assert "some rank of the group cannot take this step" in str(e), str(e)
    else:
        raise AssertionError(f"rank {tcp.rank}: a step that does not fit on rank 0 went through")
    assert "a" not in small and small.used_bytes == 0
    small.plan({"a": 2 * n * 4})  # fits everywhere
    # 2N one-block sequences fit 2N blocks: block 0 of each goes to the next rank in turn.
    spread = PagedKVCache(CachePolicy("paged_kv", 2 * n * lay.block_bytes(4)), layout=lay, block_size=4,
                          context_parallel=tcp)
    spread.plan({f"s{i}": 3 for i in range(2 * n)})
    assert spread.allocator.num_used == 2
    pool = PagedKVCache(pol, layout=lay, block_size=4, context_parallel=tcp)
    m = pool.plan({"a": 3})
    q = torch.randn(3, H_Q, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, H_KV, D, dtype=torch.float64)
    try:
        pool.forward(q, k, k, m, 0)
    except ValueError as e:
        assert "inference-only" in str(e)
    else:
        raise AssertionError("autograd through decode context parallel: no ValueError")


def case_triton_kernels_all_three(cp):
    """The Triton path (the interpreter on CPU) in each scheme: paged decode context
    parallel (the step's own keys as one-token pages), slab heads and tokens modes, fp32,
    denoising and clean passes, against the single-process torch path. Two ranks only
    (interpreter time)."""
    g = torch.Generator().manual_seed(31)
    tcp = _tokens(cp)
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    pol = CachePolicy("paged_kv", 32 * lay.block_bytes(4))
    ref, pool = PagedKVCache(pol, layout=lay, block_size=4), PagedKVCache(pol, layout=lay, block_size=4,
                                                                            context_parallel=tcp)
    for batch in ({"a": 5, "b": 3}, {"a": 1, "b": 1}, {"a": 3, "b": 1}):
        m_ref, m = ref.plan(batch), pool.plan(batch)
        q = torch.randn(m_ref.total_q, 4, 16, generator=g)
        k, v = torch.randn(m_ref.total_q, 2, 16, generator=g), torch.randn(m_ref.total_q, 2, 16, generator=g)
        with torch.no_grad():
            want = ref.forward(q, k, v, m_ref, 0, backend="torch")
            _check(f"paged {batch}", pool.forward(q, k, v, m, 0, backend="triton"), want, torch.float32)
    h = cp.world_size  # heads mode: one kv head per rank
    lay = KVLayout(num_layers=1, num_kv_heads=h, head_dim=16, dtype=torch.float32)
    for mode in ("heads", "tokens"):
        mcp = ContextParallel(cp.group, mode=mode)
        sp = CachePolicy("slab_kv", 8 * lay.block_bytes(5), per_component={"sinks": 1, "window": 2})
        ref, pool = SlabKVCache(sp, layout=lay, slab_tokens=5), SlabKVCache(sp, layout=lay, slab_tokens=5,
                                                                            context_parallel=mcp)
        for c in range(4):
            m_ref, m = ref.plan({"x": c}), pool.plan({"x": c})
            q = torch.randn(1, 5, 2 * h, 16, generator=g)
            k, v = torch.randn(1, 5, h, 16, generator=g), torch.randn(1, 5, h, 16, generator=g)
            with torch.no_grad():
                for commit in (False, True):
                    want = ref.forward(q, k, v, m_ref, 0, backend="torch", commit=commit)
                    got = pool.forward(mcp.shard(q), mcp.shard(k), mcp.shard(v), m, 0, backend="triton",
                                       commit=commit)
                    _check(f"slab {mode} chunk {c} commit={commit}", got, mcp.shard(want), torch.float32)


def case_compiles_fullgraph(cp):
    """``torch.compile(fullgraph=True)`` traces a tokens-mode slab forward (functional
    collectives, merge, custom ops) and matches the single-process pool. Two ranks only."""
    tcp = _tokens(cp)
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    sp = CachePolicy("slab_kv", 8 * lay.block_bytes(6), per_component={"window": 2})
    ref, pool = SlabKVCache(sp, layout=lay, slab_tokens=6), SlabKVCache(sp, layout=lay, slab_tokens=6,
                                                                        context_parallel=tcp)
    step = torch.compile(lambda q, k, v, m: pool.forward(q, k, v, m, 0, commit=False), fullgraph=True)
    g = torch.Generator().manual_seed(41)
    for c in range(2):
        m_ref, m = ref.plan({"a": c}), pool.plan({"a": c})
        q, k, v = torch.randn(1, 6, 4, 8, generator=g), torch.randn(1, 6, 2, 8, generator=g), torch.randn(
            1, 6, 2, 8, generator=g)
        with torch.no_grad():
            _check(f"compiled chunk {c}", step(tcp.shard(q), tcp.shard(k), tcp.shard(v), m),
                   tcp.shard(ref.forward(q, k, v, m_ref, 0, commit=False)), torch.float32)
            ref.forward(q, k, v, m_ref, 0)
            pool.forward(tcp.shard(q), tcp.shard(k), tcp.shard(v), m, 0)


def case_benchmark_runs(cp):
    """``python -m kvarena.benchmark cp`` at tiny size: both modes run, bytes by the formula."""
    from kvarena.benchmark.cp import TINY, run_cp

    rows = run_cp(models=("wan1.3b",), tokens=10, dtype=torch.float32, device="cpu", reps=1, tiny=True)
    heads, d, _layers = TINY["wan1.3b"]
    n, t_r, es = cp.world_size, cp.split_sizes(10)[cp.rank], 4
    by_mode = {r["mode"]: r for r in rows}
    want = {"heads": t_r * 3 * heads * d * es * (n - 1) // n + (10 - t_r) * (heads // n) * d * es,
            "tokens": (n - 1) * t_r * heads * d * es + (10 - t_r) * heads * (d * es + 4)}
    for mode, ok in by_mode.items():
        assert ok["status"] == "ok" and ok["bytes_sent_per_layer"] == want[mode], (ok, want)
        assert ok["attn_ms_per_layer"] > 0 and ok["efficiency"] > 0


SCENARIOS = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
# Run on 2 ranks only (CI time): what 3 ranks add (three-way uneven splits, empty shards, a
# real sub-group, one rank short of blocks) is in the other scenarios; these repeat the
# 2-rank case (the interpreter and the compile cost about 9 s and 5 s more on 3).
TWO_RANKS_ONLY = {"benchmark_runs", "compiles_fullgraph", "errors", "gradients_equal_single_process",
                  "multi_chunk_run", "tokens_errors", "triton_kernels_all_three"}


# ---------------------------------------------------------------------------- harness
def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        cp = ContextParallel()
        for name, fn in SCENARIOS.items():
            if world > 2 and name in TWO_RANKS_ONLY:
                results[name] = "skip: runs on 2 ranks (what 3 add is covered by the other scenarios)"
                continue
            try:
                fn(cp)
                results[name] = "ok"
            except BaseException:  # noqa: BLE001 - reported to the test
                results[name] = traceback.format_exc()
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for world in WORLDS:
        d = tmp_path_factory.mktemp(f"cp{world}")
        mp.start_processes(_worker, args=(world, _free_port(), str(d)), nprocs=world, start_method="fork")
        for r in range(world):
            with open(d / f"rank{r}.json") as f:
                out[world, r] = json.load(f)
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(SCENARIOS))
def test_context_parallel(results, world: int, case: str) -> None:
    for r in range(world):
        got = results[world, r].get(case, "not run")
        if got.startswith("skip: "):
            pytest.skip(got[6:])
        assert got == "ok", f"world {world} rank {r}: {got}"


def test_needs_an_initialized_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with pytest.raises(ValueError, match="group: torch.distributed is not initialized"):
        ContextParallel()
    with pytest.raises(ValueError, match="mode: expected 'heads' or 'tokens'"):
        ContextParallel(mode="ulysses")
