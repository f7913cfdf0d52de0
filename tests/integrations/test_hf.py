"""kvarena as a Hugging Face attention implementation (``attn_implementation="kvarena"``).

Tiny random decoders built from configs (no downloads), fp32 on CPU: greedy tokens equal
eager's and every step's logits within 1e-4, for a single prompt and a left-padded batch
of 3 prompts longer than the sliding window; beam search and ``num_return_sequences``;
mutation controls (drop the window, softcap, sinks, padding or scaling: the comparison
must fail); what it cannot serve raises ``kvarena: ...``. Tied embeddings are off and the
init range is large, so a tiny model does not just echo its input; ``eos_token_id=-1``
keeps every row generating.
"""

from __future__ import annotations

import os

import pytest
import torch
from _helpers import assert_close, grad_mode, one_torch_thread  # noqa: F401 - fixtures

transformers = pytest.importorskip("transformers", minversion="5.0")
from kvarena.integrations import hf  # noqa: E402

TRITON = os.environ.get("TRITON_INTERPRET") == "1"
# transformers 5.2x renames generate's past_key_values to cache (still accepted, with a warning)
# Every test runs as written and under torch.inference_mode() (the grad_mode fixture).
pytestmark = [pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
              pytest.mark.usefixtures("grad_mode")]
