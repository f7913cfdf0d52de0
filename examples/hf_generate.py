"""Generate with a Hugging Face decoder on kvarena's attention, next to eager attention.

Usage:
    python examples/hf_generate.py                    # a tiny random Llama, no download
    python examples/hf_generate.py --model PATH       # a real checkpoint (and its tokenizer)
    python examples/hf_generate.py --arena-cache      # K/V in a kvarena arena (KVArenaCache)

Needs ``pip install -e ".[hf]"``. Prints both generations, whether the tokens agree and
the largest logit difference per step.
"""

import argparse

import torch
import transformers

from kvarena.integrations import hf


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompts = torch.randint(1, 128, (2, 12))
    mask = torch.ones_like(prompts)
    mask[0, :4] = 0  # a shorter, left-padded first prompt
    return model, None, prompts, mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint path or hub id (default: a tiny random Llama)")
    p.add_argument("--prompt", action="append", default=None, help="prompt text (with --model; repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--arena-cache", action="store_true",
                   help="kvarena also holds the K/V (KVArenaCache) instead of transformers' cache")
    a = p.parse_args()
    hf.register()
    if a.model is None:
        model, tok, ids, mask = _tiny_llama()
    else:
        tok = transformers.AutoTokenizer.from_pretrained(a.model, padding_side="left")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype="auto").eval()
        batch = tok(a.prompt or ["The capital of France is", "def fib(n):"], return_tensors="pt", padding=True)
        ids, mask = batch["input_ids"], batch["attention_mask"]
    model.to(a.device)
    ids, mask = ids.to(a.device), mask.to(a.device)
    runs = {}
    for impl in ("eager", "kvarena"):
        model.set_attn_implementation(impl)
        extra = {"past_key_values": hf.KVArenaCache(model.config)} if impl == "kvarena" and a.arena_cache else {}
        out = model.generate(ids, attention_mask=mask, max_new_tokens=a.max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tok.pad_token_id if tok else 0, **extra)
        runs[impl] = out
        text = tok.batch_decode(out.sequences, skip_special_tokens=True) if tok else out.sequences.tolist()
        print(f"{impl}: {text}")
    same = torch.equal(runs["eager"].sequences, runs["kvarena"].sequences)
    diffs = [(x.float() - y.float()).abs().max().item() for x, y in zip(runs["eager"].logits, runs["kvarena"].logits)]
    print(f"same tokens: {same}; max logit difference per step: {max(diffs):.2e}")


if __name__ == "__main__":
    main()
