"""vLLM rows of bench/gpu.sh: kvarena's attention backend against vLLM's Triton backend.

The same model config (a Llama-style decoder: 16 layers, hidden 2048, 16 query / 4 KV heads
of 128, vocabulary 32000, weights from vLLM's ``load_format="dummy"``, which is fine for
speed), the same requests (64 prompts of 512 tokens, 128 greedy tokens each, EOS ignored),
one engine per backend, each in its own process, eager (kvarena declares no CUDA graph
support, so both run eager for a like-for-like attention comparison). A row: generated
tokens per second and milliseconds per engine step (the whole ``generate`` divided by its
128 decode steps, prefill included), and the ratio against vLLM's Triton backend of the same
run.

Where vllm is not importable (the device image today, the CPU dry run) the table says
"not installed" and the script exits 0.

    python bench/vllm_rows.py [OUT_DIR]            # prints a markdown table
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = ("TRITON_ATTN", "CUSTOM")  # vLLM's Triton backend (the baseline), kvarena's
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=2048,
              intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
              head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5, torch_dtype="bfloat16")
N_REQ, PROMPT, NEW = 64, 512, 128


def one(backend: str, model_dir: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              attention_backend=backend, max_model_len=PROMPT + NEW + 16, seed=0, gpu_memory_utilization=0.6)
    prompts = [{"prompt_token_ids": [(7 * r + t) % 31000 + 1 for t in range(PROMPT)]} for r in range(N_REQ)]
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"backend": backend, "tokens_per_s": tokens / wall, "ms_per_step": 1e3 * wall / NEW, "wall_s": wall}


def table(rows: list[dict], note: str = "") -> str:
    lines = ["## vLLM: kvarena's backend vs vLLM's Triton backend", "",
             f"Llama-style 16 layers, hidden 2048, 16/4 heads x 128, bf16; {N_REQ} requests x {PROMPT} prompt + "
             f"{NEW} generated tokens, eager. {note}".rstrip(), "",
             "| backend | tokens/s | ms/step | vs TRITON_ATTN |", "|---|---|---|---|"]
    base = next((r for r in rows if r.get("backend") == "TRITON_ATTN" and "tokens_per_s" in r), None)
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['backend']} | {r['status']} | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        lines.append(f"| {r['backend']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.2f} | {ratio} |")
    return "\n".join(lines)


def main(out_dir: str | None) -> int:
    if importlib.util.find_spec("vllm") is None:
        return _emit(table([{"backend": b, "status": "not installed"} for b in BACKENDS], "vllm is not installed here."),
                     out_dir)
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(CONFIG))
        for backend in BACKENDS:
            proc = subprocess.run([sys.executable, __file__, "--one", backend, model_dir], capture_output=True, text=True)
            if proc.returncode == 0:
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            else:
                rows.append({"backend": backend, "status": f"failed (exit {proc.returncode})"})
                sys.stderr.write(proc.stderr[-3000:])
    return _emit(table(rows), out_dir)


def _emit(text: str, out_dir: str | None) -> int:
    print(text)
    if out_dir:
        (Path(out_dir) / "vllm.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2], sys.argv[3])))
    else:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