TOL = 1e-4
WINDOW = 6

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.2, max_position_embeddings=256)
MODELS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2-mqa": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma2-window-softcap": ("Gemma2Config", "Gemma2ForCausalLM",
                              dict(sliding_window=WINDOW, head_dim=16, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=None, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention", "full_attention"])),
    "gptoss-sinks": ("GptOssConfig", "GptOssForCausalLM",
                     dict(sliding_window=WINDOW, head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()
    yield


def _model(name: str):
    cfg_name, model_name, extra = MODELS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra})
    return getattr(transformers, model_name)(cfg).eval()


def _prompts(batch: bool):
    gen = torch.Generator().manual_seed(7)
    if not batch:
        ids = torch.randint(1, 128, (1, 9), generator=gen)
        return ids, torch.ones_like(ids)
    lens = (5, 11, 17)  # all but the first longer than the window; left padded to 17
    ids = torch.zeros(3, 17, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, 17 - n :] = torch.randint(1, 128, (n,), generator=gen)
        mask[i, 17 - n :] = 1
    return ids, mask


def _generate(model, impl: str, ids, mask, **kw):
    model.set_attn_implementation(impl)
    out = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=-1, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits)


def _compare(model, ids, mask, what: str, arena=None, **kw) -> None:
    """Eager (with transformers' cache) against kvarena (with ``arena`` as its cache if given)."""
    want_seq, want_logits = _generate(model, "eager", ids, mask, **kw)
    extra = {} if arena is None else {"past_key_values": arena}
    got_seq, got_logits = _generate(model, "kvarena", ids, mask, **kw, **extra)
    err = (got_logits - want_logits).abs().max().item()
    assert err <= TOL, f"{what}: max logit error {err:.2e} > {TOL}"
    assert torch.equal(got_seq, want_seq), f"{what}: greedy tokens differ from eager"


@pytest.mark.parametrize("cache", ["hf-cache", "kvarena-cache"])
@pytest.mark.parametrize("batch", [False, True], ids=["one-prompt", "left-padded-3"])
@pytest.mark.parametrize("name", list(MODELS))
def test_generate_equals_eager(name: str, batch: bool, cache: str) -> None:
    """transformers' own cache (attended in place) or a KVArenaCache (K/V in the arena)."""
    model = _model(name)
    ids, mask = _prompts(batch)
    arena = hf.KVArenaCache(model.config, block_size=4) if cache == "kvarena-cache" else None
    _compare(model, ids, mask, f"{name} batch={batch} {cache}", max_new_tokens=10, arena=arena)
    if cache == "kvarena-cache":
        # padding never stored: each row holds its real tokens (the last generated one is
        # never fed back), in ceil(n / block_size) blocks
        real = mask.sum(1) + 10 - 1
        assert [arena.pool.seq_len(n) for n in arena._names] == real.tolist()
        _check_accounting(arena, real.tolist())


def _check_accounting(arena, real) -> None:
    """Bytes in use == blocks held over the layer groups; a group that keeps history (no
    release window) holds ceil(n / block_size) blocks per row."""
    pool, bs = arena.pool, arena.block_size
    groups = pool.stats()["groups"]
    held = [[b for b in pool.block_ids(name, g) if b != -1] for name in arena._names for g in range(len(groups))]
    assert arena.used_bytes == sum(map(len, held)) * pool.block_bytes
    for g, grp in enumerate(groups):
        if grp["window_left"] is None:
            assert [len(pool.block_ids(name, g)) for name in arena._names] == [-(-n // bs) for n in real]


@pytest.mark.parametrize("cache", ["hf-cache", "kvarena-cache"])
@pytest.mark.parametrize("name", ["llama-gqa", "gptoss-sinks"])
def test_beam_search_and_several_returns(name: str, cache: str) -> None:
    model = _model(name)
    ids, mask = _prompts(True)
    arena = hf.KVArenaCache(model.config) if cache == "kvarena-cache" else None
    _compare(model, ids, mask, f"{name} beams {cache}", max_new_tokens=6, num_beams=3, num_return_sequences=2,
             arena=arena)


def test_kvarena_cache_assisted_chunked_and_reset() -> None:
    """Assisted decoding (crop = truncate), chunked prefill, then reset() and a generate with
    another batch size on the same object (6 beams, then 3 prompts)."""
    model = _model("mistral-window")
    torch.manual_seed(1)
    draft = transformers.MistralForCausalLM(transformers.MistralConfig(
        **{**model.config.to_dict(), "num_hidden_layers": 1})).eval()
    ids, mask = _prompts(False)
    cache = hf.KVArenaCache(model.config)
    for extra in (dict(assistant_model=draft), dict(prefill_chunk_size=4)):
        draft.set_attn_implementation("eager")
        want, _ = _generate(model, "eager", ids, mask, max_new_tokens=8, **extra)
        draft.set_attn_implementation("kvarena")
        cache.reset()
        got, _ = _generate(model, "kvarena", ids, mask, max_new_tokens=8, past_key_values=cache, **extra)
        assert torch.equal(got, want), f"{list(extra)}"
        assert cache.pool.seq_len(cache._names[0]) == 9 + 8 - 1
    cache.reset()
    assert cache.used_bytes == 0
    _compare(model, ids, mask, "6 beams", max_new_tokens=4, num_beams=6, arena=cache)
    cache.reset()
    ids3, mask3 = _prompts(True)
    _compare(model, ids3, mask3, "then 3 prompts", max_new_tokens=4, arena=cache)


def test_kvarena_cache_errors_leave_it_unchanged() -> None:
    model = _model("llama-gqa")
    ids, mask = _prompts(True)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="^kvarena: KVArenaCache needs attn_implementation='kvarena'.*'eager'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=hf.KVArenaCache(model.config))
    twin = _model("llama-gqa")  # the same model on sdpa, given a cache made from the kvarena model's config
    twin.set_attn_implementation("sdpa")
    model.set_attn_implementation("kvarena")
    with pytest.raises(ValueError, match="^kvarena: KVArenaCache needs attn_implementation='kvarena'"):
        twin.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=hf.KVArenaCache(model.config))
    from kvarena import CacheFullError

    model.set_attn_implementation("kvarena")
    small = hf.KVArenaCache(model.config, max_tokens=20, block_size=4)  # the prompts need 33 tokens
    with pytest.raises(CacheFullError):
        model(ids, attention_mask=mask, past_key_values=small)
    assert small.used_bytes == 0 and not small.is_initialized and small.get_seq_length() == 0  # no arena yet
    model(ids[:, -4:], attention_mask=mask[:, -4:], past_key_values=small)  # a batch that fits still runs


@pytest.mark.parametrize(
    "name, drop",
    [("mistral-window", "sliding_window"), ("gemma2-window-softcap", "softcap"), ("gptoss-sinks", "s_aux"),
     ("llama-gqa", "padding"), ("qwen3", "scaling")],
)
def test_mutation_controls_fail(name: str, drop: str, monkeypatch) -> None:
    """Dropping one thing the adapter passes on must break the comparison (the tests can fail)."""
    real = hf.kvarena_attention

    def broken(module, query, key, value, attention_mask, **kw):
        if drop == "padding":
            attention_mask = None
        elif drop == "scaling":
            kw["scaling"] = 1.0
        else:
            kw[drop] = None
            if drop == "sliding_window" and attention_mask is not None:  # the window comes from the mask too
                padded, causal, _window = attention_mask._kvarena
                attention_mask = attention_mask.clone()
                attention_mask._kvarena = (padded, causal, None)
        return real(module, query, key, value, attention_mask, **kw)

    monkeypatch.setattr(hf, "kvarena_attention", broken)
    hf.register()
    try:
        model = _model(name)
        ids, mask = _prompts(True)
        # Dropped padding may also be caught as packing (pad positions break the position run).
        with pytest.raises((AssertionError, NotImplementedError)):
            _compare(model, ids, mask, f"{name} without {drop}", max_new_tokens=4)
    finally:
        monkeypatch.undo()
        hf.register()


def test_bf16_logits_are_as_close_to_fp32_as_eager() -> None:
    """Teacher-forced bf16 logits: kvarena's error vs an fp32 eager oracle <= 1.5x eager-bf16's."""
    model = _model("llama-gqa")
    ids, mask = _prompts(True)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        oracle = model(ids, attention_mask=mask).logits
        bf = model.to(torch.bfloat16)
        errs = {}
        for impl in ("eager", "kvarena"):
            bf.set_attn_implementation(impl)
            got = bf(ids, attention_mask=mask).logits.float()
            errs[impl] = (got - oracle)[mask.bool()].abs().max().item()
    assert errs["kvarena"] <= 1.5 * errs["eager"], errs


def test_fp8_kvarena_cache_within_the_fp8_bound() -> None:
    """KVArenaCache(dtype=float8_e4m3fn): fp8 K/V with per-token scales under an fp32 model.
    End to end on this random 2-layer model the logits of a left-padded batch (real rows)
    are within 10% (relative L2; measured 6.3%, a bf16 cache 0.8%) of eager's, where the
    fp32 KVArenaCache is within 1e-6; the arena holds (D + 4) / (4 D) of the fp32 bytes."""
    model = _model("llama-gqa")
    ids, mask = _prompts(True)
    real = mask.bool()
    caches = {"fp8": hf.KVArenaCache(model.config, block_size=4, dtype=torch.float8_e4m3fn),
              "fp32": hf.KVArenaCache(model.config, block_size=4)}
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(ids, attention_mask=mask).logits[real]
        model.set_attn_implementation("kvarena")
        err = {k: ((model(ids, attention_mask=mask, past_key_values=c).logits[real] - want).norm()
                   / want.norm()).item() for k, c in caches.items()}
    assert err["fp32"] <= 1e-6 and 1e-3 < err["fp8"] <= 0.10, err
    d = model.config.head_dim
    assert caches["fp8"].pool.layout.is_fp8 and caches["fp8"].pool.layout.input_dtype == torch.float32
    assert caches["fp8"].used_bytes * 4 * d == caches["fp32"].used_bytes * (d + 4)


def test_sliding_models_release_out_of_window_blocks() -> None:
    """Every Mistral layer slides: KVArenaCache releases blocks older than the window, a
    long generation keeps about a window per row and still equals eager. A model with no
    sliding layer releases nothing (explicitly asking is a ValueError)."""
    model = _model("mistral-window")
    ids, mask = _prompts(True)
    arena = hf.KVArenaCache(model.config, block_size=4, rollback_tokens=0)
    _compare(model, ids, mask, "mistral release", max_new_tokens=30, arena=arena)
    for name in arena._names:
        held = [b for b in arena.pool.block_ids(name) if b != -1]
        assert -1 in arena.pool.block_ids(name) and len(held) <= -(-WINDOW // 4) + 2, arena.pool.block_ids(name)
    assert arena.used_bytes < sum(-(-arena.pool.seq_len(n) // 4) for n in arena._names) * arena.pool.block_bytes
    llama = _model("llama-gqa")
    assert hf.KVArenaCache(llama.config)._release is None
    with pytest.raises(ValueError, match="free_out_of_window: the model has no sliding layer"):
        hf.KVArenaCache(llama.config, free_out_of_window=True)


@pytest.mark.parametrize("name", ["gemma2-window-softcap", "gemma3", "gptoss-sinks"])
def test_hybrid_models_free_their_sliding_layers_blocks(name: str) -> None:
    """Gemma 2/3 and gpt-oss mix sliding and full layers: KVArenaCache gives each kind its
    layer group, a 30-token generation (5x the window) equals eager, the sliding group holds
    about a window per row while the full group keeps every block."""
    model = _model(name)
    ids, mask = _prompts(True)
    arena = hf.KVArenaCache(model.config, block_size=4, rollback_tokens=0)
    _compare(model, ids, mask, f"{name} release", max_new_tokens=30, arena=arena)
    pool = arena.pool
    assert pool.layout.groups is not None
    real = [pool.seq_len(n) for n in arena._names]
    _check_accounting(arena, real)
    sliding = [g for g, grp in enumerate(pool.stats()["groups"]) if grp["window_left"] == WINDOW - 1]
    assert sliding and len(sliding) < len(pool.layout.layer_groups)
    for name_ in arena._names:
        for g in sliding:
            held = [b for b in pool.block_ids(name_, g) if b != -1]
            assert -1 in pool.block_ids(name_, g) and len(held) <= -(-WINDOW // 4) + 2, pool.block_ids(name_, g)
    keep = hf.KVArenaCache(model.config, block_size=4, free_out_of_window=False)
    _compare(model, ids, mask, f"{name} keep", max_new_tokens=30, arena=keep)
    assert keep.pool.layout.groups is None and arena.used_bytes < keep.used_bytes
    # A crop that some row cannot take (its window's blocks are gone) changes no row.
    before = [pool.seq_len(n) for n in arena._names], arena._len
    with pytest.raises(ValueError, match="n_tokens: rolling back"):
        arena.crop(-20)
    assert ([pool.seq_len(n) for n in arena._names], arena._len) == before


def test_second_generate_continues_the_same_kvarena_cache() -> None:
    """Multi-turn: a second generate on the full sequence with the same cache feeds only
    the unseen tokens (the cache must not look recurrent to transformers)."""
    model = _model("llama-gqa")
    ids, mask = _prompts(False)
    turns = {}
    for impl in ("eager", "kvarena"):
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config) if impl == "eager" else hf.KVArenaCache(model.config)
        first = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=-1,
                               pad_token_id=0, past_key_values=cache)
        more = torch.cat([first, torch.randint(1, 128, (1, 4), generator=torch.Generator().manual_seed(3))], 1)
        turns[impl] = model.generate(more, attention_mask=torch.ones_like(more), max_new_tokens=5, do_sample=False,
                                     eos_token_id=-1, pad_token_id=0, past_key_values=cache)
    assert torch.equal(turns["kvarena"], turns["eager"])


def test_what_it_cannot_serve_is_a_clear_error() -> None:
    model = _model("llama-gqa")
    model.set_attn_implementation("kvarena")
    ids = torch.randint(1, 128, (2, 7))
    with pytest.raises(NotImplementedError, match="^kvarena: packed sequences"):
        model(ids[:1], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
    # 4-D masks are served (tests/integrations/test_hf_masks.py); a tensor of another rank the hook did not make is not
    q = torch.randn(2, 4, 7, 16)
    with pytest.raises(NotImplementedError, match="^kvarena: an attention mask that did not come from its mask hook"):
        hf.kvarena_attention(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], torch.zeros(2, 7))
    with pytest.raises(NotImplementedError, match="^kvarena: a cache of 9 slots from 3 for 7 tokens"):
        hf.kvarena_mask(2, 7, 9, kv_offset=3)  # fewer key slots holding tokens than queries
    built = hf.kvarena_mask(2, 1, 9, q_offset=6)  # a static cache's step, fed back: served as built
    assert hf.kvarena_mask(2, 1, 9, q_offset=6, attention_mask=built) is built
    with pytest.raises(NotImplementedError, match=r"^kvarena: a mask built for other sizes \(\(2, 1, 9, 6, 0\)"):
        hf.kvarena_mask(2, 1, 9, q_offset=7, attention_mask=built)
    from transformers.masking_utils import causal_mask_function, chunked_causal_mask_function

    chunked = chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))
    # With a cache chunks are not a packed prefill: the hook hands over transformers' own 4-D
    # mask (the attention function's 4-D reading serves it; tests/integrations/test_hf_masks.py).
    from transformers.masking_utils import sdpa_mask

    dense = hf.kvarena_mask(2, 2, 7, q_offset=5, mask_function=chunked)
    assert dense.dim() == 4 and torch.equal(dense, sdpa_mask(2, 2, 7, q_offset=5, mask_function=chunked,
                                                             allow_is_causal_skip=False))
    # Without a cache, chunks read exactly as packed sequences (3, 3 and 1 tokens per row).
    rows, ends, starts, _cu, longest = hf.kvarena_mask(2, 7, 7, mask_function=chunked)._kvarena_segments
    assert (starts.tolist(), ends.tolist(), longest) == ([0, 3, 6] * 2, [3, 6, 7] * 2, 3), (starts, ends)
    assert hf.kvarena_mask(2, 7, 7, mask_function=causal_mask_function)._kvarena == (False, True, None)
    model.train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(NotImplementedError, match="^kvarena: attention dropout"):
        model(ids)


@pytest.mark.gpu
@pytest.mark.skipif(not TRITON, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("cache", ["hf-cache", "kvarena-cache"])
@pytest.mark.parametrize("name", ["llama-gqa", "gemma2-window-softcap", "gptoss-sinks"])
def test_generate_on_the_triton_path(name: str, cache: str) -> None:
    hf.register(backend="triton")
    try:
        model = _model(name)
        ids, mask = _prompts(True)
        arena = hf.KVArenaCache(model.config, block_size=4) if cache == "kvarena-cache" else None
        _compare(model, ids[:, -8:], mask[:, -8:], f"{name} triton {cache}", max_new_tokens=3, arena=arena)
    finally:
        hf.register()


def test_example_script_generates_the_same_tokens(monkeypatch, capsys) -> None:
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "hf_generate.py"
    for extra in ([], ["--arena-cache"]):
        monkeypatch.setattr(sys, "argv", [str(script), "--max-new-tokens", "4", "--device", "cpu", *extra])
        runpy.run_path(str(script), run_name="__main__")
        assert "same tokens: True" in capsys.readouterr().out, extra


# --------------------------------------------------------------------------- refused steps (issue 27)


def _arena_state(cache) -> tuple:
    """What a refused step must leave as it was (public state): the length transformers sees,
    the bytes in use and, per row of the pool, its tokens and block ids."""
    pool = cache.pool
    rows = () if pool is None else tuple((pool.seq_len(n), tuple(pool.block_ids(n))) for n in pool.namespaces())
    return cache.get_seq_length(), cache.used_bytes, rows


def _refuse(case: str, model, cache, ids, monkeypatch) -> None:
    """One step of ``ids`` on ``cache`` that kvarena refuses, by ``case`` (grad mode on)."""
    if case == "dropout":
        model.train()
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.5
        try:
            with pytest.raises(NotImplementedError, match="^kvarena: attention dropout"):
                model(ids, past_key_values=cache)
        finally:
            model.eval()
            for layer in model.model.layers:
                layer.self_attn.attention_dropout = 0.0
    elif case == "4d-mask":
        mask = torch.zeros(ids.shape[0], 1, ids.shape[1], cache.get_seq_length() + ids.shape[1])
        with pytest.raises(NotImplementedError, match="^kvarena: a 4-D attention mask with KVArenaCache"):
            model(ids, attention_mask=mask, past_key_values=cache)
    elif case == "sdpa-twin":
        # Layer 0's hand-off goes to sdpa: on a first step layer 1's update refuses; after a
        # step sdpa itself fails (it sees only the new keys), outside kvarena's code.
        twin = _model("llama-gqa")
        twin.set_attn_implementation("sdpa")
        with pytest.raises((ValueError, RuntimeError), match="^kvarena: KVArenaCache needs|size of tensor"):
            twin(ids, past_key_values=cache)
    elif case == "fp8-grad":  # the pool refuses fp8 under autograd, now before the step's plan
        with pytest.raises(ValueError, match="^k/v: this pool stores fp8"):
            model(ids, past_key_values=cache)
    elif case == "triton-unavailable":  # backend="triton" on CPU without the interpreter
        hf.register(backend="triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        try:
            with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
                model(ids, past_key_values=cache)
        finally:
            monkeypatch.undo()
            hf.register()
    elif case == "later-layer":  # a step the pool refuses at layer 1, after its plan
        forward = cache.pool.forward

        def refuse_layer_1(q, k, v, meta, layer, **opts):
            if layer == 1:
                raise ValueError("refused at layer 1")
            return forward(q, k, v, meta, layer, **opts)

        monkeypatch.setattr(cache.pool, "forward", refuse_layer_1)
        try:
            with pytest.raises(ValueError, match="refused at layer 1"):
                model(ids, past_key_values=cache)
        finally:
            monkeypatch.undo()


# (a refusal after the plan, at a later layer, needs a step before it: the first has no pool)
REFUSALS = [pytest.param(case, first, id=f"{case}-{'first-step' if first else 'after-a-step'}")
            for case in ("dropout", "4d-mask", "sdpa-twin", "fp8-grad", "triton-unavailable", "later-layer")
            for first in (True, False) if not (first and case == "later-layer")]


@pytest.mark.parametrize(("case", "first"), REFUSALS)
def test_a_refused_step_leaves_the_kvarena_cache_as_it_was(case: str, first: bool, seed, monkeypatch) -> None:
    """Issue 27 #1: a refused step used to advance the cache (length 0 -> 7 and a hand-off
    left pending, so the next valid call failed with a misleading error), and a step the pool
    refused after its plan left planned-but-unwritten tokens that the next call attended.
    Now length, rows, tokens and blocks are as before (no arena if the step made it), and the
    next valid step gives exactly what a cache that never saw the refusal gives."""
    if case == "fp8-grad" and torch.is_inference_mode_enabled():
        pytest.skip("fp8 under autograd: there is no autograd under inference mode")
    model = _model("llama-gqa")
    model.set_attn_implementation("kvarena")
    ids = torch.randint(1, 128, (2, 7))
    kw = dict(block_size=4, dtype=torch.float8_e4m3fn if case == "fp8-grad" else None)
    cache, clean = hf.KVArenaCache(model.config, **kw), hf.KVArenaCache(model.config, **kw)
    step = ids if first else ids[:, 4:]
    if not first:
        with torch.no_grad():
            for c in (cache, clean):
                model(ids[:, :4], past_key_values=c)
    before = _arena_state(cache)
    _refuse(case, model, cache, step, monkeypatch)
    after = _arena_state(cache)
    assert after == before, f"{case}: the refused step changed the cache: {before} -> {after}"
    assert cache.is_initialized == clean.is_initialized, f"{case}: the refused first step left an arena"
    with torch.no_grad():
        got = model(step, past_key_values=cache).logits
        want = model(step, past_key_values=clean).logits
    assert torch.equal(got, want), f"{case}: the next step differs by {(got - want).abs().max().item():.3e}"
    got_s, want_s = _arena_state(cache), _arena_state(clean)  # block ids may differ: allocation order
    assert (got_s[:2], [r[0] for r in got_s[2]]) == (want_s[:2], [r[0] for r in want_s[2]]), f"{got_s} != {want_s}"


@pytest.mark.parametrize(("n", "exc", "text"), [
    pytest.param(-100, ValueError, r"^n: crop\(-100\) drops 100 tokens, the cache holds 7", id="past-the-start"),
    pytest.param(-8, ValueError, r"^n: crop\(-8\) drops 8 tokens, the cache holds 7", id="one-past"),
    pytest.param(2.5, TypeError, r"^n: expected an int, got 2\.5", id="not-an-int"),
])
def test_crop_past_the_cache_is_a_value_error(n, exc, text) -> None:
    """Issue 27 #2: crop(-100) on 7 tokens gave get_seq_length() == -93. Dropping more than the
    cache holds is a ValueError naming n, the cache unchanged; dropping all of it empties it."""
    model = _model("llama-gqa")
    model.set_attn_implementation("kvarena")
    cache = hf.KVArenaCache(model.config, block_size=4)
    with torch.no_grad():
        model(torch.randint(1, 128, (2, 7)), past_key_values=cache)
    before = _arena_state(cache)
    with pytest.raises(exc, match=text):
        cache.crop(n)
    assert _arena_state(cache) == before, f"crop({n!r}) changed the cache: {before} -> {_arena_state(cache)}"
    cache.crop(-7)
    assert _arena_state(cache)[0] == 0 and all(r[0] == 0 for r in _arena_state(cache)[2]), _arena_state(cache)


def test_cache_reused_by_a_model_with_other_kv_heads_is_not_implemented() -> None:
    """Issue 27 #3: the contract's kvarena: NotImplementedError (it was a ValueError), raised
    before the step changes the cache; the model the arena was made for still continues."""
    model = _model("llama-gqa")  # 2 kv heads
    other = _model("qwen2-mqa")  # 1 kv head
    for m in (model, other):
        m.set_attn_implementation("kvarena")
    cache = hf.KVArenaCache(model.config, block_size=4)
    ids = torch.randint(1, 128, (2, 7))
    with torch.no_grad():
        model(ids[:, :4], past_key_values=cache)
        before = _arena_state(cache)
        with pytest.raises(NotImplementedError, match="^kvarena: an arena made for other heads"):
            other(ids[:, 4:], past_key_values=cache)
        assert _arena_state(cache) == before, f"{before} -> {_arena_state(cache)}"
        model(ids[:, 4:], past_key_values=cache)
    assert cache.get_seq_length() == 7


# --------------------------------------------------------------------------- issue 29

# Right padding and holes (item 1): a row of real tokens only, then right padding, or holes
# inside the window and leading padding; 12 columns, longer than the window (6). The last
# column's window holds a real key in every row (generate picks the next token there; a
# window of padding only is eager's average over a fully masked row, kvarena's 0).
PAD_MASKS = {
    "right": [[1] * 12, [1] * 9 + [0] * 3, [1] * 7 + [0] * 5],
    "holes": [[1] * 12, [1] * 3 + [0] * 2 + [1] * 7, [0] * 2 + [1] * 4 + [0] * 3 + [1] * 2 + [0]],
}


def _pad_batch(kind: str):
    ids = torch.randint(1, 128, (3, 12), generator=torch.Generator().manual_seed(3))
    return ids, torch.tensor(PAD_MASKS[kind])


@pytest.mark.parametrize("kind", list(PAD_MASKS))
@pytest.mark.parametrize("cache", ["hf-cache", "kvarena-cache"])
@pytest.mark.parametrize("name", list(MODELS))
def test_right_padding_and_holes_equal_eager(name: str, cache: str, kind: str) -> None:
    """Issue 29 #1: any 2-D padding mask (it was "only left padding"). One forward: every
    position that sees a real key within 1e-4 of eager (real tokens, and padding queries,
    which eager attends too: generate picks a right-padded row's next token there); then
    generate from the same batch: tokens and every step's logits equal eager's. With a
    KVArenaCache each row stores exactly its real tokens (padding never stored)."""
    model = _model(name)
    ids, mask = _pad_batch(kind)
    # A query none of whose windows holds a real key (before a row's first real key, or far
    # past a right-padded row's last one) is eager's average over a fully masked row: skipped.
    c = mask.cumsum(1)
    w = model.config.sliding_window if getattr(model.config, "sliding_window", None) else 12
    seen = c - torch.nn.functional.pad(c, (w, 0))[:, :12] > 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("kvarena")
        arena = hf.KVArenaCache(model.config, block_size=4) if cache == "kvarena-cache" else None
        extra = {} if arena is None else {"past_key_values": arena}
        got = model(ids, attention_mask=mask, **extra).logits
    err = (got - want)[seen].abs().max().item()
    assert err <= TOL, f"{name} {kind} {cache}: forward max logit error {err:.2e} > {TOL}"
    if arena is not None:
        assert [arena.pool.seq_len(n) for n in arena._names] == mask.sum(1).tolist(), "padding was stored"
        arena.reset()
    _compare(model, ids, mask, f"{name} {kind} {cache} generate", arena=arena, max_new_tokens=4)
    if arena is not None:
        assert [arena.pool.seq_len(n) for n in arena._names] == (mask.sum(1) + 3).tolist(), "padding was stored"


@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # autograd
def test_padding_holes_under_autograd_and_refusals() -> None:
    """Right padding under autograd: the gradients of a loss over the real positions equal
    eager's (transformers' cache, and a KVArenaCache whose queries are all real). What
    KVArenaCache cannot read per query under autograd is a kvarena: error, cache unchanged."""
    model = _model("mistral-window")
    ids, mask = _pad_batch("right")
    real = mask.bool()
    grads = {}
    for impl in ("eager", "kvarena", "kvarena-cache"):
        model.zero_grad()
        model.set_attn_implementation("eager" if impl == "eager" else "kvarena")
        extra = {"past_key_values": hf.KVArenaCache(model.config, block_size=4)} if impl == "kvarena-cache" else {}
        n = 5 if impl == "kvarena-cache" else 12  # the first 5 columns: every query real
        model(ids[:, :n], attention_mask=mask[:, :n], **extra).logits[real[:, :n]].square().mean().backward()
        grads[impl] = torch.cat([p.grad.flatten() for p in model.model.layers[0].self_attn.parameters()])
    for impl in ("kvarena",):
        err = ((grads[impl] - grads["eager"]).norm() / grads["eager"].norm()).item()
        assert err <= 1e-5, f"{impl}: gradient relative error {err:.2e}"
    model.zero_grad()
    model.set_attn_implementation("eager")
    model(ids[:, :5], attention_mask=mask[:, :5]).logits[real[:, :5]].square().mean().backward()
    want5 = torch.cat([p.grad.flatten() for p in model.model.layers[0].self_attn.parameters()])
    err = ((grads["kvarena-cache"] - want5).norm() / want5.norm()).item()
    assert err <= 1e-5, f"kvarena-cache: gradient relative error {err:.2e}"
    model.set_attn_implementation("kvarena")
    cache = hf.KVArenaCache(model.config, block_size=4)
    with torch.no_grad():
        model(ids[:, :4], attention_mask=mask[:, :4], past_key_values=cache)
    before = _arena_state(cache)
    with pytest.raises(NotImplementedError, match="^kvarena: under autograd with KVArenaCache, padding queries"):
        model(ids[:, 4:], attention_mask=mask, past_key_values=cache)
    assert _arena_state(cache) == before, f"{before} -> {_arena_state(cache)}"


def _layer_kv(cache, i: int):
    return cache.layers[i].keys, cache.layers[i].values


@pytest.mark.parametrize("dtype", [None, torch.float8_e4m3fn], ids=["fp32", "fp8"])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_kvarena_cache_layers_read_like_transformers_cache(name: str, dtype) -> None:
    """Issue 29 #5: ``cache.layers[i].keys / .values`` are the arena's K/V gathered into
    transformers' layout ``[B, H_kv, S, D]`` and the model's dtype, equal to the eager
    DynamicCache's at every slot the arena holds (fp8: within its rounding) and 0 where it
    holds nothing (left padding, Mistral's released out-of-window blocks); the base API
    (``batch_size``, ``get_max_length``, ``has_previous_state``, ``is_croppable``) answers as
    transformers' cache does."""
    model = _model(name)
    ids, mask = _prompts(True)
    arena = hf.KVArenaCache(model.config, block_size=4, rollback_tokens=0, dtype=dtype)
    assert len(arena.layers) == len(arena) == 2 and arena.layers[0].keys is None and arena.batch_size == -1
    runs = {}
    for impl, cache in (("eager", transformers.DynamicCache(config=model.config)), ("kvarena", arena)):
        model.set_attn_implementation(impl)
        runs[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=-1,
                                    pad_token_id=0, past_key_values=cache, return_dict_in_generate=True)
    dyn = runs["eager"].past_key_values
    assert runs["kvarena"].past_key_values is arena
    assert arena.batch_size == 3 and arena.get_seq_length() == dyn.get_seq_length() == 24
    # -1: no maximum, as DynamicCache's full layers (its sliding layers answer the window they keep)
    assert arena.get_max_length() == arena.get_max_length(1) == -1
    assert name != "llama-gqa" or dyn.get_max_length() == -1
    assert arena.is_croppable and arena.is_initialized and not arena.is_compileable
    with pytest.raises(ValueError, match="can only be called on LinearAttention layers") as got:
        arena.has_previous_state()
    with pytest.raises(ValueError) as want:
        dyn.has_previous_state()
    assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match=r"^layer_idx: expected an int in \[0, 2\), got 2"):
        arena.get_max_length(2)
    tol = 0.1 if dtype is not None else TOL
    for i in range(2):
        for what, got_t, want_t in zip(("keys", "values"), _layer_kv(arena, i), _layer_kv(dyn, i)):
            assert got_t.shape == (3, 2, 24, 16) and got_t.dtype == torch.float32, (what, got_t.shape, got_t.dtype)
            held = torch.zeros(3, 24, dtype=torch.bool)
            for r, n in enumerate(arena.pool.seq_len(nm) for nm in arena._names):
                blocks = arena.pool.block_ids(arena._names[r], 0)
                held[r, 24 - n :] = torch.tensor([b >= 0 for b in blocks]).repeat_interleave(4)[:n]
            assert torch.equal(held[:, :17], mask.bool() & held[:, :17]), "a padding slot is marked held"
            assert not got_t.transpose(1, 2)[~held].any(), f"layer {i} {what}: a slot the arena lacks is not 0"
            w = want_t.shape[2]  # DynamicCache's sliding layers keep only the newest window - 1 tokens
            sel = held[:, -w:].clone()
            if dtype is not None:  # fp8 greedy tokens may part from eager's: the prompt's slots only
                sel[:, max(0, 17 - (24 - w)) :] = False
            assert sel.any() or (dtype is not None and w < 8), f"layer {i} {what}: nothing compared"
            if sel.any():
                g, ref = got_t[:, :, -w:].transpose(1, 2)[sel], want_t.transpose(1, 2)[sel]
                err = ((g - ref).norm() / ref.norm()).item() if dtype is not None else (g - ref).abs().max().item()
                assert err <= tol, f"layer {i} {what}: error {err:.2e} > {tol}"
    if name == "mistral-window":
        assert not held.all(), "the window release left every block: the zero check tested nothing"
    with pytest.raises(NotImplementedError, match="^kvarena: crop on one layer of a KVArenaCache"):
        arena.layers[0].crop(-1)
    arena.reset()
    assert arena.batch_size == -1 and arena.layers[1].values is None


def test_continue_from_a_returned_kvarena_cache_gives_the_same_cache() -> None:
    """transformers' test_generate_continue_from_past_key_values on a KVArenaCache: 3 tokens,
    then 3 more from the returned cache equal 6 at once, tokens and every layer's K/V."""
    model = _model("gemma3")
    model.set_attn_implementation("kvarena")
    ids, mask = _prompts(False)
    kw = dict(do_sample=False, eos_token_id=-1, pad_token_id=0, return_dict_in_generate=True)
    whole = model.generate(ids, attention_mask=mask, max_new_tokens=6, past_key_values=hf.KVArenaCache(
        model.config, block_size=4), **kw)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=3, past_key_values=hf.KVArenaCache(
        model.config, block_size=4), **kw)
    more = model.generate(first.sequences, attention_mask=torch.ones_like(first.sequences), max_new_tokens=3,
                          past_key_values=first.past_key_values, **kw)
    assert torch.equal(more.sequences, whole.sequences), "continued tokens differ"
    a, b = whole.past_key_values, more.past_key_values
    assert len(a) == len(b) == 2
    for i in range(2):
        for what, x, y in zip(("keys", "values"), _layer_kv(a, i), _layer_kv(b, i)):
            assert x.shape == y.shape, (i, what, x.shape, y.shape)
            err = (x - y).abs().max().item()
            assert err <= TOL, f"layer {i} {what}: continued cache differs by {err:.2e}"


@pytest.mark.parametrize("how", ["forward-kwarg", "generate"])
@pytest.mark.parametrize("cache", ["hf-cache", "kvarena-cache"])
def test_output_attentions_is_a_clear_error(cache: str, how: str) -> None:
    """Issue 29 #6: output_attentions=True came back as an empty tuple, silently. Now it is a
    kvarena: NotImplementedError (kvarena never forms the weights), a KVArenaCache unchanged
    by it, and the next step (output_attentions=False) runs. (A config with output_attentions
    =True under kvarena is refused by transformers itself.)"""
    model = _model("llama-gqa")
    model.set_attn_implementation("kvarena")
    ids, mask = _prompts(True)
    arena = hf.KVArenaCache(model.config, block_size=4) if cache == "kvarena-cache" else None
    extra = {} if arena is None else {"past_key_values": arena}
    if arena is not None:
        with torch.no_grad():
            model(ids[:, :9], attention_mask=mask[:, :9], past_key_values=arena)
        before = _arena_state(arena)
    step = (ids[:, 9:], mask) if arena is not None else (ids, mask)
    with pytest.raises(NotImplementedError, match=r"^kvarena: output_attentions=True \(kvarena never forms"):
        if how == "forward-kwarg":
            model(step[0], attention_mask=step[1], output_attentions=True, **extra)
        else:
            model.generate(ids, attention_mask=mask, max_new_tokens=2, output_attentions=True,
                           return_dict_in_generate=True, eos_token_id=-1, pad_token_id=0)
    if arena is not None:
        assert _arena_state(arena) == before, f"{how}: the refused step changed the cache"
    with torch.no_grad():
        out = model(step[0], attention_mask=step[1], output_attentions=False, **extra)
    assert out.attentions is None and out.logits.shape[1] == step[0].shape[1]


@pytest.mark.parametrize(("name", "pad"), [
    *[pytest.param(n, "left", id=f"{n}-left-padded-3") for n in ("llama-gqa", "mistral-window", "gemma3",
                                                                  "gptoss-sinks")],
    pytest.param("gemma3", "holes", id="gemma3-holes"),
])
def test_static_cache_generate_equals_eager(name: str, pad: str) -> None:
    """Issue 29 #3 (and the message: a static cache on Mistral was refused as "a 1-D padding
    mask in the mask hook"): generate(cache_implementation="static") on a left-padded batch
    longer than the window equals eager's tokens and logits. The hook attends only the
    slots holding tokens (the rest are empty, in every query's future) and serves the mask
    generate builds ahead of the forward when the model feeds it back. Holes too."""
    model = _model(name)
    ids, mask = _prompts(True) if pad == "left" else _pad_batch(pad)
    _compare(model, ids, mask, f"{name} static {pad}", max_new_tokens=6, cache_implementation="static")


@pytest.mark.gpu
@pytest.mark.skipif(not TRITON, reason="needs TRITON_INTERPRET=1")
def test_padding_holes_on_the_triton_path() -> None:
    """Holes through the Triton kernels (interpreter): Mistral on a KVArenaCache, holes and a
    padding query after real ones (the per-query reading over the arena's blocks, after the
    store); every position that sees a key within 1e-4 of eager."""
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0]])  # holes, and a padding query after real ones
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    hf.register(backend="triton")
    try:
        model = _model("mistral-window")
        with torch.no_grad():
            model.set_attn_implementation("eager")
            want = model(ids, attention_mask=mask).logits
            model.set_attn_implementation("kvarena")
            got = model(ids, attention_mask=mask, past_key_values=hf.KVArenaCache(model.config, block_size=4)).logits
        err = (got - want)[mask.cumsum(1) > 0].abs().max().item()
        assert err <= TOL, f"triton: max logit error {err:.2e} > {TOL}"
    finally:
        hf.register()


