"""``kvarena.integrations.diffusers.cache_prompts``: a pipeline's ``encode_prompt`` from a FeatureCache.

The reference of every result is the pipeline's own, uncached ``encode_prompt`` (the class's
method, bound to the same pipeline, called with the same arguments in the same state); results
must equal it bitwise. "The encoder ran" is read from a forward hook on the text encoder.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (pip install 'kvarena[diffusers]')")

from _tiny_pipelines import clip_lora, tiny_umt5, tiny_wan_pipeline  # noqa: E402

from kvarena import CachePolicy, FeatureCache  # noqa: E402
from kvarena.integrations.diffusers import cache_prompts  # noqa: E402

BASE = dict(prompt="a red fox", negative_prompt="blue cat", do_classifier_free_guidance=True,
            num_videos_per_prompt=1, max_sequence_length=8)


def uncached(pipe, **kwargs):
    """The pipeline's own encode_prompt (the class's method: no handle in between)."""
    return type(pipe).encode_prompt(pipe, **kwargs)


def assert_same(got, want, what=""):
    assert len(got) == len(want), f"{what}: {len(got)} outputs, want {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what}: output {i} is {type(g)}, want None"
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: output {i} {g.dtype}{tuple(g.shape)} " \
                                                          f"vs {w.dtype}{tuple(w.shape)}"
        assert torch.equal(g, w), f"{what}: output {i} differs, max |diff| {(g - w).abs().max().item()}"


class Runs:
    """Counts the text encoder's forward calls (public: a forward hook)."""

    def __init__(self, module):
        self.n = 0
        module.register_forward_hook(lambda *_: setattr(self, "n", self.n + 1))


@pytest.fixture
def pipe():
    return tiny_wan_pipeline(seed=0)


def new_cache(max_bytes=1 << 22):
    return FeatureCache(CachePolicy("feature", max_bytes=max_bytes))


# ---------------------------------------------------------------------- item 1: hits, bits, key
def test_a_repeated_prompt_runs_the_encoder_once_and_equals_the_uncached_call(pipe):
    runs = Runs(pipe.text_encoder)
    with torch.no_grad():
        want = uncached(pipe, **BASE)
        before = runs.n
        with cache_prompts(pipe, new_cache()) as handle:
            first = pipe.encode_prompt(**BASE)
            second = pipe.encode_prompt(**BASE)
    assert runs.n - before == 2, "the miss encodes prompt and negative prompt once each; the hit encodes nothing"
    assert_same(first, want, "miss")
    assert_same(second, want, "hit")
    s = handle.stats()
    assert (s["hits"], s["misses"], s["encoder_calls"], s["entries"]) == (1, 1, 1, 1), s
    assert s["used_bytes"] == sum(t.numel() * t.element_size() for t in want), s


def _variants():
    emb = torch.linspace(-1, 1, 8 * 32).reshape(1, 8, 32)
    return [
        pytest.param({"prompt": "a red dog"}, None, id="prompt"),
        pytest.param({"negative_prompt": "green forest"}, None, id="negative_prompt"),
        pytest.param({"prompt": ["a red fox"], "negative_prompt": ["blue cat"]}, None, id="prompt_as_list"),
        pytest.param({"do_classifier_free_guidance": False}, None, id="cfg_off"),
        pytest.param({"num_videos_per_prompt": 2}, None, id="num_videos_per_prompt"),
        pytest.param({"max_sequence_length": 12}, None, id="max_sequence_length"),
        pytest.param({"dtype": torch.bfloat16}, None, id="dtype"),
        pytest.param({"device": torch.device("cpu")}, None, id="device_given"),
        pytest.param({"prompt": None, "prompt_embeds": emb}, None, id="prompt_embeds"),
        pytest.param({"negative_prompt": None, "negative_prompt_embeds": emb}, None, id="negative_prompt_embeds"),
        pytest.param({}, "grad", id="grad_mode"),
        pytest.param({}, "autocast", id="autocast_bf16"),
    ]


