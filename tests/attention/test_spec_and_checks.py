"""The option contract (issue 9): per-layer AttentionSpecs, per-call overrides, every check
before the first write, fresh metadata, invisible keys never read, gradients to the given
k/v, and one TypeError/ValueError naming the argument for every bad input.

Each test here failed on the code before the redesign (the breach is named in its
docstring) and passes after it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _helpers import INTERPRETER, TOL, assert_close, one_torch_thread  # noqa: F401 - autouse fixture

import kvarena
from kvarena import AttentionSpec, CachePolicy, KVArena, KVLayout, PagedKVCache, SlabKVCache
from kvarena.attention.reference import paged_attention_ref
from kvarena.cache._meta import StaleMetadataError

H_Q, H_KV, D = 4, 2, 16
BS = 4  # paged block size
ST = 5  # slab tokens
LAY = KVLayout(num_layers=2, num_kv_heads=H_KV, head_dim=D, dtype=torch.float32)


pytestmark = pytest.mark.usefixtures("seed")  # every test seeded (conftest's one seed fixture)


def paged_pool(layout=LAY, **kw) -> PagedKVCache:
    return PagedKVCache(CachePolicy("paged_kv", layout.block_bytes(BS) * 24), layout=layout, block_size=BS, **kw)


def slab_pool(layout=LAY, **kw) -> SlabKVCache:
    policy = CachePolicy("slab_kv", layout.block_bytes(ST) * 8, per_component={"window": 2, "sinks": 1})
    return SlabKVCache(policy, layout=layout, slab_tokens=ST, **kw)


def pool_state(pool) -> tuple:
    """Everything a forward could change, as public state: arena bytes, the allocator's
    state, per-namespace records (paged: block lists per group, length, table row and the
    device table; slab: the rollout record with its chunks' commit flags)."""
    buf = pool.arena.buffer.clone()  # compared bytewise: NaN-safe
    if isinstance(pool, PagedKVCache):
        a = pool.allocator
        groups = range(len(pool.layout.layer_groups))
        recs = {ns: ([pool.block_ids(ns, g) for g in groups], pool.seq_len(ns), pool.table_row(ns))
                for ns in pool.namespaces()}
        recs["table"] = pool.table.cpu().tolist()
    else:
        a = pool.region.allocator
        recs = {ns: pool.rollout_info(ns) for ns in pool.namespaces()}
    return buf, a.state(), recs


def assert_unchanged(before: tuple, pool, what: str) -> None:
    after = pool_state(pool)
    assert torch.equal(before[0], after[0]), f"{what}: the arena bytes changed"
    assert before[1:] == after[1:], f"{what}: the pool's bookkeeping changed"


# --------------------------------------------------------------------------------------- setups
# Each setup returns (pool, call) where call(**options) runs one forward with valid
# tensors: a paged prefill step, a slab clean pass and a slab denoising step (chunk 1,
# so the history is read), all on layer 1.


def _paged_setup(layout=LAY):
    pool = paged_pool(layout)
    meta = pool.plan({"a": 5, "b": 3})
    dt = layout.dtype
    q, k, v = torch.randn(8, H_Q, D, dtype=dt), torch.randn(8, H_KV, D, dtype=dt), torch.randn(8, H_KV, D, dtype=dt)

    def call(q=q, k=k, v=v, meta=meta, layer=1, **options):
        return pool.forward(q, k, v, meta, layer, **options)

    return pool, call


def _slab_setup(commit: bool, layout=LAY):
    pool = slab_pool(layout)
    dt = layout.dtype
    for c in (0,):  # a committed history chunk
        m = pool.plan({"a": c})
        for layer in range(layout.num_layers):
            pool.forward(torch.randn(1, ST, H_Q, D, dtype=dt), torch.randn(1, ST, H_KV, D, dtype=dt),
                         torch.randn(1, ST, H_KV, D, dtype=dt), m, layer)
    meta = pool.plan({"a": 1})
    q = torch.randn(1, ST, H_Q, D, dtype=dt)
    k, v = torch.randn(1, ST, H_KV, D, dtype=dt), torch.randn(1, ST, H_KV, D, dtype=dt)

    def call(q=q, k=k, v=v, meta=meta, layer=1, commit=commit, **options):
        return pool.forward(q, k, v, meta, layer, commit=commit, **options)

    return pool, call


SETUPS = {
    "paged": _paged_setup,
    "slab-commit": lambda layout=LAY: _slab_setup(True, layout),
    "slab-denoise": lambda layout=LAY: _slab_setup(False, layout),
}

# (id, keyword arguments of the bad call, exception, text the message must contain)
BAD_CALLS = [
    ("softcap-negative", dict(softcap=-1.0), ValueError, "softcap"),
    ("softcap-nan", dict(softcap=float("nan")), ValueError, "softcap"),
    ("scale-nan", dict(scale=float("nan")), ValueError, "scale"),
    ("scale-str", dict(scale="big"), TypeError, "scale"),
    ("return_lse-str", dict(return_lse="no"), TypeError, "return_lse"),
    ("deterministic-str", dict(deterministic="no"), TypeError, "deterministic"),
    ("num_splits-0", dict(num_splits=0), ValueError, "num_splits"),
    ("num_splits-float", dict(num_splits=2.0), TypeError, "num_splits"),
    ("backend-unknown", dict(backend="cuda"), ValueError, "backend"),
    ("unknown-keyword", dict(flash=True), TypeError, "flash"),
    ("out", dict(out=torch.empty(8, H_Q, D)), TypeError, "out"),
    ("kv_start", dict(kv_start=torch.zeros(2, dtype=torch.int32)), TypeError, "kv_start"),
    ("causal", dict(causal=False), TypeError, "causal"),
    ("layer-out-of-range", dict(layer=2), ValueError, "layer"),
    ("layer-negative", dict(layer=-1), ValueError, "layer"),
    ("layer-bool", dict(layer=True), TypeError, "layer"),
    ("q-not-a-tensor", dict(q="queries"), TypeError, "q"),
    ("q-wrong-dtype", dict(q=torch.randn(8, H_Q, D, dtype=torch.float64)), (TypeError, ValueError), "q"),
    ("k-wrong-heads", dict(k=torch.randn(8, 3, D)), ValueError, "k"),
    ("v-not-a-tensor", dict(v=[1.0]), TypeError, "v"),
    ("meta-not-metadata", dict(meta=object()), TypeError, "meta"),
]
PAGED_ONLY_BAD = [
    ("window_left-negative", dict(window_left=-3), ValueError, "window_left"),
    ("sink_tokens-negative", dict(sink_tokens=-1), ValueError, "sink_tokens"),
    ("chunk_size-0", dict(chunk_size=0), ValueError, "chunk_size"),
]
SLAB_ONLY_BAD = [
    ("slab-window_left", dict(window_left=5), TypeError, "window_left"),
    ("slab-sink_tokens", dict(sink_tokens=2), TypeError, "sink_tokens"),
    ("slab-chunk_size", dict(chunk_size=5), TypeError, "chunk_size"),
    ("slab-commit-int", dict(commit=1), TypeError, "commit"),
]


def _bad_cases():
    for setup in SETUPS:
        extra = PAGED_ONLY_BAD if setup == "paged" else SLAB_ONLY_BAD
        for cid, kw, exc, text in BAD_CALLS + extra:
            yield pytest.param(setup, kw, exc, text, id=f"{setup}-{cid}")


def _fit(kw: dict, setup: str) -> dict:
    """Shape the tensors of a bad call to the setup (slab calls are [B, T, H, D])."""
    if setup == "paged":
        return kw
    out = {}
    for name, val in kw.items():
        if isinstance(val, torch.Tensor) and val.dim() == 3 and name in ("q", "k", "v", "out"):
            val = val[:ST].unsqueeze(0)
        out[name] = val
    return out


@pytest.mark.parametrize(("setup", "kw", "exc", "text"), list(_bad_cases()))
def test_bad_call_raises_before_any_write(setup, kw, exc, text) -> None:
    """Bugs 1, 2, 7: a forward that raises had already stored K/V (and the slab marked the
    chunk committed); slab forward accepted window_left/sink_tokens/chunk_size and
    applied them differently for commit=True and False; non-bool flags were accepted."""
    pool, call = SETUPS[setup]()
    before = pool_state(pool)
    with pytest.raises(exc, match=text):
        call(**_fit(kw, setup))
    assert_unchanged(before, pool, f"{setup} {kw}")


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_backend_that_cannot_run_the_call_raises_before_any_write(setup) -> None:
    """Bug 2: backend='triton' for an fp64 cache, and 'triton' under autograd, raised only
    after the K/V were stored."""
    lay64 = KVLayout(num_layers=2, num_kv_heads=H_KV, head_dim=D, dtype=torch.float64)
    pool, call = SETUPS[setup](lay64)
    before = pool_state(pool)
    with pytest.raises(TypeError, match="float64"):
        call(backend="triton")
    assert_unchanged(before, pool, "triton on fp64")


def test_triton_backward_refuses_gradients_into_a_cache_tensor() -> None:
    """The Triton backward differentiates w.r.t. q and the keys given in a call; a cache
    tensor that requires grad (functional op) needs the torch path: a clear error names it."""
    kc = torch.randn(2, 4, H_KV, D, requires_grad=True)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_cache"):
        kvarena.paged_attention(torch.randn(1, H_Q, D), kc, kc.detach(), table, lens, backend="triton")
    out = kvarena.paged_attention(torch.randn(1, H_Q, D), kc, kc.detach(), table, lens)  # auto: torch path
    out.sum().backward()
    assert kc.grad is not None and torch.isfinite(kc.grad).all()


def test_slab_result_does_not_depend_on_commit_for_every_accepted_option() -> None:
    """Bug 1: an option applied with its own positions per commit mode changed the answer
    (max diff ~1.1 for window_left=5). Every option the slab forward accepts now gives the
    same result for commit=True and commit=False."""
    for options in ({}, dict(softcap=2.0), dict(scale=0.1), dict(num_splits=1, deterministic=True)):
        torch.manual_seed(1)
        _, denoise = _slab_setup(False)
        torch.manual_seed(1)  # the same history chunk in both pools
        pool, _ = _slab_setup(True)
        m = pool.plan({"a": 1})
        torch.manual_seed(5)
        q, k, v = torch.randn(1, ST, H_Q, D), torch.randn(1, ST, H_KV, D), torch.randn(1, ST, H_KV, D)
        got_commit = pool.forward(q, k, v, m, 1, commit=True, **options)
        got_denoise = denoise(q=q, k=k, v=v, **options)
        assert torch.allclose(got_commit, got_denoise, atol=1e-5), f"{options}: commit=True and False differ"


# --------------------------------------------------------------------------------------- staleness


@pytest.mark.parametrize("change", ["free_namespace", "truncate", "replan", "fork"])
def test_stale_paged_metadata_raises_on_cpu_without_debug(monkeypatch, change) -> None:
    """Bug 3: without KVARENA_DEBUG, stale metadata was accepted and wrote into blocks that
    now belong to another request. On CPU the check always runs (an O(1) epoch test in the
    common case, so it costs nothing per layer)."""
    monkeypatch.delenv("KVARENA_DEBUG", raising=False)
    pool = paged_pool()
    meta = pool.plan({"a": 5})
    if change == "free_namespace":
        pool.free_namespace("a")
    elif change == "truncate":
        pool.truncate("a", 2)
    elif change == "replan":
        pool.plan({"a": 1})
    else:
        pool.fork("a", "a2")
    pool.plan({"b": 8})  # takes any blocks 'a' gave back
    before = pool_state(pool)
    q, k = torch.randn(5, H_Q, D), torch.randn(5, H_KV, D)
    with pytest.raises(StaleMetadataError, match="'a'"):
        pool.forward(q, k, k, meta, 0)
    assert_unchanged(before, pool, f"stale metadata after {change}")


def test_metadata_of_other_namespaces_stays_valid_after_a_plan() -> None:
    """The epoch fast path falls back to the per-namespace check, not to an error."""
    pool = paged_pool()
    m_a = pool.plan({"a": 3})
    pool.plan({"b": 2})
    out = pool.forward(torch.randn(3, H_Q, D), torch.randn(3, H_KV, D), torch.randn(3, H_KV, D), m_a, 0)
    assert out.shape == (3, H_Q, D)


def test_deepcopy_of_slab_metadata_commits_the_chunk() -> None:
    """Bug 7: committing through copy.deepcopy(meta) wrote the slab but left the chunk
    uncommitted (the copy's chunk records were copies)."""
    pool = slab_pool()
    meta = copy.deepcopy(pool.plan({"a": 0}))
    for layer in range(2):
        pool.forward(torch.randn(1, ST, H_Q, D), torch.randn(1, ST, H_KV, D), torch.randn(1, ST, H_KV, D),
                     meta, layer)
    assert [s.chunk_index for s in pool.get("a")] == [0], "the chunk must count as committed"
    m1 = pool.plan({"a": 1})  # chunk 0 is history now: its commit is checked per layer
    pool.forward(torch.randn(1, ST, H_Q, D), torch.randn(1, ST, H_KV, D), torch.randn(1, ST, H_KV, D), m1, 1,
                 commit=False)


# --------------------------------------------------------------------------------------- invisible keys

BACKENDS = ["torch", pytest.param("triton", marks=INTERPRETER)]
POISONS = [
    # (id, options, poisoned key position, query rows (of 13, at positions 0..12) that see it)
    ("before-the-window", dict(window_left=3), 2, range(2, 6)),
    ("causal-future", dict(), 9, range(9, 13)),
    ("block-causal-future-chunk", dict(chunk_size=4), 9, range(8, 13)),
    ("sink-then-window", dict(window_left=2, sink_tokens=1), 4, range(4, 7)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("options", "pos", "seen_by"), [pytest.param(*p[1:], id=p[0]) for p in POISONS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nan_in_an_invisible_key_never_reaches_a_row(backend, options, pos, seen_by, dtype) -> None:
    """Bug 4: masked weights were zeroed but 0 * NaN = NaN, so a NaN/inf value in a key
    outside the window or in the causal future poisoned rows that never see it (the
    torch path, and the Triton kernel on boundary tiles)."""
    n, bs = 13, 4
    kc = torch.randn(5, bs, 1, D, dtype=dtype)
    vc = torch.randn(5, bs, 1, D, dtype=dtype)
    table = torch.tensor([[3, 0, 4, 1]], dtype=torch.int32)
    lens, cu = torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    q = torch.randn(n, 2, D, dtype=dtype)
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), table, lens, cu, **options)
    blk, row = int(table[0, pos // bs]), pos % bs
    kc[blk, row, 0, 3] = float("nan")
    vc[blk, row, 0, 5] = float("inf")
    vc[blk, row, 0, 7] = float("nan")
    out = kvarena.paged_attention(q, kc, vc, table, lens, cu, backend=backend, **options)
    hit = torch.zeros(n, dtype=torch.bool)
    hit[list(seen_by)] = True
    assert out[hit].isnan().any(dim=(1, 2)).all(), "a row that sees the poisoned key must show it"
    assert torch.isfinite(out[~hit]).all(), f"NaN leaked into rows {(~torch.isfinite(out)).any(-1).any(-1).nonzero().flatten().tolist()}"
    assert_close(out[~hit], ref[~hit], dtype, f"{backend} rows that do not see key {pos}")


# --------------------------------------------------------------------------------------- gradients


def _dense(q, k, v):
    g = q.shape[-2] // k.shape[-2]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.repeat_interleave(g, 1))


# The Triton backward's fp32 bound (it recomputes P from the saved lse); the torch path
# differentiates the forward's own ops and meets the forward's bound.
GRAD_BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=INTERPRETER)]
GRAD_TOL = {"torch": None, "triton": 1e-4}


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_slab_commit_true_gives_gradients_to_k_and_v(backend) -> None:
    """Bug 6: forward(commit=True) under grad gave gradients for q only; k.grad/v.grad were
    silently None. Both commit modes now give the gradients of attention over the given
    k, v (the history is a constant), equal to a dense fp64 reference; with
    backend="triton" through the Triton backward."""
    grads = {}
    for commit in (True, False):
        pool, call = _slab_setup(commit)
        torch.manual_seed(7)
        q = torch.randn(1, ST, H_Q, D, requires_grad=True)
        k = torch.randn(1, ST, H_KV, D, requires_grad=True)
        v = torch.randn(1, ST, H_KV, D, requires_grad=True)
        w = torch.randn(1, ST, H_Q, D)
        out = call(q=q, k=k, v=v, backend=backend)
        grads[commit] = torch.autograd.grad((out * w).sum(), (q, k, v))
        hist = pool.get("a")[0]  # chunk 0 (the sink), layer 1
        kk = torch.cat([hist.k[1].double(), k[0].double()])
        vv = torch.cat([hist.v[1].double(), v[0].double()])
        qd = q[0].detach().double().requires_grad_()
        kd, vd = k.detach().double().requires_grad_(), v.detach().double().requires_grad_()
        kk = torch.cat([hist.k[1].double(), kd[0]])
        vv = torch.cat([hist.v[1].double(), vd[0]])
        ref = torch.autograd.grad((_dense(qd, kk, vv) * w[0].double()).sum(), (qd, kd, vd))
        for name, g, r in zip("qkv", grads[commit], (ref[0][None], ref[1], ref[2])):
            assert g is not None, f"commit={commit}: d/d{name} is None"
            assert_close(g, r, torch.float32, f"{backend} commit={commit} d/d{name}", tol=GRAD_TOL[backend])


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_paged_forward_gives_gradients_to_the_new_tokens(backend) -> None:
    """Bug 6 (paged): the new tokens' k, v were read back from the cache, so they got no
    gradient. Prefill of 5 tokens over 3 cached ones vs dense causal attention; with
    backend="triton" through the Triton backward."""
    pool = paged_pool()
    meta = pool.plan({"a": 3})
    k0, v0 = torch.randn(3, H_KV, D), torch.randn(3, H_KV, D)
    pool.forward(torch.randn(3, H_Q, D), k0, v0, meta, 0)
    meta = pool.plan({"a": 5})
    q = torch.randn(5, H_Q, D, requires_grad=True)
    k = torch.randn(5, H_KV, D, requires_grad=True)
    v = torch.randn(5, H_KV, D, requires_grad=True)
    w = torch.randn(5, H_Q, D)
    got = torch.autograd.grad((pool.forward(q, k, v, meta, 0, backend=backend) * w).sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = torch.cat([k0.double(), kd]), torch.cat([v0.double(), vd])
    g = H_Q // H_KV
    s = torch.einsum("qhd,khd->hqk", qd, kk.repeat_interleave(g, 1)) * D**-0.5
    causal = torch.arange(8)[None, :] <= torch.arange(3, 8)[:, None]
    s = s.masked_fill(~causal, float("-inf"))
    ref_out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv.repeat_interleave(g, 1))
    ref = torch.autograd.grad((ref_out * w.double()).sum(), (qd, kd, vd))
    for name, a, b in zip("qkv", got, ref):
        assert_close(a, b, torch.float32, f"{backend} paged d/d{name}", tol=GRAD_TOL[backend])


# --------------------------------------------------------------------------------------- per-layer specs


def test_per_layer_specs_and_overrides() -> None:
    """Layers differ (Gemma 2/3, gpt-oss alternate sliding and full layers): each layer
    attends with its own spec; a per-call override equals a pool built with it."""
    window = AttentionSpec(window_left=2, softcap=3.0)
    forms = {
        "list": [window, AttentionSpec()],
        "mapping-int": {0: window},
        "mapping-range": {range(0, 1): window},
    }
    q, k, v = torch.randn(6, H_Q, D), torch.randn(6, H_KV, D), torch.randn(6, H_KV, D)
    kc = torch.zeros(2, 6, H_KV, D)
    kc[0], kc[1] = k, v
    table, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    want = {layer: paged_attention_ref(q.double(), k[None].double(), v[None].double(), table, lens, cu,
                                       spec=spec) for layer, spec in ((0, window), (1, AttentionSpec()))}
    for name, attention in forms.items():
        pool = paged_pool(attention=attention)
        assert pool.attention_spec(0) == window and pool.attention_spec(1) == AttentionSpec(), name
        meta = pool.plan({"a": 6})
        for layer in (0, 1):
            assert_close(pool.forward(q, k, v, meta, layer), want[layer], torch.float32, f"{name} layer {layer}")
    plain = paged_pool()
    meta = plain.plan({"a": 6})
    got = plain.forward(q, k, v, meta, 1, window_left=2, softcap=3.0)
    assert_close(got, want[0], torch.float32, "per-call override")


@pytest.mark.parametrize(
    ("attention", "exc", "text"),
    [
        pytest.param([AttentionSpec()], ValueError, "1 specs for 2 layers", id="list-wrong-length"),
        pytest.param({0: AttentionSpec(), (0, 1): AttentionSpec()}, ValueError, "named twice", id="layer-twice"),
        pytest.param({5: AttentionSpec()}, ValueError, "num_layers", id="layer-out-of-range"),
        pytest.param({"all": AttentionSpec()}, TypeError, "key", id="str-key"),
        pytest.param({0: dict(window_left=2)}, TypeError, "AttentionSpec", id="dict-value"),
        pytest.param("window", TypeError, "attention", id="str"),
    ],
)
def test_bad_attention_argument(attention, exc, text) -> None:
    with pytest.raises(exc, match=text):
        paged_pool(attention=attention)


@pytest.mark.parametrize("name", ["window_left", "sink_tokens", "chunk_size", "causal"])
def test_slab_pool_rejects_visibility_in_its_specs(name) -> None:
    value = {"window_left": 4, "sink_tokens": 2, "chunk_size": 5, "causal": False}[name]
    with pytest.raises(ValueError, match=rf"attention\[0\]\.{name}"):
        slab_pool(attention=AttentionSpec(**{name: value}))


def test_slab_spec_softcap_is_honoured() -> None:
    pool = slab_pool(attention={1: AttentionSpec(softcap=0.5)})
    meta = pool.plan({"a": 0})
    q, k, v = torch.randn(1, ST, H_Q, D), torch.randn(1, ST, H_KV, D), torch.randn(1, ST, H_KV, D)
    table, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([ST], dtype=torch.int32)
    cu = torch.tensor([0, ST], dtype=torch.int32)
    for layer, softcap in ((0, None), (1, 0.5)):
        want = paged_attention_ref(q[0].double(), k.double(), v.double(), table, lens, cu, causal=False,
                                   softcap=softcap)
        assert_close(pool.forward(q, k, v, meta, layer)[0], want, torch.float32, f"layer {layer}")


# --------------------------------------------------------------------------------------- types and values


def _functional_case(n=5):
    kc, vc = torch.randn(3, BS, H_KV, D), torch.randn(3, BS, H_KV, D)
    table, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    cu = torch.tensor([0, n], dtype=torch.int32)
    return torch.randn(n, H_Q, D), kc, vc, table, lens, cu


@pytest.mark.parametrize(
    ("kw", "exc", "text"),
    [
        pytest.param(dict(return_lse="no"), TypeError, "return_lse", id="return_lse-str"),
        pytest.param(dict(deterministic="no"), TypeError, "deterministic", id="deterministic-str"),
        pytest.param(dict(causal=1), TypeError, "causal", id="causal-int"),
        pytest.param(dict(softcap=-1.0), ValueError, "softcap", id="softcap-negative"),
        pytest.param(dict(window_left=-3), ValueError, "window_left", id="window-negative"),
        pytest.param(dict(num_splits=0), ValueError, "num_splits", id="num_splits-0"),
        pytest.param(dict(backend="gpu"), ValueError, "backend", id="backend-unknown"),
        pytest.param(dict(max_seqlen_k=-1), ValueError, "max_seqlen_k", id="max_seqlen_k-negative"),
    ],
)
def test_functional_op_option_errors(kw, exc, text) -> None:
    q, kc, vc, table, lens, cu = _functional_case()
    with pytest.raises(exc, match=text):
        kvarena.paged_attention(q, kc, vc, table, lens, cu, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_errors_name_the_argument_on_every_backend(backend) -> None:
    """Bug 7: a non-tensor q gave AttributeError; a stride-0 out raised torch's RuntimeError
    on the torch path, an expanded cache was accepted; H_q = 0 crashed the Triton launcher
    with ZeroDivisionError."""
    q, kc, vc, table, lens, cu = _functional_case()
    op = kvarena.paged_attention
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        op("q", kc, vc, table, lens, cu, backend=backend)
    with pytest.raises(ValueError, match="out: overlapping"):
        op(q, kc, vc, table, lens, cu, out=torch.empty(1, 1, D).expand(5, H_Q, D), backend=backend)
    expanded = torch.randn(1, BS, H_KV, D).expand(3, BS, H_KV, D)
    with pytest.raises(ValueError, match="k_cache: overlapping"):
        op(q, expanded, vc, table, lens, cu, backend=backend)
    with pytest.raises(ValueError, match="q: H_q"):
        op(torch.randn(5, 0, D), kc, vc, table, lens, cu, backend=backend)
    with pytest.raises(ValueError, match="v_cache: overlapping"):
        kvarena.store_kv(torch.randn(2, H_KV, D), torch.randn(2, H_KV, D), kc,
                         torch.randn(1, BS, H_KV, D).expand(3, BS, H_KV, D), torch.tensor([0, 1]), backend=backend)


def _aliased(case: str):
    """``store_kv`` arguments (caches and scales) for ``case``, and the buffers they live in."""
    nb, bs, h = 3, 4, H_KV
    fp8 = torch.float8_e4m3fn
    n = nb * bs * h * D
    buf = torch.zeros(2 * n + 1)
    kc, vc = buf[:n].view(nb, bs, h, D), buf[n : 2 * n].view(nb, bs, h, D)
    scales = None
    if case == "arena-k-and-v-views":  # interleaved, not overlapping: accepted
        arena = buf[: 2 * n].view(nb, 2, bs, h, D)
        kc, vc = arena[:, 0], arena[:, 1]
    elif case == "k-cache-twice":
        vc = kc
    elif case == "caches-one-element-apart":
        vc = buf[1 : n + 1].view(nb, bs, h, D)
    else:  # fp8 caches with per-token scales
        raw = torch.zeros(2 * n + 4 * (2 * nb * bs * h + 1), dtype=torch.uint8)
        buf = raw
        kc, vc = raw[:n].view(fp8).view(nb, bs, h, D), raw[n : 2 * n].view(fp8).view(nb, bs, h, D)
        sc = raw[2 * n :].view(torch.float32)
        ks, vs = sc[: nb * bs * h].view(nb, bs, h), sc[nb * bs * h : 2 * nb * bs * h].view(nb, bs, h)
        if case == "fp8-k-cache-twice":
            vc = kc
        elif case == "scales-one-element-apart":
            vs = sc[1 : nb * bs * h + 1].view(nb, bs, h)
        elif case == "scale-inside-the-v-cache":
            ks = raw[n : n + 4 * nb * bs * h].view(torch.float32).view(nb, bs, h)
        scales = (ks, vs)
    return kc, vc, scales, buf


@pytest.mark.parametrize(("case", "text"), [
    pytest.param("k-cache-twice", "^v_cache: overlaps k_cache's memory", id="k-cache-twice"),
    pytest.param("caches-one-element-apart", "^v_cache: overlaps k_cache's memory", id="caches-one-element-apart"),
    pytest.param("fp8-k-cache-twice", "^v_cache: overlaps k_cache's memory", id="fp8-k-cache-twice"),
    pytest.param("scales-one-element-apart", "^v_scale: overlaps k_scale's memory", id="scales-one-element-apart"),
    pytest.param("scale-inside-the-v-cache", "^k_scale: overlaps v_cache's memory", id="scale-inside-the-v-cache"),
    pytest.param("arena-k-and-v-views", None, id="arena-k-and-v-views-accepted"),
])
def test_store_kv_refuses_overlapping_written_memory(case, text) -> None:
    """Issue 27 #10: scales one element apart, or k_cache passed again as v_cache, were
    accepted and the V write overwrote what K wrote. Any overlap of written memory (caches,
    per-token scales) is a ValueError naming the argument before anything is written; an
    arena's interleaved K and V views are not an overlap."""
    kc, vc, scales, buf = _aliased(case)
    ks, vs = scales if scales is not None else (None, None)
    k, v = torch.randn(2, H_KV, D), torch.randn(2, H_KV, D)
    before = buf.clone()
    call = lambda: kvarena.store_kv(k, v, kc, vc, torch.tensor([1, 6]), k_scale=ks, v_scale=vs)  # noqa: E731
    if text is None:
        call()
        assert torch.equal(kc[0, 1], k[0]) and torch.equal(vc[1, 2], v[1]), "the interleaved views were not written"
        return
    with pytest.raises(ValueError, match=text):
        call()
    assert torch.equal(buf, before), f"{case}: a refused store wrote {int((buf != before).sum())} elements"


def _out_aliasing(case: str, q, kc, vc):
    """``(q, kc, vc, out)`` for ``case``: ``out`` placed in the memory of one input."""
    n_out = q.numel()
    if case == "k-cache-view":
        return q, kc, vc, kc.view(-1)[:n_out].view(q.shape)
    if case == "v-cache-offset-view":
        return q, kc, vc, vc.view(-1)[vc.numel() - n_out:].view(q.shape)
    if case == "q-itself":
        return q, kc, vc, q
    if case == "q-one-element-apart":
        buf = torch.randn(n_out + 1)
        q = buf[:n_out].view(q.shape)
        return q, kc, vc, buf[1:].view(q.shape)
    if case == "q-expanded-input":  # an input that aliases itself, its span meeting out's
        buf = torch.randn(n_out)
        return buf[: q.shape[2]].view(1, 1, -1).expand(q.shape), kc, vc, buf.view(q.shape)
    # "beside-k-cache": one buffer, out right after the cache: no element shared, accepted
    buf = torch.randn(kc.numel() + n_out)
    return q, buf[: kc.numel()].view(kc.shape), vc, buf[kc.numel():].view(q.shape)


OUT_ALIASING = [("k-cache-view", "^out: overlaps k_cache's memory"),
                ("v-cache-offset-view", "^out: overlaps v_cache's memory"),
                ("q-itself", "^out: overlaps q's memory"), ("q-one-element-apart", "^out: overlaps q's memory"),
                ("q-expanded-input", "^out: overlaps q's memory"), ("beside-k-cache", None)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("case", "text"), OUT_ALIASING, ids=[c for c, _ in OUT_ALIASING])
def test_out_sharing_an_inputs_memory_is_refused(case, text, backend) -> None:
    """Issue 41 #10: an ``out`` inside k_cache / v_cache (or q) was accepted; the Triton path
    wrote its output while reading it (garbage), the torch path overwrote the cache. Now a
    ValueError naming out and the input, before anything is written; an out beside the
    cache in one buffer (no shared element) is accepted and gives the op's result."""
    q, kc, vc, table, lens, cu = _functional_case()
    q, kc, vc, out = _out_aliasing(case, q, kc, vc)
    want = kvarena.paged_attention(q.clone(), kc.clone(), vc.clone(), table, lens, cu, backend="torch")
    before = [t.clone() for t in (q, kc, vc)]
    call = lambda: kvarena.paged_attention(q, kc, vc, table, lens, cu, out=out, backend=backend)  # noqa: E731
    if text is None:
        got = call()
        assert got is out and torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
        return
    with pytest.raises(ValueError, match=text):
        call()
    changed = [name for name, t, b in zip(("q", "k_cache", "v_cache"), (q, kc, vc), before) if not torch.equal(t, b)]
    assert not changed, f"{case}: the refused call wrote into {changed}"


STORE_READS_WRITTEN = [("k-inside-k-cache", "^k_cache: overlaps k's memory"),
                       ("v-inside-k-cache", "^k_cache: overlaps v's memory"),
                       ("k-inside-v-cache", "^v_cache: overlaps k's memory")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("case", "text"), STORE_READS_WRITTEN, ids=[c for c, _ in STORE_READS_WRITTEN])
def test_store_kv_refuses_new_rows_inside_the_caches(case, text, backend) -> None:
    """The same rule for store_kv (found by the issue 41 sweep): k / v read from memory the
    store writes (a view of a cache) were accepted; the kernel would read rows it had
    already overwritten. A ValueError naming both, before anything is written."""
    kc, vc = torch.randn(3, BS, H_KV, D), torch.randn(3, BS, H_KV, D)
    k, v = torch.randn(2, H_KV, D), torch.randn(2, H_KV, D)
    if case == "k-inside-k-cache":
        k = kc[1, :2]
    elif case == "v-inside-k-cache":
        v = kc[2, 1:3]
    else:
        k = vc[0, 2:]
    before = (kc.clone(), vc.clone())
    with pytest.raises(ValueError, match=text):
        kvarena.store_kv(k, v, kc, vc, torch.tensor([1, 6]), backend=backend)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), f"{case}: a refused store wrote"


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_and_infinite_options_mean_no_limit(backend) -> None:
    """Bug 7: window_left / chunk_size of 2**64 raised OverflowError; softcap=inf gave an
    all-NaN output. A window or chunk larger than any sequence selects every key; a softcap
    of inf is no softcap."""
    q, kc, vc, table, lens, cu = _functional_case(7)
    op = kvarena.paged_attention
    base = op(q, kc, vc, table, lens, cu, backend=backend)
    full = op(q, kc, vc, table, lens, cu, causal=False, backend=backend)
    assert torch.equal(op(q, kc, vc, table, lens, cu, window_left=2**64, backend=backend), base)
    assert torch.equal(op(q, kc, vc, table, lens, cu, window_left=5, sink_tokens=2**64, backend=backend), base)
    assert torch.equal(op(q, kc, vc, table, lens, cu, chunk_size=2**64, backend=backend), full)
    capped = op(q, kc, vc, table, lens, cu, softcap=math.inf, backend=backend)
    assert torch.equal(capped, base), "softcap=inf must equal no softcap"
    assert AttentionSpec(softcap=math.inf).softcap is None and AttentionSpec(window_left=2**64).window_left == 2**31 - 1


def test_pool_constructor_errors() -> None:
    """Bug 7: a non-policy gave AttributeError; PagedKVCache took a "feature" policy;
    device="bogus" raised torch's RuntimeError; layouts with a head_dim the op rejects
    (7, 264) were accepted; a huge max_bytes with tiny blocks raised OverflowError."""
    with pytest.raises(TypeError, match="policy: expected a kvarena.CachePolicy"):
        PagedKVCache("paged_kv", layout=LAY)
    with pytest.raises(TypeError, match="policy"):
        SlabKVCache(object(), layout=LAY, slab_tokens=ST)
    with pytest.raises(ValueError, match="policy.class_name"):
        PagedKVCache(CachePolicy("feature", 1 << 16), layout=LAY)
    with pytest.raises(ValueError, match="policy.class_name"):
        SlabKVCache(CachePolicy("paged_kv", 1 << 16), layout=LAY, slab_tokens=ST)
    with pytest.raises(ValueError, match="device"):
        PagedKVCache(CachePolicy("paged_kv", 1 << 16), layout=LAY, device="bogus")
    with pytest.raises(ValueError, match="device"):
        SlabKVCache(CachePolicy("slab_kv", 1 << 16), layout=LAY, slab_tokens=ST, device="bogus")
    with pytest.raises(ValueError, match="device"):
        KVArena({}, device="bogus")
    for d in (7, 264):
        lay = KVLayout(1, 1, d, torch.float32)
        with pytest.raises(ValueError, match="layout.head_dim"):
            PagedKVCache(CachePolicy("paged_kv", 1 << 16), layout=lay)
        with pytest.raises(ValueError, match="layout.head_dim"):
            SlabKVCache(CachePolicy("slab_kv", 1 << 16), layout=lay, slab_tokens=ST)
    seed_style = SlabKVCache(CachePolicy("slab_kv", 1 << 20))
    with pytest.raises(ValueError, match="layout.head_dim"):
        seed_style.append("a", kvarena.Slab(0, torch.randn(1, 3, 1, 7), torch.randn(1, 3, 1, 7)))
    assert seed_style.arena is None and seed_style.layout is None, "a failed first append left an arena"
    huge = PagedKVCache(CachePolicy("paged_kv", 2**62, block_bytes=64))  # bookkeeping only
    assert huge.total_blocks == 2**56 and huge.allocate("a", 3) and huge.free == 2**56 - 3
    meta_dev = PagedKVCache(CachePolicy("paged_kv", 2**50), layout=KVLayout(1, 1, 8, torch.float16),
                            block_size=1, device="meta")
    assert meta_dev.total_blocks == 2**50 // 32


def test_plan_graph_flag_must_be_a_bool() -> None:
    pool = PagedKVCache(CachePolicy("paged_kv", LAY.block_bytes(BS) * 8), layout=LAY, block_size=BS,
                        graph_capacity=(2, 2))
    before = pool_state(pool)
    with pytest.raises(TypeError, match="graph"):
        pool.plan({"a": 1}, graph=1)
    assert_unchanged(before, pool, "plan(graph=1)")


def test_custom_op_schema_comes_from_the_spec() -> None:
    """One source of truth: the op's option arguments are AttentionSpec's fields."""
    schema = str(torch.ops.kvarena.paged_attention.default._schema)
    assert AttentionSpec.op_schema() in schema
    spec = AttentionSpec(window_left=3, softcap=2.0, backend="torch")
    assert AttentionSpec.from_op_args(spec.op_args()) == spec.replace(return_lse=False)


def test_cache_handle_passes_per_pool_attention_specs() -> None:
    sliding = AttentionSpec(window_left=3)
    handle = kvarena.CacheHandle(
        [CachePolicy("paged_kv", LAY.block_bytes(BS) * 8), CachePolicy("slab_kv", LAY.block_bytes(ST) * 4)],
        layouts={"paged_kv": LAY, "slab_kv": LAY}, slab_tokens=ST, block_size=BS,
        attention={"paged_kv": {1: sliding}, "slab_kv": AttentionSpec(softcap=4.0)},
    )
    assert handle.paged_kv.attention_spec(1) == sliding and handle.paged_kv.attention_spec(0) == AttentionSpec()
    assert handle.slab_kv.attention_spec(0).softcap == 4.0
    with pytest.raises(KeyError, match="attention has key 'feature'"):
        kvarena.CacheHandle([CachePolicy("paged_kv", 1 << 16)], attention={"feature": sliding})
    with pytest.raises(ValueError, match=r"attention\['slab_kv'\] is given but policies has no"):
        kvarena.CacheHandle([CachePolicy("paged_kv", 1 << 16)], attention={"slab_kv": sliding})