PACKED_POS = [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.mark.parametrize("name", [n for n in MODELS if n != "gptoss-sinks"])
def test_packed_sequences_by_position_ids_equal_eager(name: str) -> None:
    """Issue 29 #2: position_ids restarting inside a row, no padding mask and no cache (the
    padding-free batches TRL packs), which transformers folds into the mask: each sequence
    attends only itself (one kvarena sequence per packed one, kv_start its first token),
    within 1e-4 of eager and of the sequence run alone; gradients too (Llama)."""
    model = _model(name)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor(PACKED_POS)
    grad = name == "llama-gqa" and not torch.is_inference_mode_enabled()  # gradients need autograd
    out = {}
    for impl in ("eager", "kvarena"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        with torch.set_grad_enabled(grad):
            logits = model(ids, position_ids=pos, use_cache=False).logits
            if grad:
                logits.square().mean().backward()
        out[impl] = logits.detach(), grad and torch.cat([p.grad.flatten() for p in model.model.layers[0].parameters()
                                                         if p.grad is not None])
        if impl == "kvarena":
            with torch.no_grad():
                alone = model(ids[:1, 8:], use_cache=False).logits
    err = (out["kvarena"][0] - out["eager"][0]).abs().max().item()
    assert err <= TOL, f"{name} packed: max logit error {err:.2e} > {TOL}"
    err = (alone - out["kvarena"][0][:1, 8:]).abs().max().item()
    assert err <= TOL, f"{name} packed: the second sequence differs from itself alone by {err:.2e}"
    if grad:
        g, w = out["kvarena"][1], out["eager"][1]
        err = ((g - w).norm() / w.norm()).item()
        assert err <= 1e-5, f"{name} packed: gradient relative error {err:.2e}"


def test_packed_sequences_transformers_does_not_fold_are_refused() -> None:
    """gpt-oss (and any model given a cache) does not fold packed position_ids into its mask:
    eager attends across the sequences there, kvarena refuses with a clear error."""
    model = _model("gptoss-sinks")
    model.set_attn_implementation("kvarena")
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with pytest.raises(NotImplementedError, match=r"^kvarena: packed sequences \(position_ids that restart"):
        model(ids, position_ids=torch.tensor(PACKED_POS), use_cache=False)


@pytest.mark.gpu
@pytest.mark.skipif(not TRITON, reason="needs TRITON_INTERPRET=1")
def test_packed_sequences_on_the_triton_path() -> None:
    """Packed sequences through the Triton kernels (interpreter): Mistral, a sequence longer
    than the window; within 1e-4 of eager."""
    model = _model("mistral-window")
    ids = torch.randint(1, 128, (1, 11), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]])
    hf.register(backend="triton")
    try:
        with torch.no_grad():
            model.set_attn_implementation("eager")
            want = model(ids, position_ids=pos, use_cache=False).logits
            model.set_attn_implementation("kvarena")
            got = model(ids, position_ids=pos, use_cache=False).logits
    finally:
        hf.register()
    err = (got - want).abs().max().item()
    assert err <= TOL, f"triton packed: max logit error {err:.2e} > {TOL}"


