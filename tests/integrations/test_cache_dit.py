"""kvarena.integrations.cache_dit against the real cache-dit on a tiny random Wan (CPU).

Every parity here is bitwise (``torch.equal``): a request through ``CacheDiTScope`` must
give exactly what unmodified cache-dit gives for that request alone (its own parity CFG;
``enable_separate_cfg=False`` for a request without CFG), whatever else is interleaved
with it. The negative control runs unmodified cache-dit under the same interleavings and
asserts the damage is large, so an upstream fix shows up as a failing test here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from _helpers import one_torch_thread  # noqa: F401 - fixture

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (pip install 'kvarena[diffusers]')")
pytest.importorskip("cache_dit", reason="the cache-dit extra is not installed (pip install 'kvarena[cache-dit]')")

from _cache_dit_harness import (  # noqa: E402
    Request,
    cached_wan,
    call,
    drive,
    fbc_wan,
    first_mismatch,
    interleave,
    max_gap,
    resets,
    run,
    tiny_wan,
)

from kvarena import CachePolicy, ResidualCache  # noqa: E402
from kvarena.integrations.cache_dit import CacheDiTScope  # noqa: E402

A, B = Request(seed=1), Request(seed=2)
# name -> the requests interleaved call by call
INTERLEAVINGS = {
    "two-cfg": (A, B),
    "cfg-with-no-cfg": (A, Request(seed=2, cfg=False)),
    "b-starts-3-calls-later": (A, Request(seed=2, start=3)),
    "different-step-counts": (A, Request(seed=2, steps=4)),
    "three-requests": (A, Request(seed=2, cfg=False), Request(seed=3, steps=5, start=1)),
}


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(params=["no_grad", "inference_mode"])
def serving_mode(request):
    """The parity tests run again under ``torch.inference_mode()``, where servers run."""
    with torch.inference_mode(request.param == "inference_mode"):
        yield request.param


def big_cache() -> ResidualCache:
    return ResidualCache(CachePolicy("residual", max_bytes=1 << 26))


_REFS: dict[Request, list[torch.Tensor]] = {}


def reference(req: Request) -> list[torch.Tensor]:
    """Unmodified cache-dit on ``req`` alone (its own parity CFG, or none without CFG)."""
    key = Request(req.seed, req.steps, req.cfg)
    if key not in _REFS:
        _REFS[key] = run(cached_wan(separate_cfg=req.cfg), key)
    return _REFS[key]


def scoped(scope: CacheDiTScope, request_id: str):
    return lambda branch: scope.call(request_id, branch)


def entry_keys(cache: ResidualCache) -> list:
    return list(cache.keys())


def stored(cache: ResidualCache, request_id: str, branch: str):
    (key,) = [k for k in entry_keys(cache) if k[:2] == (request_id, branch)]
    return cache.get(*key)


# -- (1) parity and independence --------------------------------------------------------------
@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_one_request_equals_unmodified_cache_dit_bitwise(cfg, serving_mode):
    req = Request(seed=1, cfg=cfg)
    ref_model = cached_wan(separate_cfg=cfg)
    want = run(ref_model, req)
    model, cache = cached_wan(), big_cache()
    got = run(model, req, scoped(CacheDiTScope(model, cache), "r"))
    assert not first_mismatch(got, want), first_mismatch(got, want)
    own = ref_model._context_manager.get_context(ref_model._context_names[0])
    # the parity is not vacuous: cache-dit cached some steps and computed others
    assert 0 < len(own.cached_steps) < req.steps - 1, own.cached_steps
    assert stored(cache, "r", "cond").cached_steps == own.cached_steps
    if cfg:
        assert stored(cache, "r", "uncond").cached_steps == own.cfg_cached_steps


@pytest.mark.parametrize("name", list(INTERLEAVINGS))
def test_interleaved_requests_are_bitwise_independent(name, serving_mode):
    reqs = INTERLEAVINGS[name]
    model = cached_wan()
    scope = CacheDiTScope(model, big_cache())
    outs = interleave([drive(model, r, scoped(scope, f"r{i}")) for i, r in enumerate(reqs)])
    for i, (req, got) in enumerate(zip(reqs, outs)):
        assert not first_mismatch(got, reference(req)), f"request {i} {req}: {first_mismatch(got, reference(req))}"


@pytest.mark.parametrize("name", ["two-cfg", "cfg-with-no-cfg", "b-starts-3-calls-later"])
def test_negative_control_unmodified_cache_dit_interleaved_is_far_off(name):
    """Unscoped, request 0 ends farther from its own result than not caching at all."""
    reqs = INTERLEAVINGS[name]
    model = cached_wan()
    assert_far_off(name, interleave([drive(model, r) for r in reqs]), reference(reqs[0]), "cache-dit")


def assert_far_off(name: str, outs: list, alone, what: str) -> None:
    """Request 0 of the interleaving ``name`` (``outs[0]``) ends farther from its result run
    alone (``alone``) than 0.1 and than 1.2x the error of caching nothing at all."""
    gap = max_gap(outs[0], alone)
    no_cache = max_gap(run(tiny_wan(), INTERLEAVINGS[name][0]), alone)
    assert gap > max(0.1, 1.2 * no_cache), f"{name}: gap {gap:.3f}, {what}'s own error {no_cache:.3f}"


# -- (2) end_request, eviction, atomic calls, close -------------------------------------------
def test_end_request_drops_exactly_that_request_which_then_starts_afresh():
    model, cache = cached_wan(), big_cache()
    scope = CacheDiTScope(model, cache)
    a, b = drive(model, A, scoped(scope, "a")), drive(model, B, scoped(scope, "b"))
    interleave_prefix = [next(g) for _ in range(4) for g in (a, b)]
    assert interleave_prefix == [None] * 8
    b_keys = [k for k in entry_keys(cache) if k[0] == "b"]
    assert scope.end_request("a") == 2
    assert cache.namespaces() == ["b"] and [k for k in entry_keys(cache) if k[0] == "b"] == b_keys
    # a restarted request is a fresh one: it equals cache-dit's run of that request
    assert not first_mismatch(run(model, A, scoped(scope, "a")), reference(A))
    assert scope.end_request("never-seen") == 0


def test_eviction_under_the_budget_is_whole_contexts_and_restarts_fresh():
    model, probe = cached_wan(), big_cache()
    run(model, Request(seed=9, steps=2, cfg=False), scoped(CacheDiTScope(model, probe), "p"))
    one = probe.used_bytes  # one context after two steps; later steps hold the same tensors
    model, cache = cached_wan(), ResidualCache(CachePolicy("residual", max_bytes=3 * one + one // 2))
    scope = CacheDiTScope(model, cache)
    reqs = (A, B)
    # a's two branches, then b's two: the fourth context evicts the oldest, a's cond
    outs = interleave([drive(model, r, scoped(scope, n)) for r, n in zip(reqs, "ab")])
    assert cache.evictions > 0 and cache.used_bytes <= cache.max_bytes
    for req, got in zip(reqs, outs):  # evicted contexts restart: outputs move, never crash
        assert len(got) == len(reference(req))
    for key in entry_keys(cache):  # what is left is whole contexts, each of one (request, branch)
        ctx = cache.get(*key)
        assert set(ctx.buffers) >= {"blocks_Fn_residual_buffer", "blocks_Bn_residual_buffer"}, key


def test_an_evicted_context_is_served_nothing_of_another_request():
    model, cache = cached_wan(), big_cache()
    scope = CacheDiTScope(model, cache)
    x, emb, _ = Request(seed=5).inputs()
    t = torch.tensor([700])
    with scope.call("b", "cond"):
        call(model, x + 0.01, t, emb)  # b's residuals for almost the same input
    cache.clear_namespace("a")  # what an eviction of a does: no entry left for a
    with scope.call("a", "cond"):
        got = call(model, x, t, emb)
    with scope.call("fresh", "cond"):
        want = call(model, x, t, emb)
    assert torch.equal(got, want), (got - want).abs().max().item()


def test_used_bytes_counts_every_residual_tensor():
    model, cache = cached_wan(), big_cache()
    run(model, A, scoped(CacheDiTScope(model, cache), "a"))
    tensors = {}
    for key in entry_keys(cache):
        for t in cache.get(*key).buffers.values():
            tensors[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    residual = sum(tensors.values())
    assert len(tensors) == 6 and residual <= cache.used_bytes < residual + 4096, (residual, cache.used_bytes)


def test_a_call_that_raises_leaves_the_request_as_it_was():
    model, cache = cached_wan(), big_cache()
    scope = CacheDiTScope(model, cache)
    req = drive(model, A, scoped(scope, "a"))
    for _ in range(3):
        next(req)
    before = {k: (cache.get(*k).executed_steps, dict(cache.get(*k).buffers)) for k in entry_keys(cache)}
    # after the cached blocks: cache-dit has already counted the step and set buffers
    hook = model.proj_out.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    x, emb, neg = A.inputs()
    with pytest.raises(RuntimeError, match="boom"), scope.call("a", "uncond"):
        call(model, x, torch.tensor([850]), neg)
    hook.remove()
    after = {k: (cache.get(*k).executed_steps, dict(cache.get(*k).buffers)) for k in entry_keys(cache)}
    assert after.keys() == before.keys()
    for k in before:
        assert after[k][0] == before[k][0], k
        assert all(after[k][1][n] is v for n, v in before[k][1].items()), k
    *_, outs = req
    assert not first_mismatch(outs, reference(A)), first_mismatch(outs, reference(A))


def test_close_restores_the_module():
    model = cached_wan()
    forward, manager_cls = model.__dict__["forward"], type(model._context_manager)
    scope = CacheDiTScope(model, big_cache())
    run(model, B, scoped(scope, "b"))
    scope.close()
    scope.close()  # twice is fine
    assert scope.closed and model.__dict__["forward"] is forward
    assert type(model._context_manager) is manager_cls and "cache_context" not in model.__dict__
    # the module's own cache-dit state was never touched: it runs as if never scoped
    assert not first_mismatch(run(model, A), reference(A))
    with pytest.raises(RuntimeError, match="closed"), scope.call("a", "cond"):
        pass
    CacheDiTScope(model, big_cache()).close()  # a closed scope frees the module


# -- refusals ---------------------------------------------------------------------------------
def _taylorseer_wan():
    import cache_dit

    model = tiny_wan()
    cache_dit.enable_cache(model, cache_config=cache_dit.DBCacheConfig(max_warmup_steps=1),
                           calibrator_config=cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1))
    return model


@pytest.mark.parametrize(
    ("make", "cache", "err", "match"),
    [
        (lambda: "not a module", big_cache, TypeError, "module must be"),
        (tiny_wan, big_cache, ValueError, "module: cache-dit is not enabled"),
        (cached_wan, lambda: {}, TypeError, "cache must be a kvarena.ResidualCache"),
        (_taylorseer_wan, big_cache, ValueError, "module: .*calibrator"),
    ],
    ids=["not-a-module", "cache-dit-not-enabled", "cache-not-a-residual-cache", "taylorseer"],
)
def test_bad_construction_is_refused_naming_the_argument(make, cache, err, match):
    module = make()
    before = dict(getattr(module, "__dict__", {}))
    with pytest.raises(err, match=f"^kvarena: {match}"):
        CacheDiTScope(module, cache())
    assert dict(getattr(module, "__dict__", {})) == before  # nothing installed


def test_a_second_scope_on_one_module_is_refused():
    model = cached_wan()
    CacheDiTScope(model, big_cache())
    with pytest.raises(ValueError, match="^kvarena: module already has an open CacheDiTScope"):
        CacheDiTScope(model, big_cache())


@pytest.mark.parametrize(
    ("request_id", "branch", "match"),
    [("", "cond", "request_id"), (3, "cond", "request_id"), ("a", "", "branch"), ("a", None, "branch")],
    ids=["empty-request", "int-request", "empty-branch", "none-branch"],
)
def test_bad_call_arguments_are_refused_and_change_nothing(request_id, branch, match):
    model, cache = cached_wan(), big_cache()
    scope = CacheDiTScope(model, cache)
    run(model, Request(seed=1, steps=2), scoped(scope, "a"))
    keys = cache.keys()
    with pytest.raises(TypeError, match=f"^kvarena: {match}"), scope.call(request_id, branch):
        pass
    assert cache.keys() == keys


def test_calls_do_not_nest():
    model = cached_wan()
    scope = CacheDiTScope(model, big_cache())
    with scope.call("a", "cond"), pytest.raises(RuntimeError, match="do not nest"), scope.call("b", "cond"):
        pass


# -- (3) scope.request: branches from diffusers' cache_context, per thread ---------------------
def named(model):
    return lambda branch: model.cache_context(branch)


def test_request_takes_the_branch_from_cache_context():
    model, cache = cached_wan(), big_cache()
    scope = CacheDiTScope(model, cache)
    with scope.request("a"):
        got = run(model, A, named(model))
    assert not first_mismatch(got, reference(A)), first_mismatch(got, reference(A))
    assert sorted(k[1] for k in entry_keys(cache)) == ["cond", "uncond"]
    with scope.request("n"):
        run(model, Request(seed=2, steps=2, cfg=False))  # no cache_context: branch "default"
    assert [k[1] for k in entry_keys(cache) if k[0] == "n"] == ["default"]


@pytest.mark.parametrize("kind", ["cache-dit", "first-block-cache"])
def test_requests_on_threads_interleaved_by_a_barrier_are_bitwise_independent(kind, serving_mode):
    reqs = INTERLEAVINGS["two-cfg"]
    model = cached_wan() if kind == "cache-dit" else fbc_wan()
    ref = reference if kind == "cache-dit" else fbc_reference
    scope = CacheDiTScope(model, big_cache())
    barrier, outs, errors = threading.Barrier(len(reqs)), [None] * len(reqs), []

    inference = torch.is_inference_mode_enabled()  # thread-local: each worker enters it

    def worker(i):
        try:
            with torch.no_grad(), torch.inference_mode(inference), scope.request(f"t{i}"):
                for got in drive(model, reqs[i], named(model)):
                    barrier.wait(timeout=60)  # every thread makes one call per round
                    outs[i] = got
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for i, req in enumerate(reqs):
        assert not first_mismatch(outs[i], ref(req)), f"thread {i}: {first_mismatch(outs[i], ref(req))}"


def test_import_kvarena_never_imports_cache_dit():
    code = "import sys, kvarena, kvarena.integrations; print('cache_dit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_example_prints_the_gap_and_the_scoped_zero():
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "examples" / "cache_dit_interleave.py")],
                         capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if "interleaved vs alone" in ln]
    assert len(lines) == 2 and all(ln.endswith("CacheDiTScope 0") for ln in lines), res.stdout
    gaps = [float(ln.split("unscoped cache-dit ")[1].split(",")[0]) for ln in lines]
    assert min(gaps) > 0.1, res.stdout


# -- (4) diffusers' own stateful cache hooks (FirstBlockCache) ---------------------------------
_FBC_REFS: dict[Request, list[torch.Tensor]] = {}


def fbc_reference(req: Request) -> list[torch.Tensor]:
    """diffusers' FirstBlockCache on ``req`` alone, as one pipeline call runs it."""
    key = Request(req.seed, req.steps, req.cfg)
    if key not in _FBC_REFS:
        model = fbc_wan()
        _FBC_REFS[key] = run(model, key, named(model))
    return _FBC_REFS[key]


