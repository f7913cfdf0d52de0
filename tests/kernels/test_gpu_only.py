"""Tests that need a CUDA GPU (``pytest -m gpu``: bench/gpu.sh's set), and the part of them
that the Triton interpreter can run on CPU.

* CUDA-graph capture and replay of a paged decode step (``graph_capacity=``,
  ``plan(..., graph=True)``) against an eager pool fed the same inputs and an fp64 reference.
* CUDA-graph capture of a slab rollout's denoising and commit steps, captured per chunk
  (the slab plan has no persistent buffers; see that test), against the same rollout run
  eagerly and an fp64 reference, past the window (slabs recycled in place).
* fp8 e4m3: the native widening (sm_89+) and the shift decode over all 256 byte values,
  NaN included, against torch's own conversion. The shift decode also runs in the
  interpreter (it is not a GPU test: CI runs it on CPU).
* An arena of more than 2**31 elements per cache view, attended at its end (int64
  addressing), bf16 and fp8, against fp64 on the gathered blocks.

Each GPU test's body is a function of the device (and, for the graphs, of a ``capture``
strategy: :func:`cuda_graph`, or :func:`eager_replay` where a "replay" calls the step
again), so the same bodies run on CPU through the interpreter; that is how their logic
was checked before a GPU ran them. Every CUDA test frees its memory (``_free_cuda``).
"""

from __future__ import annotations

import gc
import itertools

import pytest
import torch
from _helpers import (  # noqa: F401 - one_torch_thread: autouse
    DEVICE,
    INTERPRETER,
    assert_attention_close,
    assert_close,
    one_torch_thread,
)

import kvarena
from kvarena import AttentionSpec, CachePolicy, KVLayout, PagedKVCache, SlabKVCache