# --------------------------------------------------------------------------- issue 41


INFERENCE_CASES = ["forward-2-tokens", "left-padded", "right-padded", "holes", "generate-hf-cache",
                   "generate-kvarena-cache"]


@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # enters inference mode itself
@pytest.mark.parametrize("case", INFERENCE_CASES)
def test_inference_mode_equals_eager(case: str) -> None:
    """Issue 41 #1: under torch.inference_mode() every forward of 2+ tokens died with
    "Inference tensors do not track version counter" (the adapter read ``_version`` of the
    model's position_ids). Now each case equals eager's, also run under inference mode."""
    model = _model("mistral-window")
    gen = torch.Generator().manual_seed(41)
    if case in ("right-padded", "holes"):
        ids, mask = _pad_batch("right" if case == "right-padded" else "holes")
    elif case == "forward-2-tokens":
        ids = torch.randint(1, 128, (1, 2), generator=gen)
        mask = torch.ones_like(ids)
    else:
        ids, mask = _prompts(True)
    with torch.inference_mode():
        if case.startswith("generate"):
            arena = hf.KVArenaCache(model.config, block_size=4) if case == "generate-kvarena-cache" else None
            want_seq, want = _generate(model, "eager", ids, mask, max_new_tokens=5)
            extra = {} if arena is None else {"past_key_values": arena}
            got_seq, got = _generate(model, "kvarena", ids, mask, max_new_tokens=5, **extra)
            assert torch.equal(got_seq, want_seq), f"{case}: greedy tokens differ from eager's"
            sel = torch.ones(got.shape[:2], dtype=torch.bool)
        else:
            model.set_attn_implementation("eager")
            want = model(ids, attention_mask=mask).logits
            model.set_attn_implementation("kvarena")
            got = model(ids, attention_mask=mask).logits
            c = mask.cumsum(1)  # positions whose window holds a real key (else eager averages a masked row)
            sel = c - torch.nn.functional.pad(c, (WINDOW, 0))[:, : c.shape[1]] > 0
    assert_close(got[sel], want[sel], torch.float32, f"{case} under inference mode: logits")


