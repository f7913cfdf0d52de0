"""Issue 29 #3: the ``torch.compile``'d decode step with a static cache, on kvarena.

transformers' way: ``generate(cache_implementation="static", compile_config=...)`` builds
each step's masks eagerly (kvarena's mask hook, host reads allowed) and runs the model's
forward compiled. Here ``fullgraph=True``, so any graph break anywhere (kvarena's code or
transformers') is an error; a counting backend (``backend="eager"``-like: the captured
graph runs as is, fast on CPU) shows how many graphs the decode steps needed and that
kvarena's kernel (the ``kvarena::paged_attention`` custom op) is in them. Tokens and every
step's logits equal eager's uncompiled generate. Calling a compiled forward directly with
a 2-D padding mask is compile-clean too (the exact masked path: no host read of the mask).
"""

from __future__ import annotations

import pytest
import torch
from _helpers import grad_mode, one_torch_thread  # noqa: F401 - fixtures

transformers = pytest.importorskip("transformers", minversion="5.0")
from test_hf import TOL, _model, _pad_batch, _prompts  # noqa: E402

from kvarena.integrations import hf  # noqa: E402

# Every test runs as written and under torch.inference_mode() (the grad_mode fixture).
pytestmark = [pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
              pytest.mark.usefixtures("grad_mode")]
KERNEL = "kvarena.paged_attention"  # the custom op, as the captured graphs name it


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()
    yield


def _counting():
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def _ops(graphs) -> set[str]:
    return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}


def _generate(model, impl: str, ids, mask, compile_config=None):
    model.set_attn_implementation(impl)
    torch._dynamo.reset()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, eos_token_id=-1, pad_token_id=0,
                         cache_implementation="static", compile_config=compile_config, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


# (model, padding): graphs the 6 compiled decode steps take. One; gpt-oss's sliding layers
# are transformers' StaticSlidingWindowLayer, whose mask sizes are Python ints that change
# once the window is full (transformers/cache_utils.py, StaticSlidingWindowLayer.
# get_mask_sizes): one recompile, the same under eager attention (measured: 2 for both).
# Holes: the masked path over the slots (generate's prebuilt mask carries the real keys).
GRAPHS = {("llama-gqa", "left"): 1, ("gptoss-sinks", "left"): 2, ("llama-gqa", "holes"): 1}


@pytest.mark.parametrize(("name", "pad"), list(GRAPHS), ids=[f"{n}-{p}" for n, p in GRAPHS])
def test_compiled_static_decode_equals_eager_without_graph_breaks(name: str, pad: str) -> None:
    """A batch of 3 prompts (left-padded, or with holes), 7 tokens: the compiled steps
    (fullgraph) need the graphs listed in GRAPHS, run kvarena's kernel (left padding), and
    give eager's tokens and logits."""
    from transformers.generation import CompileConfig

    model = _model(name)
    ids, mask = _prompts(True) if pad == "left" else _pad_batch(pad)
    want_seq, want_logits = _generate(model, "eager", ids, mask)
    graphs, backend = _counting()
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # compile on CPU too (transformers' switch for tests)
    got_seq, got_logits = _generate(model, "kvarena", ids, mask, compile_config=config)
    assert len(graphs) == GRAPHS[name, pad], f"{name}: {len(graphs)} graphs for 6 decode steps"
    assert (KERNEL in _ops(graphs)) == (pad == "left"), f"{name} {pad}: {sorted(_ops(graphs))}"
    err = (got_logits - want_logits).abs().max().item()
    assert err <= TOL, f"{name}: compiled max logit error {err:.2e} > {TOL}"
    assert torch.equal(got_seq, want_seq), f"{name}: compiled greedy tokens differ from eager"


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padded-2d-mask"])
def test_compiled_forward_on_a_static_cache(padded: bool) -> None:
    """``torch.compile(model.forward, fullgraph=True)`` called directly for a decode step on
    a StaticCache: one graph, no break; without a padding mask kvarena's kernel runs,
    with a 2-D mask (which the hook cannot read without the host) the exact masked path does;
    logits equal eager's uncompiled step on the same cache contents."""
    model = _model("llama-gqa")
    ids, mask = _prompts(True)
    if not padded:
        ids, mask = ids[:, -5:], torch.ones_like(ids[:, -5:])
    nxt = torch.randint(1, 128, (3, 1), generator=torch.Generator().manual_seed(6))
    step_mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    pos = step_mask.sum(1, keepdim=True) - 1
    logits = {}
    for impl in ("eager", "kvarena"):
        model.set_attn_implementation(impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
        with torch.no_grad():
            model(ids, attention_mask=mask if padded else None, past_key_values=cache,
                  position_ids=(mask.cumsum(1) - 1).clamp(min=0))
            kw = dict(attention_mask=step_mask if padded else None, past_key_values=cache, position_ids=pos)
            if impl == "kvarena":
                torch._dynamo.reset()
                graphs, backend = _counting()
                logits[impl] = torch.compile(model.forward, backend=backend, fullgraph=True)(nxt, **kw).logits
            else:
                logits[impl] = model(nxt, **kw).logits
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    assert (KERNEL in _ops(graphs)) == (not padded), sorted(_ops(graphs))
    err = (logits["kvarena"] - logits["eager"]).abs().max().item()
    assert err <= TOL, f"padded={padded}: compiled max logit error {err:.2e} > {TOL}"
