"""The route of an attention call (kvarena.attention.route), and plan once per step
(kvarena.attention.plans): the grid of inputs -> route, written out by hand, and spies
that count the kernel planner's calls per step."""

from __future__ import annotations

import pytest
import torch

from kvarena.attention.route import Own, Path, Route, route

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # route() reads the device type only
BF16 = torch.bfloat16

# (id, requested backend, device, facts, expected (path, backend, store, grad, kv_grad, merge))
_T, _E, _G, _C, _B = Path.TRITON_TRAIN, Path.TRITON_EAGER, Path.TORCH_GRAD, Path.COMPILED, Path.BODY
GRID = [
    ("auto-cpu-inference", "auto", CPU, {}, (_B, "torch", "torch", False, False, False)),
    ("auto-cuda-inference", "auto", CUDA, {}, (_E, "triton", "triton", False, False, False)),
    ("auto-cuda-q-grad", "auto", CUDA, {"q_grad": True}, (_T, "triton", "triton", True, False, False)),
    ("auto-cuda-kv-grad-at-queries", "auto", CUDA, {"kv_grad": True, "own": Own.AT_QUERIES},
     (_T, "triton", "triton", True, True, False)),
    ("auto-cuda-cache-grad", "auto", CUDA, {"cache_grad": True}, (_G, "torch", "triton", True, False, False)),
    ("auto-cuda-sink-grad", "auto", CUDA, {"sink_grad": True}, (_G, "torch", "triton", True, False, False)),
    ("auto-cuda-rope-q-grad", "auto", CUDA, {"rope": True, "q_grad": True},
     (_G, "torch", "triton", True, False, False)),
    ("auto-cuda-rope-inference", "auto", CUDA, {"rope": True}, (_E, "triton", "triton", False, False, False)),
    ("auto-cuda-compiling", "auto", CUDA, {"compiling": True}, (_C, "triton", "triton", False, False, False)),
    ("auto-cpu-compiling", "auto", CPU, {"compiling": True}, (_C, "torch", "torch", False, False, False)),
    ("auto-cuda-compiling-q-grad", "auto", CUDA, {"compiling": True, "q_grad": True},
     (_T, "triton", "triton", True, False, False)),
    ("torch-cuda-inference", "torch", CUDA, {}, (_B, "torch", "torch", False, False, False)),
    ("torch-cpu-kv-grad", "torch", CPU, {"kv_grad": True, "own": Own.AT_QUERIES},
     (_G, "torch", "torch", True, True, False)),
    ("triton-cpu-inference", "triton", CPU, {}, (_E, "triton", "triton", False, False, False)),
    ("triton-cpu-q-grad", "triton", CPU, {"q_grad": True}, (_T, "triton", "triton", True, False, False)),
    # own keys after the history: one launch or two merged by LSE
    ("triton-after-taken", "triton", CPU, {"own": Own.AFTER, "takes_own": True},
     (_E, "triton", "triton", False, False, False)),
    ("triton-after-not-taken", "triton", CPU, {"own": Own.AFTER, "takes_own": False},
     (_E, "triton", "triton", False, False, True)),
    ("triton-after-compiling", "triton", CPU, {"own": Own.AFTER, "takes_own": True, "compiling": True},
     (_C, "triton", "triton", False, False, True)),
    ("triton-after-kv-grad", "triton", CPU, {"own": Own.AFTER, "kv_grad": True, "takes_own": False},
     (_T, "triton", "triton", True, True, False)),
    ("torch-after", "torch", CPU, {"own": Own.AFTER, "takes_own": True}, (_B, "torch", "torch", False, False, True)),
    ("auto-cuda-after-paged", "auto", CUDA, {"own": Own.AFTER_PAGED, "takes_own": True},
     (_E, "triton", "triton", False, False, True)),
    ("auto-cuda-after-paged-q-grad", "auto", CUDA, {"own": Own.AFTER_PAGED, "q_grad": True},
     (_G, "torch", "triton", True, False, True)),
    ("auto-cuda-after-paged-kv-grad", "auto", CUDA, {"own": Own.AFTER_PAGED, "kv_grad": True},
     (_G, "torch", "triton", True, True, True)),
]


@pytest.mark.parametrize(("requested", "device", "facts", "want"), [g[1:] for g in GRID], ids=[g[0] for g in GRID])
def test_route_grid(requested, device, facts, want):
    facts = {"compiling": False, **facts}
    assert route(requested, device, BF16, **facts) == Route(*want)


REFUSED = [
    ("triton-cache-grad", {"cache_grad": True}, ValueError, r"w\.r\.t\. k_cache/v_cache/sink_logits"),
    ("triton-sink-grad", {"sink_grad": True}, ValueError, r"w\.r\.t\. sink_logits"),
    ("triton-rope-q-grad", {"rope": True, "q_grad": True}, ValueError, r"w\.r\.t\. q \(RoPE on read\)"),
    ("triton-paged-own-kv-grad", {"own": Own.AFTER_PAGED, "kv_grad": True}, ValueError,
     r"w\.r\.t\. k/v of a multi-chunk step"),
    ("triton-fp64", {"dtype": torch.float64}, TypeError, r"q: the Triton kernels take float16"),
    ("triton-mps", {"device": torch.device("mps")}, ValueError, r"takes CUDA or CPU"),
]