FBC_INTERLEAVINGS = ("two-cfg", "cfg-with-no-cfg", "three-requests")


@pytest.mark.parametrize("how", ["call", "request"])
@pytest.mark.parametrize("name", FBC_INTERLEAVINGS)
def test_first_block_cache_interleaved_is_bitwise_independent(name, how, serving_mode):
    reqs = INTERLEAVINGS[name]
    model, cache = fbc_wan(), big_cache()
    scope = CacheDiTScope(model, cache)
    drivers = []
    for i, req in enumerate(reqs):
        if how == "call":
            drivers.append(drive(model, req, scoped(scope, f"r{i}")))
        else:
            drivers.append(_in_request(scope, f"r{i}", drive(model, req, named(model))))
    outs = interleave([*drivers, resets(model, 8)])  # and another pipeline's ends between calls
    for i, req in enumerate(reqs):
        assert not first_mismatch(outs[i], fbc_reference(req)), f"request {i}: {first_mismatch(outs[i], fbc_reference(req))}"
    stored_states = [k for k in entry_keys(cache) if k[2].startswith("diffusers:")]
    assert len(stored_states) == sum(2 if r.cfg else 1 for r in reqs), stored_states


def _in_request(scope, request_id, gen):
    """Advance ``gen`` one call at a time, each inside ``scope.request(request_id)``."""
    while True:
        with scope.request(request_id):
            got = next(gen)
        yield got
        if got is not None:
            return