@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # switches modes itself
@pytest.mark.parametrize("order", ["inference-then-no-grad", "no-grad-then-inference"])
def test_kvarena_cache_serves_steps_in_and_out_of_inference_mode(order: str) -> None:
    """Issue 41 #1: a KVArenaCache whose arena was made under inference mode could not be
    written outside it (its block tables are inference tensors); the same cache now serves
    steps in either mode, equal to DynamicCache's."""
    model = _model("llama-gqa")
    ids, mask = _prompts(True)
    modes = [torch.inference_mode, torch.no_grad]
    if order == "no-grad-then-inference":
        modes.reverse()
    logits = {}
    for impl in ("eager", "kvarena"):
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config) if impl == "eager" else hf.KVArenaCache(
            model.config, block_size=4)
        steps = []
        for mode, cols in zip(modes, (slice(0, 11), slice(11, 17))):
            with mode():
                steps.append(model(ids[:, cols], attention_mask=mask[:, : cols.stop], past_key_values=cache).logits)
        logits[impl] = torch.cat(steps, 1)[mask.bool()]
    assert_close(logits["kvarena"], logits["eager"], torch.float32, f"{order}: logits")


@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # enters inference mode itself
def test_position_ids_changed_in_place_under_inference_mode_are_checked_again() -> None:
    """Issue 41 #1: an inference tensor has no version counter, so a memo keyed by it could
    not see it change in place: position_ids that restart after an in-place edit must still
    be refused (packed sequences transformers did not fold into the mask), and the same
    tensor restored must be served again."""
    model = _model("llama-gqa")
    model.set_attn_implementation("kvarena")
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        pos = torch.arange(7)[None]
        model.set_attn_implementation("eager")
        want = model(ids, position_ids=pos).logits
        model.set_attn_implementation("kvarena")
        first = model(ids, position_ids=pos).logits
        pos[0, 3:] = torch.arange(4)  # in place, inside inference mode: no version bump
        with pytest.raises(NotImplementedError, match=r"^kvarena: packed sequences \(position_ids that restart"):
            model(ids, position_ids=pos)
        pos[0, 3:] = torch.arange(3, 7)
        again = model(ids, position_ids=pos).logits
    for what, got in (("first", first), ("restored", again)):
        assert_close(got, want, torch.float32, f"{what}: logits")