def _mode(mode):
    if mode == "grad":
        return torch.enable_grad()
    if mode == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.no_grad()


@pytest.mark.parametrize("change, mode", _variants())
def test_each_key_ingredient_changed_alone_misses_and_equals_the_uncached_call(pipe, change, mode):
    args = {**BASE, **change}
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        pipe.encode_prompt(**BASE)
        pipe.encode_prompt(**BASE)
        with _mode(mode):
            got = pipe.encode_prompt(**args)
            again = pipe.encode_prompt(**args)
            want = uncached(pipe, **args)
    s = handle.stats()
    assert (s["misses"], s["hits"]) == (2, 2), f"{change} {mode}: expected its own entry (a miss, then a hit): {s}"
    assert_same(got, want, f"{change} {mode} miss")
    assert_same(again, want, f"{change} {mode} hit")


def test_prompt_embeds_are_keyed_by_content_not_by_buffer(pipe):
    emb = torch.linspace(-1, 1, 8 * 32).reshape(1, 8, 32)
    args = {**BASE, "prompt": None, "prompt_embeds": emb}
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        pipe.encode_prompt(**args)
        emb.mul_(2)  # the same buffer, another prompt
        got = pipe.encode_prompt(**args)
        want = uncached(pipe, **args)
    assert handle.stats()["misses"] == 2, handle.stats()
    assert_same(got, want, "after the in-place edit of prompt_embeds")


def test_a_call_that_builds_a_graph_runs_uncached(pipe):
    pipe.text_encoder.requires_grad_(True)
    with cache_prompts(pipe, new_cache()) as handle:
        got = pipe.encode_prompt(**BASE)
        pipe.encode_prompt(**BASE)
    assert got[0].requires_grad, "the caller asked for a graph"
    s = handle.stats()
    assert (s["uncached"], s["hits"], s["entries"]) == (2, 0, 0), s


def test_a_caller_editing_a_result_in_place_never_changes_the_cache(pipe):
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        want = uncached(pipe, **BASE)
        miss = pipe.encode_prompt(**BASE)
        miss[0].add_(1.0)
        hit = pipe.encode_prompt(**BASE)
        assert_same(hit, want, "hit after the caller edited the miss's result")
        hit[1].zero_()
        assert_same(pipe.encode_prompt(**BASE), want, "hit after the caller edited a hit's result")
    assert handle.stats()["hits"] == 2


def test_pipe_call_uses_the_cache_and_equals_the_uncached_pipeline(pipe):
    runs = Runs(pipe.text_encoder)
    kw = dict(prompt="a red fox", negative_prompt="blue cat", height=16, width=16, num_frames=1,
              num_inference_steps=1, max_sequence_length=8, output_type="latent")
    want = pipe(**kw, generator=torch.Generator().manual_seed(0)).frames
    with cache_prompts(pipe, new_cache()):
        before = runs.n
        pipe(**kw, generator=torch.Generator().manual_seed(0))
        got = pipe(**kw, generator=torch.Generator().manual_seed(0)).frames
    assert runs.n - before == 2, f"expected the two encodings of the first call only, got {runs.n - before}"
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item()}"


def test_close_restores_the_pipeline(pipe):
    handle = cache_prompts(pipe, new_cache())
    with pytest.raises(ValueError, match="pipe: already served"):
        cache_prompts(pipe, new_cache())
    handle.close()
    assert "encode_prompt" not in vars(pipe) and "fuse_lora" not in vars(pipe)
    assert pipe.encode_prompt.__func__ is type(pipe).encode_prompt
    runs = Runs(pipe.text_encoder)
    with torch.no_grad():
        pipe.encode_prompt(**BASE)
        pipe.encode_prompt(**BASE)
    assert runs.n == 4 and handle.stats()["hits"] == 0
    cache_prompts(pipe, new_cache()).close()  # a closed pipeline takes a new handle