@pytest.mark.parametrize("name", ["two-cfg", "b-starts-3-calls-later"])
def test_negative_control_first_block_cache_interleaved_is_far_off(name):
    reqs = INTERLEAVINGS[name]
    model = fbc_wan()
    outs = interleave([drive(model, r, named(model)) for r in reqs])
    assert_far_off(name, outs, fbc_reference(reqs[0]), "FirstBlockCache")


def test_first_block_cache_state_is_charged_and_ended_with_the_request():
    model, cache = fbc_wan(), big_cache()
    scope = CacheDiTScope(model, cache)
    run(model, A, scoped(scope, "a"))
    states = [cache.get(*k) for k in entry_keys(cache)]
    tensors = {id(v): v for s in states for v in s.values() if isinstance(v, torch.Tensor)}
    tensors.update({id(t): t for s in states for v in s.values() if isinstance(v, tuple) for t in v
                    if t is not None})
    assert cache.used_bytes >= sum(t.untyped_storage().nbytes() for t in tensors.values()) > 0
    assert scope.end_request("a") == 2 and len(cache) == 0
    scope.close()
    assert not first_mismatch(run(model, A, named(model)), fbc_reference(A))  # the module's own state


def test_cache_dit_enabled_through_a_pipeline_is_refused():
    """cache-dit's pipeline wrapper lives on the pipeline CLASS and resets the shared contexts
    at every call of every instance: the scope asks for cache-dit on the transformer instead."""
    import cache_dit
    from diffusers import WanPipeline

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=tiny_wan())
    cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(max_warmup_steps=1))
    try:
        with pytest.raises(ValueError, match=r"^kvarena: module: cache-dit was enabled through a pipeline"):
            CacheDiTScope(pipe.transformer, big_cache())
        with pytest.raises(TypeError, match="^kvarena: module must be the torch.nn.Module transformer"):
            CacheDiTScope(pipe, big_cache())
    finally:
        cache_dit.disable_cache(pipe)  # gives WanPipeline.__call__ back to every other test