HAS_CUDA = torch.cuda.is_available()
WARMUP = 2  # eager calls before a capture
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (a `pytest -m gpu` test, bench/gpu.sh's set)")
needs_sm89 = pytest.mark.skipif(
    HAS_CUDA and torch.cuda.get_device_capability() < (8, 9),
    reason="the native fp8 widening needs sm_89+ (this GPU takes the shift decode)",
)
# The pools' and ops' kernels on every device: CUDA, or the interpreter on CPU (conftest).
TRITON_SPEC = AttentionSpec(backend="triton")


def cuda_test(fn):
    """Marks a test ``gpu`` and skips it without CUDA (unlike a kernel-lane test, these
    have no interpreter form: CUDA graphs, the native fp8 widening, device memory)."""
    return pytest.mark.gpu(needs_cuda(fn))


@pytest.fixture(autouse=True)
def _free_cuda():
    """Give back what a test allocated on the GPU (graphs' private pools included)."""
    yield
    if HAS_CUDA:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- helpers


def cuda_graph(fn):
    """Capture ``fn()`` in a ``torch.cuda.CUDAGraph``; returns ``replay()``.

    ``WARMUP`` calls run on a side stream first (they compile the Triton kernels and run
    the step for real, as the replay will again: a step's stores are idempotent);
    ``replay()`` replays the graph and returns the captured outputs (static tensors: the
    next replay overwrites them).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()

    def replay():
        graph.replay()
        return static

    replay.graph = graph  # kept alive with the replay function
    return replay


def eager_replay(fn):
    """:func:`cuda_graph` without a device: the same warm-up calls, then each "replay"
    calls ``fn`` again (what a replay runs on the device, plus the host work)."""
    for _ in range(WARMUP):
        fn()
    return fn


def _dense(q, k, v, *, causal=False, scale=None):
    """fp64 softmax attention of ``q [M, H_q, D]`` over ``k, v [L, H_kv, D]`` (query head h
    reads kv head ``h // (H_q / H_kv)``); ``causal``: query i sits at position ``L - M + i``
    (bottom-right aligned) and sees keys ``t <= L - M + i``. Returns ``(out [M, H_q, D],
    lse [M, H_q])`` on the CPU."""
    q, k, v = (x.detach().cpu().double() for x in (q, k, v))
    m, h_q, d = q.shape
    group = h_q // k.shape[1]
    kd, vd = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("mhd,lhd->hml", q, kd) * (d**-0.5 if scale is None else scale)
    if causal:
        pos = torch.arange(m)[:, None] + k.shape[0] - m
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    out = torch.einsum("hml,lhd->mhd", torch.softmax(s, -1), vd)
    return out, torch.logsumexp(s, -1).T


def _where(mask: torch.Tensor, k: int = 5) -> list:
    return mask.nonzero()[:k].tolist()


# ----------------------------------------------------------------------------- 1. paged decode under a CUDA graph

P_LAYERS, P_HKV, P_GROUP, P_D, P_BS = 3, 2, 4, 32, 16
P_CAPACITY = (4, 4)  # (max_batch, max_blocks): one padding row at least, 64 tokens per sequence
# Three sequences of different lengths; b and c cross a block edge during the decode steps.
P_PREFILL = {"a": 5, "b": 14, "c": 31}
# Each decode step's rows in plan order: the order changes, and one step leaves c out (two
# real rows, two padding rows).
P_STEPS = ("abc", "cab", "ba", "bca", "acb")


def _paged_step(pool, meta, q, k, v):
    """One model step through every layer of ``pool``: layer l stores ``k[l], v[l]`` and
    attends with ``q[l]`` plus layer l-1's output (a residual: the layers depend on each
    other, as in a model). ``q [L, rows, H_q, D]``, ``k, v [L, rows, H_kv, D]``.
    Returns ``(outputs, queries used)``, both ``[L, rows, H_q, D]``."""
    outs, qs, prev = [], [], None
    for layer in range(q.shape[0]):
        ql = q[layer] if prev is None else q[layer] + prev
        prev = pool.forward(ql, k[layer], v[layer], meta, layer)
        outs.append(prev)
        qs.append(ql)
    return torch.stack(outs), torch.stack(qs)


def _stored(pool, ns, layer):
    """``ns``'s stored K and V at ``layer`` ``[seq_len, H_kv, D]``, read through public state
    (``block_ids``, ``seq_len`` and the arena region's per-layer views)."""
    region = pool.arena.regions["paged_kv"]
    kc, vc = region.k(layer), region.v(layer)
    ids = torch.tensor(pool.block_ids(ns), device=kc.device)
    n = pool.seq_len(ns)
    return kc[ids].flatten(0, 1)[:n], vc[ids].flatten(0, 1)[:n]


def _graph_view(meta):
    """What a replay relies on: the metadata buffers' addresses and the host sizes."""
    ptrs = tuple(t.data_ptr() for t in (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.cu_seqlens_q))
    return ptrs, (meta.total_q, meta.num_seqs, meta.max_seqlen_q, meta.max_seqlen_k)


def _paged_graph_decode(device: str, capture, seed: int) -> None:
    """The body of :func:`test_cuda_graph_replays_paged_decode_steps` (any device)."""
    gen = torch.Generator().manual_seed(seed)
    lay = KVLayout(num_layers=P_LAYERS, num_kv_heads=P_HKV, head_dim=P_D, dtype=BF16)
    policy = CachePolicy("paged_kv", max_bytes=24 * lay.block_bytes(P_BS))
    graph_pool = PagedKVCache(policy, layout=lay, block_size=P_BS, device=device, graph_capacity=P_CAPACITY,
                              attention=TRITON_SPEC)
    eager_pool = PagedKVCache(policy, layout=lay, block_size=P_BS, device=device, attention=TRITON_SPEC)
    for pool in (graph_pool, eager_pool):
        pool.arena.buffer.fill_(0xFF)  # every slot not written is NaN (bf16 0xFFFF): a stray read shows
    h_q = P_HKV * P_GROUP

    def rand(rows, heads):
        return torch.randn(P_LAYERS, rows, heads, P_D, generator=gen).to(BF16)

    # Prefill, eager, the same inputs into both pools; the host keeps every stored K/V row.
    n = sum(P_PREFILL.values())
    q, k, v = rand(n, h_q), rand(n, P_HKV), rand(n, P_HKV)
    for pool in (graph_pool, eager_pool):
        _paged_step(pool, pool.plan(P_PREFILL), q.to(device), k.to(device), v.to(device))
    hist = {}
    for (ns, m), off in zip(P_PREFILL.items(), itertools.accumulate([0, *P_PREFILL.values()])):
        for layer in range(P_LAYERS):
            hist[ns, layer] = (k[layer, off : off + m], v[layer, off : off + m])

    max_batch = P_CAPACITY[0]
    static = [torch.zeros(P_LAYERS, max_batch, h, P_D, dtype=BF16, device=device) for h in (h_q, P_HKV, P_HKV)]
    state: dict = {}  # the current step's metadata (an eager "replay" re-runs forward on it)
    replay = captured = None
    for step, rows in enumerate(P_STEPS):
        batch = dict.fromkeys(rows, 1)
        state["meta"] = meta = graph_pool.plan(batch, graph=True)  # host: writes the persistent buffers
        n = len(rows)
        x = [rand(n, h_q), rand(n, P_HKV), rand(n, P_HKV)]
        for buf, xi in zip(static, x):
            buf[:, :n].copy_(xi)
            buf[:, n:].fill_(float("nan"))  # padding rows: never stored (slot -1), out 0
        if replay is None:
            replay = capture(lambda: _paged_step(graph_pool, state["meta"], *static))
            captured = _graph_view(meta)
        assert _graph_view(meta) == captured, f"step {step}: graph metadata moved or resized: {_graph_view(meta)}"
        out, qs = (t.clone() for t in replay())
        e_out, _e_qs = _paged_step(eager_pool, eager_pool.plan(batch), *(xi.to(device) for xi in x))

        for i, ns in enumerate(rows):
            for layer in range(P_LAYERS):
                hk, hv = hist[ns, layer]
                hist[ns, layer] = (torch.cat([hk, x[1][layer, i : i + 1]]), torch.cat([hv, x[2][layer, i : i + 1]]))
        for layer in range(P_LAYERS):
            ref = torch.cat([_dense(qs[layer, i : i + 1], *hist[ns, layer])[0] for i, ns in enumerate(rows)])
            assert_close(out[layer, :n], ref, BF16, f"step {step} ({rows}) layer {layer}: graph replay vs fp64")
        assert_close(out[:, :n], e_out, BF16, f"step {step} ({rows}): graph replay vs the eager pool")
        pad = out[:, n:]
        assert (pad == 0).all(), (
            f"step {step}: padding rows (seq_len 0) must give 0, got max |out| {pad.abs().amax().item()} "
            f"(NaN: {bool(pad.isnan().any())})")
        for ns in P_PREFILL:
            want = hist[ns, 0][0].shape[0]
            assert graph_pool.seq_len(ns) == eager_pool.seq_len(ns) == want, (
                f"step {step}: {ns!r} seq_len graph {graph_pool.seq_len(ns)} / eager {eager_pool.seq_len(ns)}, "
                f"expected {want}")
            for layer in range(P_LAYERS):
                for what, got, eager, sent in zip("KV", _stored(graph_pool, ns, layer), _stored(eager_pool, ns, layer),
                                                   hist[ns, layer]):
                    bad = got.cpu() != sent  # NaN (a slot never written, a padding row stored) counts
                    assert not bad.any(), (
                        f"step {step}: {ns!r} layer {layer}: stored {what} differs from what was given "
                        f"at tokens {_where(bad.any(-1).any(-1))}")
                    assert torch.equal(got, eager), f"step {step}: {ns!r} layer {layer}: {what} differs from eager"
        assert graph_pool.free == eager_pool.free, f"step {step}: free blocks {graph_pool.free} vs {eager_pool.free}"


@cuda_test
def test_cuda_graph_replays_paged_decode_steps(seed) -> None:
    """One decode step (store + attend for 3 layers through ``PagedKVCache.forward``, bf16,
    GQA 4, page 16) captured once in a CUDA graph after a prefill of 5, 14 and 31 tokens,
    then replayed for 5 steps: each step's ``plan(graph=True)`` (host) rewrites the
    persistent metadata buffers (their addresses and host sizes never change, asserted),
    the step's q/k/v are copied into the static inputs, and the replay's outputs must match
    an eager pool fed the same tokens and an fp64 reference (TOL bf16), while rows change
    order, a sequence skips a step (padding rows, NaN inputs: output exactly 0, nothing
    stored) and two sequences cross a block edge (a new block in the replayed table). The
    stored K/V equal what was given and the eager pool's, bit for bit; unwritten slots
    are NaN, so a stray read fails."""
    _paged_graph_decode("cuda", cuda_graph, seed)


# ----------------------------------------------------------------------------- 2. slab rollout under CUDA graphs

S_LAYERS, S_HKV, S_GROUP, S_D = 2, 2, 2, 32
S_NS = ("v0/cond", "v0/uncond")  # two rollouts (CFG branches) in every plan
S_SINKS, S_WINDOW = 1, 2  # chunk form: chunk 0 kept forever, the window includes the chunk itself
S_DENOISE = 4  # denoising steps per chunk (Self-Forcing), all on the chunk's one plan


def _visible(c: int) -> list[int]:
    """The test's own statement of the chunks chunk c sees (sinks, then the window)."""
    return sorted({i for i in range(c + 1) if i < S_SINKS or i > c - S_WINDOW})


def _slab_step(pool, meta, q, k, v, commit: bool):
    """One model pass of a chunk through every layer of ``pool`` (``commit=False``: a
    denoising step; True: the clean pass), layer l's query plus layer l-1's output as in
    :func:`_paged_step`. ``q [L, B, T, H_q, D]``, ``k, v [L, B, T, H_kv, D]``; returns
    ``(outputs, queries used)`` ``[L, B, T, H_q, D]``."""
    outs, qs, prev = [], [], None
    for layer in range(q.shape[0]):
        ql = q[layer] if prev is None else q[layer] + prev
        prev = pool.forward(ql, k[layer], v[layer], meta, layer, commit=commit)
        outs.append(prev)
        qs.append(ql)
    return torch.stack(outs), torch.stack(qs)


def _slab_graph_rollout(device: str, capture, seed: int, *, slab_tokens: int = 64, chunks: int = 6) -> None:
    """The body of :func:`test_cuda_graph_replays_slab_denoise_and_commit_per_chunk`."""
    gen = torch.Generator().manual_seed(seed)
    st, b, h_q = slab_tokens, len(S_NS), S_HKV * S_GROUP
    lay = KVLayout(num_layers=S_LAYERS, num_kv_heads=S_HKV, head_dim=S_D, dtype=BF16)
    slab_bytes = lay.block_bytes(st)
    # The contract's bound per rollout: ceil(S / T) + ceil(W / T) + 2 slabs.
    policy = CachePolicy("slab_kv", max_bytes=b * (S_SINKS + S_WINDOW + 2) * slab_bytes,
                         per_component={"sinks": S_SINKS, "window": S_WINDOW})
    graph_pool, eager_pool = (SlabKVCache(policy, layout=lay, slab_tokens=st, device=device, attention=TRITON_SPEC)
                              for _ in range(2))
    for pool in (graph_pool, eager_pool):
        pool.arena.buffer.fill_(0xFF)  # NaN everywhere nothing was committed: a stray read shows

    def rand():
        return [torch.randn(S_LAYERS, b, st, h, S_D, generator=gen).to(BF16) for h in (h_q, S_HKV, S_HKV)]

    static = [torch.zeros(S_LAYERS, b, st, h, S_D, dtype=BF16, device=device) for h in (h_q, S_HKV, S_HKV)]
    committed: dict = {}  # (ns, chunk) -> (k, v) [L, T, H_kv, D] of its clean pass
    slab_of: dict = {}  # (ns, chunk) -> its slab's address (from get())
    for c in range(chunks):
        batch = dict.fromkeys(S_NS, c)
        meta_g, meta_e = graph_pool.plan(batch), eager_pool.plan(batch)  # once per chunk: 4 denoise steps + commit
        steps = [(False, rand()) for _ in range(S_DENOISE)] + [(True, rand())]
        replays = {}
        for i, (commit, x) in enumerate(steps):
            for buf, xi in zip(static, x):
                buf.copy_(xi)
            if commit not in replays:  # per chunk: the plan's tensors are new (see the test's docstring)
                replays[commit] = capture(
                    lambda commit=commit, meta=meta_g: _slab_step(graph_pool, meta, *static, commit=commit))
            out, qs = (t.clone() for t in replays[commit]())
            e_out, _e_qs = _slab_step(eager_pool, meta_e, *(xi.to(device) for xi in x), commit=commit)
            what = f"chunk {c} {'commit' if commit else f'denoise step {i}'}"
            for layer in range(S_LAYERS):
                for r, ns in enumerate(S_NS):
                    hist = [committed[ns, j] for j in _visible(c) if j < c]
                    keys = torch.cat([h[0][layer] for h in hist] + [x[1][layer, r]])
                    vals = torch.cat([h[1][layer] for h in hist] + [x[2][layer, r]])
                    ref = _dense(qs[layer, r], keys, vals)[0]
                    assert_close(out[layer, r], ref, BF16, f"{what} layer {layer} {ns}: graph replay vs fp64")
            assert_close(out, e_out, BF16, f"{what}: graph replay vs the same rollout run eagerly")
        for r, ns in enumerate(S_NS):
            committed[ns, c] = (steps[-1][1][1][:, r], steps[-1][1][2][:, r])
        del replays
        for ns in S_NS:
            held = {p: {s.chunk_index: s for s in p.get(ns)} for p in (graph_pool, eager_pool)}
            for p, name in ((graph_pool, "graph"), (eager_pool, "eager")):
                assert p.chunk_indices(ns) == _visible(c), f"chunk {c}: {name} {ns} holds {p.chunk_indices(ns)}"
                assert p.used_bytes == b * len(_visible(c)) * slab_bytes, f"chunk {c}: {name} used_bytes {p.used_bytes}"
            for j in _visible(c):
                gs, es = held[graph_pool][j], held[eager_pool][j]
                for what, got, eager, sent in (("K", gs.k, es.k, committed[ns, j][0]),
                                               ("V", gs.v, es.v, committed[ns, j][1])):
                    bad = got.cpu() != sent
                    assert not bad.any(), (f"chunk {c}: {ns} chunk {j}'s committed {what} differs from its clean "
                                           f"pass at [layer, token, head] {_where(bad.any(-1))}")
                    assert torch.equal(got, eager), f"chunk {c}: {ns} chunk {j}'s {what} differs from the eager pool's"
            slab_of[ns, c] = held[graph_pool][c].k.data_ptr()
            if c > S_SINKS + S_WINDOW - 1:  # chunk c takes over chunk c - 2's slab, in place
                assert slab_of[ns, c] == slab_of[ns, c - S_WINDOW], (
                    f"chunk {c} of {ns} is not in chunk {c - S_WINDOW}'s recycled slab")


@cuda_test
def test_cuda_graph_replays_slab_denoise_and_commit_per_chunk(seed) -> None:
    """A Self-Forcing-style rollout (2 CFG rollouts, 2 layers, bf16, GQA 2, 64-token
    slabs, sinks 1 + window 2 chunks, 6 chunks: slabs recycled in place from chunk 3 on,
    asserted by address) run with CUDA graphs, against the same rollout run eagerly (TOL
    bf16) and an fp64 reference over the visible committed chunks plus the step's own k/v.

    Captured PER CHUNK, replayed per step: after the chunk's one ``plan``, the denoising
    pass (``commit=False``, every layer) is captured once and replayed for its 4 denoising
    steps (new q/k/v copied into the static inputs each time; Self-Forcing runs its
    denoising steps of a chunk on the same metadata), then the clean pass (``commit=True``)
    is captured and replayed. One graph cannot serve the next chunk: ``SlabKVCache.plan``
    builds new metadata tensors each call (one fresh upload of every table, length and
    offset, and a new ``slot_mapping``: ``_upload`` in kvarena/cache/slab/meta.py) where
    the paged pool's ``graph_capacity`` has persistent buffers; its tables' widths and host
    maxima (``max_seqlen_k``, ``hist_max_seqlen_k``, ``has_kv_start``, ``page_tokens``,
    ``build_meta`` there) change with the chunk index until the window is full; and the
    commit flags are host records set by ``forward`` (kvarena/cache/slab/pool.py), which a replay does
    not run (here the capture's host pass sets them). The committed slabs equal the clean
    passes' k/v and the eager pool's, bit for bit."""
    _slab_graph_rollout("cuda", cuda_graph, seed)


# ----------------------------------------------------------------------------- 3. fp8 decodes over every byte

BYTES = torch.arange(256, dtype=torch.uint8)
FP8_ONE = 0x38  # e4m3 0 0111 000 = 1.0
# Softmax scale of the K test: sigmoid(K_SCALE * k) stays below saturation over e4m3's
# range (|k| <= 448 -> |x| <= 7), and adjacent e4m3 values give outputs >= 7.6e-6 apart
# (the subnormal step 2**-9 at sigmoid'(0) = 1/4), above K_ABS_TOL.
K_SCALE = 2.0**-6
K_ABS_TOL = 2e-6
DECODES = [
    pytest.param("native", marks=[pytest.mark.gpu, needs_cuda, needs_sm89], id="native"),
    pytest.param("shift", marks=INTERPRETER, id="shift"),  # runs on CPU too (CI)
]


def _torch_decoded() -> torch.Tensor:
    """torch's own float8_e4m3fn conversion of every byte, fp32 ``[256]`` (the independent
    reference); NaN at exactly 0x7F and 0xFF."""
    ref = BYTES.view(FP8).float()
    assert ref.isnan().nonzero().flatten().tolist() == [0x7F, 0xFF], "torch's e4m3fn NaN bytes moved"
    assert ref[FP8_ONE].item() == 1.0
    return ref


def _force_decode(monkeypatch, decode: str) -> None:
    from kvarena.kernels import attn_plan

    monkeypatch.setattr(attn_plan, "fp8_native", lambda capability: decode == "native")


def _fp8_caches(nseq: int, bs: int, h: int, d: int, rows: int, gen: torch.Generator):
    """NaN-poisoned fp8 caches (bytes 0x7F, scales NaN) of one block per sequence, in random
    block order; the first ``rows`` rows of each used block get unit scales. Returns the
    uint8 K and V bytes, the scales, the block of each sequence and its block table."""
    kb = torch.full((nseq, bs, h, d), 0x7F, dtype=torch.uint8)
    vb = kb.clone()
    ks = torch.full((nseq, bs, h), float("nan"))
    ks[:, :rows] = 1.0
    blocks = torch.randperm(nseq, generator=gen)
    return kb, vb, ks, ks.clone(), blocks, blocks[:, None].to(torch.int32)


def _fp8_v_case(device: str, dtype: torch.dtype, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    """16 sequences of ONE visible key (zero K bytes: score 0, softmax weight exactly 1)
    whose V row holds bytes ``16 s .. 16 s + 15``; 2 query heads read the one kv head. The
    output is the decoded V: ``out[s, h, d] = decoded byte 16 s + d`` (returned as ``want``)."""
    nseq, d = 16, 16
    kb, vb, ks, vs, blocks, table = _fp8_caches(nseq, 16, 1, d, 1, gen)
    kb[blocks, 0] = 0
    vb[blocks, 0, 0] = BYTES.view(nseq, d)
    case = dict(q=torch.randn(nseq, 2, d, generator=gen).to(dtype), k_cache=kb, v_cache=vb, block_table=table,
                seq_lens=torch.ones(nseq, dtype=torch.int32), k_scale=ks, v_scale=vs)
    want = _torch_decoded().view(nseq, 1, d).expand(nseq, 2, d)
    return _on(case, device), want


def _k_grid() -> torch.Tensor:
    """The byte each (sequence, query head) of the K test reads, int64 ``[18, 16]``. Rows
    0..15: bytes ``16 r + g``, except the NaN bytes 0x7F and 0xFF, which sit alone in rows
    16 and 17 (dimension 0, zeros elsewhere): a NaN in a key reaches every query head of its
    kv head through ``0 * NaN``, so row 7 and 15's other bytes stay testable this way."""
    grid = torch.arange(256).view(16, 16)
    grid[(grid == 0x7F) | (grid == 0xFF)] = 0
    alone = torch.zeros(2, 16, dtype=torch.long)
    alone[:, 0] = torch.tensor([0x7F, 0xFF])
    return torch.cat([grid, alone])


def _fp8_k_case(device: str, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    """18 sequences (the rows of :func:`_k_grid`) of two keys, one kv head read by 16
    query heads: key 0 zero bytes with v0 = 0; key 1 the row's 16 tested bytes, one per
    dimension, with v1 = 1; query head g one-hot on dimension g. Then ``out[r, g, :] =
    sigmoid(K_SCALE * decoded grid[r, g])`` exactly in real arithmetic (``want``, fp64;
    NaN in rows 16 and 17)."""
    grid = _k_grid()
    nseq, h_q, d = grid.shape[0], 16, 16
    kb, vb, ks, vs, blocks, table = _fp8_caches(nseq, 16, 1, d, 2, gen)
    kb[blocks, :2] = 0
    kb[blocks, 1, 0] = grid.to(torch.uint8)
    vb[blocks, :2] = 0
    vb[blocks, 1] = FP8_ONE
    q = torch.eye(h_q, d).expand(nseq, h_q, d).contiguous()
    case = dict(q=q, k_cache=kb, v_cache=vb, block_table=table, seq_lens=torch.full((nseq,), 2, dtype=torch.int32),
                k_scale=ks, v_scale=vs)
    want = torch.sigmoid(K_SCALE * _torch_decoded().double()[grid])
    want[16:] = float("nan")
    return _on(case, device), want[..., None].expand(nseq, h_q, d)


def _on(case: dict, device: str) -> dict:
    """The case on ``device``, the uint8 caches viewed as float8_e4m3fn."""
    out = {name: t.to(device) for name, t in case.items()}
    out["k_cache"], out["v_cache"] = out["k_cache"].view(FP8), out["v_cache"].view(FP8)
    return out


def _attend(case: dict, **kw) -> torch.Tensor:
    return kvarena.paged_attention(**case, backend="triton", **kw)


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """``a`` and ``b`` bit for bit where finite (the two zeros compare equal), NaN at the
    same positions."""
    na, nb = a.isnan(), b.isnan()
    assert torch.equal(na, nb), f"{what}: NaN in one decode only, at {_where(na != nb)}"
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    ia, ib = (torch.where(n | (x == 0), torch.zeros_like(x), x).view(ints) for x, n in ((a, na), (b, nb)))
    bad = ia != ib
    assert not bad.any(), (f"{what}: {int(bad.sum())} entries differ, first at {_where(bad)} "
                           f"(native {a[bad][:5].tolist()}, shift {b[bad][:5].tolist()})")


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("decode", DECODES)
def test_fp8_v_decode_of_every_byte_equals_torch(monkeypatch, seed, decode, dtype) -> None:
    """All 256 e4m3 bytes as V values behind a softmax weight of exactly 1 (one visible
    key per sequence): the output must be torch's own ``uint8 -> float8_e4m3fn -> float32``
    conversion exactly (bf16 and fp32 hold every e4m3 value), NaN at exactly the bytes 0x7F
    and 0xFF and nowhere else (-0.0 compares equal to +0.0). Unread slots are NaN bytes
    with NaN scales. ``native``: the sm_89+ widening, also compared bit for bit with the
    shift decode on the same GPU; ``shift``: the sm_80 decode (in the interpreter on CPU)."""
    gen = torch.Generator().manual_seed(seed)
    device = "cuda" if decode == "native" else DEVICE
    case, want = _fp8_v_case(device, dtype, gen)
    _force_decode(monkeypatch, decode)
    out = _attend(case)
    assert out.isnan().sum().item() == 2 * 2, f"{decode}: NaN at {_where(out.isnan(), 8)}, expected 0x7F, 0xFF only"
    assert_close(out, want, dtype, f"fp8 V, {decode} decode vs torch's conversion", tol=0.0)
    if decode == "native":
        _force_decode(monkeypatch, "shift")
        _assert_same_bits(out, _attend(case), "fp8 V: native vs shift decode")


@pytest.mark.parametrize("decode", DECODES)
def test_fp8_k_decode_of_every_byte_matches_torch(monkeypatch, seed, decode) -> None:
    """All 256 e4m3 bytes as K values: with a zero key 0 (v0 = 0), the tested key 1 (v1 =
    1) and one-hot fp32 queries, each output row is ``sigmoid(scale * decoded k)`` of one
    byte; it must match torch's conversion to fp32 level (``K_ABS_TOL`` per element, below
    the output gap of adjacent e4m3 values, and TOL fp32), NaN exactly in the rows of the
    bytes 0x7F and 0xFF and nowhere else. ``native`` also equals the shift decode bit for
    bit on the same GPU."""
    gen = torch.Generator().manual_seed(seed)
    device = "cuda" if decode == "native" else DEVICE
    case, want = _fp8_k_case(device, gen)
    _force_decode(monkeypatch, decode)
    out = _attend(case, scale=K_SCALE)
    nan = out.isnan()
    assert nan[16:].all() and not nan[:16].any(), (
        f"{decode}: NaN at [seq, head, d] {_where(nan[:16], 8)} (expected none there) or missing in the rows "
        f"of bytes 0x7F and 0xFF ({int(nan[16:].sum())} of {nan[16:].numel()} NaN)")
    assert_close(out, want, torch.float32, f"fp8 K, {decode} decode vs torch's conversion")
    err = (out[:16].double().cpu() - want[:16]).abs().amax(-1)  # [row, head]
    r, g = divmod(int(err.argmax()), 16)
    byte = int(_k_grid()[r, g])
    assert err[r, g].item() <= K_ABS_TOL, (
        f"fp8 K, {decode}: |out - sigmoid(scale * k)| {err[r, g].item():.3e} > {K_ABS_TOL:.0e} for byte "
        f"{byte:#04x} (got {out[r, g, 0].item():.9g}, ref {want[r, g, 0].item():.9g})")
    if decode == "native":
        _force_decode(monkeypatch, "shift")
        _assert_same_bits(out, _attend(case, scale=K_SCALE), "fp8 K: native vs shift decode")


# ----------------------------------------------------------------------------- 4. an arena past 2**31 elements

BIG_BS, BIG_HKV, BIG_D, BIG_GROUP = 16, 8, 128, 4
BIG_LENS = [600, 129, 17]  # 38 + 9 + 2 blocks; 600 keys split the decode launch
BIG_TAIL = 64  # the attended blocks are drawn from the arena's last 64, the very last included
# Each cache view ([blocks, 16, 8, 128] of a [blocks, k/v, 16, 8, 128] arena) spans > 2**31
# elements; the arena itself 2**32+.
BIG_BLOCKS = 2**31 // (BIG_BS * BIG_HKV * BIG_D) + BIG_TAIL
BIG_MIN_FREE = 16 << 30


def _big_arena_attention(device: str, num_blocks: int, fp8: bool, seed: int) -> None:
    """The body of :func:`test_arena_past_2_31_elements_attended_at_its_end`."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, BIG_BS, BIG_HKV, BIG_D)  # one allocation, K and V interleaved per block
    if fp8:
        arena = torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8)  # NaN bytes
        scales = torch.full(shape[:-1], float("nan"), device=device)
        kv_scales = dict(k_scale=scales[:, 0], v_scale=scales[:, 1])
    else:
        arena = torch.full(shape, float("nan"), dtype=BF16, device=device)
        kv_scales = {}
    k_cache, v_cache = arena[:, 0], arena[:, 1]
    need = [-(-n // BIG_BS) for n in BIG_LENS]
    ids = [num_blocks - 1] + (torch.randperm(BIG_TAIL - 1, generator=gen) + num_blocks - BIG_TAIL).tolist()
    table = torch.zeros(len(BIG_LENS), max(need) + 1, dtype=torch.int32)  # padding: block 0, NaN, never read
    slots = []
    for b, (n, nb) in enumerate(zip(BIG_LENS, need)):
        table[b, :nb] = torch.tensor(ids[:nb])
        ids = ids[nb:]
        slots += [int(table[b, t // BIG_BS]) * BIG_BS + t % BIG_BS for t in range(n)]
    total = sum(BIG_LENS)
    k = torch.randn(total, BIG_HKV, BIG_D, generator=gen).to(BF16)
    v = torch.randn(total, BIG_HKV, BIG_D, generator=gen).to(BF16)
    kvarena.store_kv(k.to(device), v.to(device), k_cache, v_cache, torch.tensor(slots, dtype=torch.int32, device=device),
                     backend="triton", **kv_scales)

    # What was stored, gathered through the table (fp64; fp8: bytes times scales, in torch).
    stored = []
    for b, (n, nb) in enumerate(zip(BIG_LENS, need)):
        blocks = table[b, :nb].long().to(device)
        kv = []
        for i, cache in enumerate((k_cache, v_cache)):
            x = cache.view(torch.uint8)[blocks].view(FP8).float() if fp8 else cache[blocks].float()
            if fp8:
                x = x * kv_scales["k_scale" if i == 0 else "v_scale"][blocks][..., None]
            kv.append(x.flatten(0, 1)[:n].double().cpu())
        stored.append(kv)
    off = list(itertools.accumulate([0, *BIG_LENS]))
    for b, (ks, vs) in enumerate(stored):
        for what, got, sent in (("K", ks, k[off[b] : off[b + 1]]), ("V", vs, v[off[b] : off[b + 1]])):
            sent = sent.double()
            # bf16: the same values; fp8: e4m3's bound (2**-4 of each value + a subnormal step).
            bound = sent.abs() / 16 + (sent.abs().amax(-1, keepdim=True) / 448) * 2.0**-10 if fp8 else 0.0
            bad = (got - sent).abs() > bound * 1.001 if fp8 else got != sent
            assert not bad.any(), f"sequence {b}: stored {what} wrong at [token, head, d] {_where(bad)}"

    h_q = BIG_HKV * BIG_GROUP
    for name, q_lens in (("decode", [1, 1, 1]), ("prefill", [5, 3, 1])):
        q = torch.randn(sum(q_lens), h_q, BIG_D, generator=gen).to(BF16)
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        out, lse = kvarena.paged_attention(
            q.to(device), k_cache, v_cache, table.to(device), torch.tensor(BIG_LENS, dtype=torch.int32, device=device),
            cu.to(device), max_seqlen_q=max(q_lens), max_seqlen_k=max(BIG_LENS), return_lse=True, backend="triton",
            **kv_scales)
        refs = [_dense(q[cu[b] : cu[b + 1]], *stored[b], causal=True) for b in range(len(BIG_LENS))]
        ref_out, ref_lse = torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs])
        assert_attention_close(out.cpu(), lse.cpu(), ref_out, ref_lse, BF16,
                               f"{'fp8' if fp8 else 'bf16'} arena of {num_blocks} blocks, {name}")


@cuda_test
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_arena_past_2_31_elements_attended_at_its_end(seed, fp8) -> None:
    """int64 addressing: an arena ``[131136 blocks, k/v, 16, 8, 128]`` (2**32+ elements;
    each cache view spans > 2**31) poisoned with NaN (bytes 0x7F and NaN scales for fp8),
    whose last 64 blocks (the very last one included) hold 3 sequences of 600, 129 and 17
    tokens written by ``store_kv``. The stored values are checked (bf16 exact, fp8 within
    e4m3's bound), then ``paged_attention`` decode (split-KV) and a short causal prefill
    against fp64 on the gathered blocks (TOL bf16, lse too). A 32-bit wrap of any address
    reads NaN and fails."""
    assert (BIG_BLOCKS - 1) * BIG_BS * BIG_HKV * BIG_D * 2 >= 2**32 > 2**31 > BIG_BLOCKS * BIG_BS  # slots int32
    free, _total = torch.cuda.mem_get_info()
    if free < BIG_MIN_FREE:
        pytest.skip(f"needs {BIG_MIN_FREE >> 30} GiB of free device memory, {free / 2**30:.1f} GiB free")
    _big_arena_attention("cuda", BIG_BLOCKS, fp8, seed)