@pytest.mark.parametrize("call, err, match", [
    pytest.param(lambda p: cache_prompts(p, {}), TypeError, "cache: expected a kvarena.FeatureCache", id="cache"),
    pytest.param(lambda p: cache_prompts(object(), new_cache()), TypeError, "pipe: expected", id="pipe"),
    pytest.param(lambda p: cache_prompts(p, new_cache(), components=["tokenizer"]), ValueError, "components: no text",
                 id="components_without_encoder"),
    pytest.param(lambda p: cache_prompts(p, new_cache(), components=["nope"]), ValueError, "components: ",
                 id="components_unknown"),
    pytest.param(lambda p: cache_prompts(p, new_cache(), components="text_encoder"), TypeError, "components must",
                 id="components_str"),
])
def test_bad_arguments_name_the_argument_and_install_nothing(pipe, call, err, match):
    with pytest.raises(err, match=match):
        call(pipe)
    assert "encode_prompt" not in vars(pipe)


@pytest.mark.parametrize("call, err, match", [
    pytest.param(lambda h: h.invalidate_weights(3), TypeError, "version: expected a str", id="version"),
    pytest.param(lambda h: h.invalidate_components("text_encoder"), TypeError, "names must", id="names_str"),
    pytest.param(lambda h: h.invalidate_components({"nope"}), ValueError, "names: ", id="names_unknown"),
])
def test_a_refused_invalidation_changes_nothing(pipe, call, err, match):
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        pipe.encode_prompt(**BASE)
        with pytest.raises(err, match=match):
            call(handle)
        pipe.encode_prompt(**BASE)
    s = handle.stats()
    assert (s["hits"], s["entries"]) == (1, 1), s


# ---------------------------------------------------------------------- item 2: weights versions
def _norm(pipe):
    return pipe.text_encoder.encoder.final_layer_norm


def _in_place(pipe):
    _norm(pipe).weight.mul_(1.5)


def _load_state_dict(pipe):
    sd = {k: v * 1.5 for k, v in pipe.text_encoder.state_dict().items()}
    pipe.text_encoder.load_state_dict(sd)


def _load_state_dict_assign(pipe):
    sd = {k: v * 1.5 for k, v in pipe.text_encoder.state_dict().items()}
    pipe.text_encoder.load_state_dict(sd, assign=True)


def _replaced_parameter(pipe):
    _norm(pipe).weight = torch.nn.Parameter(_norm(pipe).weight * 1.5, requires_grad=False)


def _data_assigned(pipe):
    _norm(pipe).weight.data = _norm(pipe).weight.data * 1.5


def _replaced_encoder(pipe):
    pipe.text_encoder = tiny_umt5(seed=1)