@pytest.mark.parametrize(("facts", "error", "match"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_route_refuses_what_triton_cannot_serve(facts, error, match):
    facts = {"compiling": False, **facts}
    device, dtype = facts.pop("device", CPU), facts.pop("dtype", BF16)
    with pytest.raises(error, match=match):
        route("triton", device, dtype, **facts)


def test_the_kernel_is_asked_about_own_keys_only_where_it_decides():
    """``takes_own`` as a function is called only for own keys after the history on the eager
    Triton path: nowhere else does its answer change the route."""
    asked = []

    def ask():
        asked.append(1)
        return True

    for requested, device, facts in (("torch", CPU, {"own": Own.AFTER}), ("triton", CPU, {"own": Own.AFTER_PAGED}),
                                     ("triton", CPU, {"own": Own.NONE}),
                                     ("triton", CPU, {"own": Own.AFTER, "compiling": True}),
                                     ("triton", CPU, {"own": Own.AFTER, "q_grad": True})):
        route(requested, device, BF16, takes_own=ask, **{"compiling": False, **facts})
    assert asked == []
    assert not route("triton", CPU, BF16, own=Own.AFTER, takes_own=ask, compiling=False).merge
    assert asked == [1]


# ------------------------------------------------------------------------- plan once per step


@pytest.fixture
def planner_calls(monkeypatch):
    """The kernel planner's calls (``paged_attention.plan_attention``), counted."""
    import kvarena.kernels.paged_attention as pa

    calls = []
    real = pa.plan_attention

    def spy(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(pa, "plan_attention", spy)
    return calls


def _paged(num_layers: int, backend: str):
    from kvarena import AttentionSpec, CachePolicy, KVLayout, PagedKVCache

    lay = KVLayout(num_layers=num_layers, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    return PagedKVCache(CachePolicy("paged_kv", max_bytes=lay.block_bytes(8) * 16), layout=lay, block_size=8,
                        attention=AttentionSpec(backend=backend))


def test_paged_decode_plans_once_per_step_not_per_layer(planner_calls):
    """A 4-layer decode step on Triton: one plan (one layer group, one spec), made by the
    first layer; layers 1..3 only launch. Each step plans anew (its lengths moved). The
    outputs equal the torch backend's on the same tokens."""
    layers, gen = 4, torch.Generator().manual_seed(3)
    tri, ref = _paged(layers, "triton"), _paged(layers, "torch")
    for step, n in enumerate((5, 1, 1)):
        q = torch.randn(2 * n, 2, 16, generator=gen)
        k, v = torch.randn(2 * n, 1, 16, generator=gen), torch.randn(2 * n, 1, 16, generator=gen)
        metas = [pool.plan({"a": n, "b": n}) for pool in (tri, ref)]
        for layer in range(layers):
            before = len(planner_calls)
            got = tri.forward(q, k, v, metas[0], layer)
            want = ref.forward(q, k, v, metas[1], layer)
            assert len(planner_calls) - before == (1 if layer == 0 else 0), f"step {step} layer {layer}"
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert planner_calls[-1].max_seqlen_k == 5 + step


def test_per_call_overrides_plan_for_themselves(planner_calls):
    """A call with overrides brings its own spec: it plans (it cannot read the layer spec's
    plan), and the layer's own spec still reads the step's plan after it."""
    pool = _paged(2, "triton")
    meta = pool.plan({"a": 3})
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    pool.forward(q, k, k, meta, 0)
    pool.forward(q, k, k, meta, 1, num_splits=1)
    pool.forward(q, k, k, meta, 1)
    assert len(planner_calls) == 2


def test_slab_commit_and_denoise_plan_once_per_step(planner_calls):
    """A 3-layer slab step: the denoising pass (history + own keys, one launch or two) and
    the commit plan once per step each (the own-keys question reads the plan the launch
    then uses), not per layer."""
    from kvarena import AttentionSpec, CachePolicy, KVLayout, SlabKVCache

    lay = KVLayout(num_layers=3, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
    pool = SlabKVCache(CachePolicy("slab_kv", lay.block_bytes(64) * 4, per_component={"window": 2, "sinks": 1}),
                       layout=lay, slab_tokens=64, attention=AttentionSpec(backend="triton"))
    gen = torch.Generator().manual_seed(5)
    for c in range(2):
        meta = pool.plan({"r": c})
        q = torch.randn(1, 64, 2, 16, generator=gen).bfloat16()
        k = torch.randn(1, 64, 1, 16, generator=gen).bfloat16()
        for commit in (False, True):
            before = len(planner_calls)
            for layer in range(3):
                pool.forward(q, k, k, meta, layer, commit=commit)
            made = planner_calls[before:]
            # chunk 0 has no history: one source; chunk 1's denoising pass may need two
            # plans (own keys in the launch, or the history and own keys apart).
            assert 1 <= len(made) <= 2, (c, commit, made)


def test_a_memoized_route_still_reads_the_interpreter_flag(monkeypatch):
    """'triton' on CPU needs TRITON_INTERPRET=1 at every call: a route made while it was set
    is not handed out after it is gone."""
    assert route("triton", CPU, BF16, compiling=False).backend == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        route("triton", CPU, BF16, compiling=False)