# A bidirectional (encoder) padding mask: 11 columns, one row with no padding beside the
# padded ones (the bug reached it too), right padding, holes, left padding, padding only.
BIDIRECTIONAL_MASKS = {
    "right": [[1] * 11, [1] * 7 + [0] * 4, [1] * 2 + [0] * 9],
    "holes": [[1] * 11, [1] * 3 + [0] * 2 + [1] * 5 + [0], [0] * 2 + [1] * 4 + [0] * 3 + [1] * 2],
    "left": [[1] * 11, [0] * 4 + [1] * 7, [0] * 10 + [1]],
    "padding-only-row": [[1] * 11, [0] * 11, [1] * 6 + [0] * 5],
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", list(BIDIRECTIONAL_MASKS))
def test_bidirectional_padded_mask_sees_every_real_key(kind: str, dtype: str, seed: int) -> None:
    """Issue 41 #2: a bidirectional mask with right padding or a hole was attended causally
    (each query limited to the keys up to itself), even in rows without padding. Now every
    query of a row, padding queries too (eager's mask hides keys, not queries), sees every
    real key of its row and no padding key: the attention function against an fp64
    reference on the same inputs; a row of padding only gets zeros (it sees no key)."""
    from types import SimpleNamespace

    from transformers.masking_utils import bidirectional_mask_function

    dt = DTYPES[dtype]
    keep = torch.tensor(BIDIRECTIONAL_MASKS[kind])
    b, s = keep.shape
    h_q, h_kv, d = 6, 2, 24
    q = torch.randn(b, h_q, s, d).to(dt)
    k, v = torch.randn(b, h_kv, s, d).to(dt), torch.randn(b, h_kv, s, d).to(dt)
    mask = hf.kvarena_mask(b, s, s, mask_function=bidirectional_mask_function, attention_mask=keep)
    module = SimpleNamespace(is_causal=False, training=False, config=None)
    got, _ = hf.kvarena_attention(module, q, k, v, mask, scaling=d ** -0.5)
    kk = k.double().repeat_interleave(h_q // h_kv, 1)
    vv = v.double().repeat_interleave(h_q // h_kv, 1)
    scores = (q.double() @ kk.transpose(-1, -2)) * d ** -0.5
    scores = scores.masked_fill(~keep.bool()[:, None, None, :], float("-inf"))
    ref = (torch.softmax(scores, -1) @ vv).transpose(1, 2)  # [B, S, H, D]
    seen = keep.any(1)
    assert_close(got[seen], ref[seen], dt, f"{kind} {dtype}: rows that hold a real key")
    assert not got[~seen].any(), f"{kind} {dtype}: a row of padding only is not 0"


def _encoder():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2)
    return transformers.BertModel(cfg).eval()


@pytest.mark.parametrize("kind", [k for k in BIDIRECTIONAL_MASKS if k != "padding-only-row"])
def test_bidirectional_encoder_with_padding_equals_eager(kind: str) -> None:
    """Issue 41 #2, end to end: a BERT encoder on a padded batch (2.4-3.0e-2 off eager
    before, the row without padding included) equals eager on every token of every row."""
    model = _encoder()
    mask = torch.tensor(BIDIRECTIONAL_MASKS[kind])
    ids = torch.randint(1, 128, mask.shape, generator=torch.Generator().manual_seed(11))
    out = {}
    with torch.no_grad():
        for impl in ("eager", "kvarena"):
            model.set_attn_implementation(impl)
            out[impl] = model(ids, attention_mask=mask).last_hidden_state
    assert_close(out["kvarena"], out["eager"], torch.float32, f"BERT {kind}: hidden states")


def _seen(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [B, S]: the positions whose (window of) keys holds a real key (elsewhere eager
    averages a fully masked row, kvarena gives 0)."""
    c = mask.cumsum(1)
    w = window or mask.shape[1]
    return c - torch.nn.functional.pad(c, (w, 0))[:, : mask.shape[1]] > 0


def _steps_against_dynamic_cache(model, ids, mask, steps, beams=None, crop=None):
    """Teacher-forced steps on eager + DynamicCache and on kvarena + KVArenaCache: the first
    over ``ids`` / ``mask``, then one token per row per step (every row real). After the
    first step both caches take ``reorder_cache(beams)`` (the mask's rows with them) and
    ``crop(crop)`` (the mask's columns with it). Returns per impl the logits
    of each step and ``get_seq_length()`` at the end."""
    gen = torch.Generator().manual_seed(19)
    more = torch.randint(1, 128, (ids.shape[0], steps), generator=gen)
    out = {}
    for impl in ("eager", "kvarena"):
        model.set_attn_implementation(impl)
        # DynamicCache without a config: full layers, which crop at any length (the masks
        # still apply each layer's window)
        cache = transformers.DynamicCache() if impl == "eager" else hf.KVArenaCache(model.config, block_size=4)
        m = mask
        with torch.no_grad():
            logits = [model(ids, attention_mask=m, past_key_values=cache).logits]
            if beams is not None:
                cache.reorder_cache(beams)
                m = m[beams]
            if crop is not None:  # DynamicCache takes only the newer, negative form: crop(n) = crop(n - length)
                cache.crop(crop if impl == "kvarena" or crop <= 0 else crop - cache.get_seq_length())
                m = m[:, :crop]
            for t in range(steps):
                m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
                logits.append(model(more[:, t : t + 1], attention_mask=m, past_key_values=cache).logits)
        out[impl] = logits, cache.get_seq_length()
    return out


@pytest.mark.parametrize("beside", ["right-padded", "holes", "left-padded"])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_kvarena_cache_serves_a_row_of_padding_only(name: str, beside: str) -> None:
    """Issue 41 #3: a row of padding only next to a right-padded or holed row was a bare
    KeyError ('namespace 1 ...'; the row was never planned, so it is not in the pool). Now
    KVArenaCache serves the batch as DynamicCache does: the first step within fp32
    tolerance at every position that sees a key (the padding-only row sees none: finite),
    then rows reordered (beam search moves the empty row) and two more steps, every row
    and position within tolerance."""
    model = _model(name)
    rows = {"right-padded": [1] * 6 + [0] * 3, "holes": [1, 1, 0, 0, 1, 1, 1, 0, 1],
            "left-padded": [0] * 4 + [1] * 5}
    mask = torch.tensor([[1] * 9, [0] * 9, rows[beside]])
    ids = torch.randint(1, 128, mask.shape, generator=torch.Generator().manual_seed(23))
    beams = torch.tensor([1, 2, 1])  # the empty row twice, first
    got = _steps_against_dynamic_cache(model, ids, mask, 2, beams=beams)
    (want, want_len), (have, have_len) = got["eager"], got["kvarena"]
    assert have_len == want_len, f"get_seq_length {have_len} != DynamicCache's {want_len}"
    seen = _seen(mask, getattr(model.config, "sliding_window", None))
    assert have[0].isfinite().all(), "the first step's logits are not finite"
    assert_close(have[0][seen], want[0][seen], torch.float32, f"{name} {beside}: first step, positions with a key")
    for t in (1, 2):
        assert_close(have[t], want[t], torch.float32, f"{name} {beside}: step {t + 1} after the reorder")


CROP_MASK = [[1] * 7, [1] * 5 + [0] * 2, [1, 1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1], [0] * 7]


@pytest.mark.parametrize("rows", [4, 5], ids=["padded-rows", "and-a-padding-only-row"])
@pytest.mark.parametrize("n", [-2, -3, 4, 1], ids=lambda n: f"crop({n})")
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_kvarena_cache_crop_counts_positions(name: str, n: int, rows: int) -> None:
    """Issue 41 #4: crop(n) dropped stored tokens, not positions: after crop(-2) of a row
    [1,1,1,1,1,0,0] it dropped two real tokens (the padding holds none) and the next step
    differed from DynamicCache's. Now crop counts positions (the sequence axis, padding
    included) as DynamicCache does: rows with no, right, holed, left padding or padding
    only; the length and the two steps after the crop within fp32 tolerance."""
    model = _model(name)
    mask = torch.tensor(CROP_MASK[:rows])
    ids = torch.randint(1, 128, mask.shape, generator=torch.Generator().manual_seed(29))
    got = _steps_against_dynamic_cache(model, ids, mask, 2, crop=n)
    (want, want_len), (have, have_len) = got["eager"], got["kvarena"]
    assert have_len == want_len, f"crop({n}): get_seq_length {have_len} != DynamicCache's {want_len}"
    for t in (1, 2):
        assert_close(have[t], want[t], torch.float32, f"{name} crop({n}): step {t + 1} after the crop")


class _Stop(Exception):
    """What a test's hook raises between layers (an OOM, a failing hook)."""


# Where a forward stops, outside kvarena: (the module, a forward hook (after it) or a
# pre-hook (before it), the exception): after layer 0 attended, before layer 1 did.
STOPS = {
    "layer-0-mlp-error": ("layers.0.mlp", "after", _Stop),
    "layer-1-norm-ctrl-c": ("layers.1.input_layernorm", "before", KeyboardInterrupt),
}


def _stop_at(model, where: str):
    """Install STOPS[where] on ``model``; returns the hook's handle."""
    path, when, exc = STOPS[where]
    module = model.model.get_submodule(path)

    def stop(*args):
        raise exc(f"stopped at {path}")

    if when == "after":
        return module.register_forward_hook(stop)
    return module.register_forward_pre_hook(stop)


@pytest.mark.parametrize("first", [True, False], ids=["first-step", "after-a-step"])
@pytest.mark.parametrize("where", list(STOPS))
@pytest.mark.parametrize("name, pad", [("llama-gqa", None), ("mistral-window", "holes")],
                         ids=["llama-gqa", "mistral-window-holes"])
def test_a_step_stopped_between_layers_is_undone(name: str, pad: str | None, where: str, first: bool) -> None:
    """Issue 41 #5: an exception outside kvarena after layer 0 attended (the MLP, a hook, an
    OOM, Ctrl-C) left the cache advanced: the retried step attended slots never written
    (logits ~6.8 off), silent garbage. Now the step that did not reach its last layer is
    undone when the cache is next used: the length, bytes and rows read as before it, and
    the retry equals a cache that never saw it, and DynamicCache (fp32 tolerance, at the
    positions that see a key)."""
    model = _model(name)
    model.set_attn_implementation("kvarena")
    if pad is None:
        ids = torch.randint(1, 128, (3, 9), generator=torch.Generator().manual_seed(31))
        mask = torch.ones_like(ids)
    else:
        ids, mask = _pad_batch(pad)
        ids, mask = ids[:, :9], mask[:, :9]
    cols = slice(0, 9) if first else slice(5, 9)
    step = dict(input_ids=ids[:, cols], attention_mask=mask)
    cache, clean = hf.KVArenaCache(model.config, block_size=4), hf.KVArenaCache(model.config, block_size=4)
    with torch.no_grad():
        if not first:
            for c in (cache, clean):
                model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=c)
        before = _arena_state(cache)
        handle = _stop_at(model, where)
        try:
            with pytest.raises(STOPS[where][2], match="^stopped at"):
                model(**step, past_key_values=cache)
        finally:
            handle.remove()
        # the next use of the cache (here the length, which the next forward asks first) undoes it
        with pytest.warns(RuntimeWarning, match=r"^kvarena: the last step on this KVArenaCache stopped after 1 of "
                                                r"its 2 attention layers"):
            length = cache.get_seq_length()
        assert length == before[0], f"{where}: length {length} != {before[0]}"
        after = _arena_state(cache)
        assert after == before, f"{where}: the stopped step changed the cache: {before} -> {after}"
        assert cache.is_initialized == clean.is_initialized, f"{where}: the stopped first step left an arena"
        got = model(**step, past_key_values=cache).logits
        want = model(**step, past_key_values=clean).logits
        model.set_attn_implementation("eager")
        dyn = transformers.DynamicCache()
        if not first:
            model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=dyn)
        ref = model(**step, past_key_values=dyn).logits
    assert torch.equal(got, want), f"{where}: the retry differs from a clean cache by {(got - want).abs().max():.3e}"
    seen = _seen(mask, getattr(model.config, "sliding_window", None))[:, cols]
    assert_close(got[seen], ref[seen], torch.float32, f"{name} {where}: the retry against DynamicCache")


def test_a_layer_asking_the_length_mid_step_changes_nothing() -> None:
    """Issue 41 #5, the other side: a layer that asks for its length before its own
    attention (T5, Llama 4: get_seq_length(self.layer_idx)) is inside the step, not the
    next forward: nothing is undone, it reads what DynamicCache's layer reads (the length
    before the step), and generate equals a cache nobody asked."""
    model = _model("llama-gqa")
    ids, mask = _prompts(True)
    asked = {}

    def ask(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.2x renames it
        asked.setdefault(type(cache).__name__, []).append(cache.get_seq_length(module.layer_idx))

    handle = model.model.layers[1].self_attn.register_forward_pre_hook(ask, with_kwargs=True)
    try:
        got, got_logits = _generate(model, "kvarena", ids, mask, max_new_tokens=4,
                                    past_key_values=hf.KVArenaCache(model.config, block_size=4))
        _generate(model, "eager", ids, mask, max_new_tokens=4, past_key_values=transformers.DynamicCache())
    finally:
        handle.remove()
    want, want_logits = _generate(model, "kvarena", ids, mask, max_new_tokens=4,
                                  past_key_values=hf.KVArenaCache(model.config, block_size=4))
    assert asked["KVArenaCache"] == asked["DynamicCache"], f"the lengths layer 1 read: {asked}"
    assert torch.equal(got, want) and torch.equal(got_logits, want_logits), "asking the length changed the steps"


@pytest.mark.parametrize("beam_idx", [
    pytest.param([0, 3, 1], id="out-of-range"),
    pytest.param([-1, 0, 1], id="negative"),
    pytest.param([[0, 1, 2]], id="2-d"),
    pytest.param([0.0, 1.0, 2.0], id="float"),
    pytest.param("012", id="a-string"),
])
def test_reorder_cache_refuses_bad_indices_and_changes_nothing(beam_idx) -> None:
    """Issue 41 #5's sweep: reorder_cache took any index (a negative one silently picked a
    row from the end, an out-of-range one was an IndexError). Now it is a ValueError naming
    beam_idx and what it expects, the cache unchanged, and the next step runs."""
    model = _model("llama-gqa")
    model.set_attn_implementation("kvarena")
    ids = torch.randint(1, 128, (3, 6), generator=torch.Generator().manual_seed(37))
    cache = hf.KVArenaCache(model.config, block_size=4)
    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache)
        before = _arena_state(cache)
        arg = torch.tensor(beam_idx) if not isinstance(beam_idx, str) else beam_idx
        with pytest.raises(ValueError, match=r"^beam_idx: expected a 1-D integer tensor of row indices in \[0, 3\)"):
            cache.reorder_cache(arg)
        assert _arena_state(cache) == before, f"{before} -> {_arena_state(cache)}"
        model(ids[:, 5:], past_key_values=cache)
    assert cache.get_seq_length() == 6


@pytest.mark.parametrize("stopped", [False, True], ids=["after-a-step", "after-a-stopped-step"])
def test_a_dropped_kvarena_cache_is_freed(stopped: bool) -> None:
    """Issue 41 #5's sweep: the hand-off registry (update -> the attention function) held the
    cache strongly until another KVArenaCache's next step, so a cache the caller dropped, and
    its arena, stayed alive after generate returned (or after a step stopped between
    layers). Now it is freed with the caller's last reference."""
    import gc
    import weakref

    model = _model("llama-gqa")
    model.set_attn_implementation("kvarena")
    cache = hf.KVArenaCache(model.config, block_size=4)
    with torch.no_grad():
        model(torch.randint(1, 128, (2, 5)), past_key_values=cache)
        if stopped:
            handle = _stop_at(model, "layer-0-mlp-error")
            try:
                with pytest.raises(_Stop):
                    model(torch.randint(1, 128, (2, 3)), past_key_values=cache)
            finally:
                handle.remove()
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None, "a dropped KVArenaCache is still referenced"