@pytest.mark.parametrize("write", [_in_place, _load_state_dict, _load_state_dict_assign, _replaced_parameter,
                                   _data_assigned, _replaced_encoder],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_visible_weight_change_misses_without_any_call(pipe, write):
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        old = pipe.encode_prompt(**BASE)
        write(pipe)
        got = pipe.encode_prompt(**BASE)
        want = uncached(pipe, **BASE)
    assert not torch.equal(want[0], old[0]), "the write must change the embedding (else the test proves nothing)"
    assert handle.stats()["misses"] == 2, handle.stats()
    assert_same(got, want, f"after {write.__name__}")


def test_a_data_write_needs_invalidate_weights_and_then_misses(pipe):
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        old = pipe.encode_prompt(**BASE)
        _norm(pipe).weight.data.mul_(1.5)  # bumps no version counter (PEFT's merge, an RL sync)
        stale = pipe.encode_prompt(**BASE)
        dropped = handle.invalidate_weights("step-1")
        got = pipe.encode_prompt(**BASE)
        want = uncached(pipe, **BASE)
    assert_same(stale, old, "documented limit: an unseen .data write before invalidate_weights")
    assert dropped == 1
    assert not torch.equal(want[0], old[0])
    assert_same(got, want, "after invalidate_weights")
    assert handle.cache.keys()[0].weights_version == "step-1"


def test_inference_tensor_weights_are_keyed_by_content(pipe):
    with torch.inference_mode():
        pipe.text_encoder = tiny_umt5(seed=0)  # parameters are inference tensors: no version counter
        assert _norm(pipe).weight.is_inference()
        with cache_prompts(pipe, new_cache()) as handle:
            old = pipe.encode_prompt(**BASE)
            hit = pipe.encode_prompt(**BASE)
            _norm(pipe).weight.mul_(1.5)
            got = pipe.encode_prompt(**BASE)
            want = uncached(pipe, **BASE)
    assert (handle.stats()["hits"], handle.stats()["misses"]) == (1, 2), handle.stats()
    assert_same(hit, old, "hit")
    assert not torch.equal(want[0], old[0])
    assert_same(got, want, "after the in-place write under inference mode")


def test_a_pipeline_lora_call_is_an_event_even_when_it_writes_through_data(pipe):
    def fuse_lora(**_):  # what PEFT's merge does to a text encoder: a .data write
        _norm(pipe).weight.data.add_(0.25)

    def unfuse_lora(**_):
        _norm(pipe).weight.data.sub_(0.25)

    pipe.fuse_lora, pipe.unfuse_lora = fuse_lora, unfuse_lora
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        before = pipe.encode_prompt(**BASE)
        pipe.fuse_lora()
        fused = pipe.encode_prompt(**BASE)
        want_fused = uncached(pipe, **BASE)
        pipe.unfuse_lora()
        after = pipe.encode_prompt(**BASE)
        want_after = uncached(pipe, **BASE)
    assert not torch.equal(want_fused[0], before[0])
    assert_same(fused, want_fused, "after fuse_lora")
    assert_same(after, want_after, "after unfuse_lora (an event, not a snapshot: no hit on the pre-fuse entry)")
    assert handle.stats()["misses"] == 3 and handle.stats()["hits"] == 0, handle.stats()
    assert pipe.fuse_lora is fuse_lora, "close() restores the pipeline's own methods"


def test_a_transformer_only_invalidation_keeps_the_embeddings(pipe):
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        pipe.encode_prompt(**BASE)
        assert handle.invalidate_components({"transformer"}) == 0
        pipe.encode_prompt(**BASE)
        assert handle.stats()["hits"] == 1
        assert handle.invalidate_components({"tokenizer"}) == 1
        pipe.encode_prompt(**BASE)
    assert (handle.stats()["hits"], handle.stats()["misses"]) == (1, 2), handle.stats()


def test_negative_control_diffusers_pointer_keyed_text_kv_cache_serves_a_stale_prompt():
    """diffusers' TextKVCache keys by ``data_ptr()``: a new prompt written into the same buffer
    gets the old prompt's K/V (this test proves the comparison sees staleness); the same edit
    through kvarena's handle is a miss."""
    from diffusers import NucleusMoEImageTransformer2DModel
    from diffusers.hooks import TextKVCacheConfig

    torch.manual_seed(0)
    model = NucleusMoEImageTransformer2DModel(
        patch_size=2, in_channels=8, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(2, 2, 4), moe_enabled=False, num_experts=2,
        moe_intermediate_dim=16).eval()
    x, emb, other = torch.randn(1, 16, 8), torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    kw = dict(hidden_states=x, img_shapes=[(1, 4, 4)], timestep=torch.tensor([500.0]), return_dict=False)
    with torch.no_grad():
        want = model(encoder_hidden_states=other, **kw)[0]
        model.enable_cache(TextKVCacheConfig())
        old = model(encoder_hidden_states=emb, **kw)[0]
        emb.copy_(other)
        stale = model(encoder_hidden_states=emb, **kw)[0]
    assert torch.equal(stale, old), "diffusers served the old prompt's K/V"
    assert not torch.equal(stale, want), f"and it is wrong by {(stale - want).abs().max().item():.4f}"


# ---------------------------------------------------------------------- item 3: sharing, threads, budget
PROMPTS = ("a red fox", "blue cat sits on mat", "green forest river", "city street rain", "lazy dog", "snow at night")


def test_two_pipelines_share_entries_only_through_the_same_encoder_objects():
    a = tiny_wan_pipeline(seed=0)
    other = tiny_wan_pipeline(seed=1)                  # another encoder
    twin = tiny_wan_pipeline(seed=0)                   # equal weights, other objects
    same = tiny_wan_pipeline(seed=2, text_encoder=a.text_encoder, tokenizer=a.tokenizer)
    cache = new_cache()
    handles = [cache_prompts(p, cache) for p in (a, other, twin, same)]
    with torch.no_grad():
        got = [p.encode_prompt(**BASE) for p in (a, other, twin, same)]
        want = [uncached(p, **BASE) for p in (a, other, twin, same)]
        _norm(a).weight.mul_(1.5)                     # a's encoder changes: so does same's
        after = same.encode_prompt(**BASE)
        want_after = uncached(same, **BASE)
    for name, g, w in zip(("a", "other", "twin", "same"), got, want):
        assert_same(g, w, name)
    assert not torch.equal(want[0][0], want[1][0])
    hits = [h.stats()["hits"] for h in handles]
    assert hits == [0, 0, 0, 1], f"only the pipeline holding a's encoder and tokenizer hits a's entry: {hits}"
    assert_same(after, want_after, "same, after a's encoder changed")
    assert handles[3].stats()["misses"] == 1 and cache.stats()["entries"] == 4, cache.stats()
    for h in handles:
        h.close()


def test_concurrent_calls_on_one_handle_are_right_and_encode_each_key_once(pipe):
    calls = [dict(BASE, prompt=p, max_sequence_length=n) for p in PROMPTS[:3] for n in (8, 12)]
    with torch.no_grad():
        want = [uncached(pipe, **c) for c in calls]
    results, errors = {}, []

    def worker(t):
        try:
            with torch.no_grad():
                for r in range(4):
                    for i in range(len(calls)):
                        j = (i * (t + 1) + r) % len(calls)
                        results[(t, r, i)] = j, pipe.encode_prompt(**calls[j])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with cache_prompts(pipe, new_cache()) as handle:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors, errors
    assert len(results) == 4 * 4 * len(calls)
    for (t, r, _), (j, got) in results.items():
        assert_same(got, want[j], f"thread {t} round {r} call {j}")
    s = handle.stats()
    assert s["encoder_calls"] == len(calls) and s["hits"] + s["misses"] == len(results), s


def test_the_byte_budget_holds(pipe):
    entry = 2 * 8 * 32 * 4  # prompt and negative embeddings, [1, 8, 32] fp32 each
    cache = new_cache(max_bytes=3 * entry)
    with torch.no_grad(), cache_prompts(pipe, cache) as handle:
        for rnd in range(2):
            for p in PROMPTS:
                got = pipe.encode_prompt(**dict(BASE, prompt=p))
                assert cache.used_bytes <= cache.max_bytes, cache.stats()
                assert_same(got, uncached(pipe, **dict(BASE, prompt=p)), f"round {rnd} {p!r}")
    s = cache.stats()
    assert s["entries"] == 3 and s["used_bytes"] == 3 * entry and s["evictions"] == 9, s
    assert handle.stats()["hits"] == 0, "LRU over 6 prompts cycling through 3 slots never hits"


def test_a_value_over_the_budget_is_not_stored_and_still_right(pipe):
    cache = new_cache(max_bytes=100)
    with torch.no_grad(), cache_prompts(pipe, cache) as handle:
        for _ in range(2):
            assert_same(pipe.encode_prompt(**BASE), uncached(pipe, **BASE), "over budget")
    assert (cache.stats()["entries"], cache.stats()["rejected"], handle.stats()["misses"]) == (0, 2, 2)


# ---------------------------------------------------------------------- the example
def test_the_example_runs_offline_and_shows_hits_a_weight_change_and_the_weight_sync():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(root / "examples" / "prompt_cache.py")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0] == "repeated prompt: hit, bitwise equal True, encoder runs 2", res.stdout
    assert lines[1].endswith("embedding changed True"), res.stdout
    assert "served the old entry True until invalidate_weights dropped 2; then fresh True" in lines[2], res.stdout


# ---------------------------------------------------------------------- LoRA through Flux's pipeline API
def _lora_steps():
    """(label, action on the pipeline, call arguments): each a new state of the CLIP encoder's LoRA."""
    return [
        ("load_lora_weights", lambda p: p.load_lora_weights(clip_lora(), adapter_name="style"), {}),
        ("lora_scale", lambda p: None, {"lora_scale": 0.5}),
        ("set_adapters", lambda p: p.set_adapters(["style"], adapter_weights=[0.3]), {}),
        ("fuse_lora", lambda p: p.fuse_lora(components=["text_encoder"]), {}),
        ("unfuse_lora", lambda p: p.unfuse_lora(components=["text_encoder"]), {}),
        ("disable_lora", lambda p: p.disable_lora(), {}),
        ("enable_lora", lambda p: p.enable_lora(), {}),
        ("delete_adapters", lambda p: p.delete_adapters("style"), {}),
    ]


def test_flux_text_encoder_lora_events_each_miss_and_equal_the_uncached_call():
    pytest.importorskip("peft", reason="a text-encoder LoRA through the pipeline's API needs peft")
    from _tiny_pipelines import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    args = dict(prompt="a red fox", prompt_2=None, max_sequence_length=8)
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        seen = [("base", pipe.encode_prompt(**args))]
        for label, action, extra in _lora_steps():
            action(pipe)
            got = pipe.encode_prompt(**args, **extra)
            again = pipe.encode_prompt(**args, **extra)
            want = uncached(pipe, **args, **extra)
            assert_same(got, want, f"{label}: miss")
            assert_same(again, want, f"{label}: hit")
            seen.append((label, want))
    s = handle.stats()
    assert (s["misses"], s["hits"]) == (9, 8), f"every LoRA step is its own entry: {s}"
    by = dict(seen)
    assert not torch.equal(by["load_lora_weights"][1], by["base"][1]), "the LoRA changes the pooled embedding"
    assert not torch.equal(by["unfuse_lora"][1], by["set_adapters"][1]), \
        "fuse then unfuse is not bitwise the state before: a snapshot of the adapter state would serve stale bits"


def test_a_two_encoder_pipeline_keys_each_encoder():
    from _tiny_pipelines import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    args = dict(prompt="a red fox", prompt_2="blue cat", max_sequence_length=8)
    with torch.no_grad(), cache_prompts(pipe, new_cache()) as handle:
        assert handle.component_id == "text_encoder+text_encoder_2"
        old = pipe.encode_prompt(**args)
        pipe.text_encoder_2.encoder.final_layer_norm.weight.mul_(1.5)  # the second encoder only
        changed = pipe.encode_prompt(**args)
        want = uncached(pipe, **args)
        pipe.text_encoder.final_layer_norm.weight.data.mul_(1.5)  # the first, unseen: the sync call
        assert handle.invalidate_weights("v2") == 2
        synced = pipe.encode_prompt(**args)
        want_synced = uncached(pipe, **args)
    assert not torch.equal(want[0], old[0]) and torch.equal(want[1], old[1]), "T5 feeds output 0, CLIP output 1"
    assert_same(changed, want, "after the T5 write")
    assert not torch.equal(want_synced[1], want[1])
    assert_same(synced, want_synced, "after the CLIP .data write and invalidate_weights")
    assert handle.stats()["misses"] == 3 and handle.stats()["hits"] == 0, handle.stats()
