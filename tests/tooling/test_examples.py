"""The two example models as tests (small sizes), and ``kvarena demo``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _helpers import INTERPRETER, MODEL_TOL

from kvarena.examples.ar_decode import GEMMA3_LIKE, run_ar_decode
from kvarena.examples.causal_dit import run_causal_dit, run_training_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_causal_dit_rollout_matches_dense_sink_window(dtype):
    """Frame-granular sinks and window (2 and 5 frames; 2-frame chunks after a 1-frame
    first chunk) through the causal_wan adapter, against the dense token-masked model."""
    rep = run_causal_dit(num_chunks=7, rollouts=2, steps=3, sink_frames=2, window_frames=5, dtype=dtype, seed=3)
    assert rep.checked_passes == rep.passes == 7 * 4, "every pass must be checked when reuse is off"
    assert rep.max_err <= MODEL_TOL[dtype], f"max abs err vs dense sink+window recomputation: {rep.max_err:.3e}"
    assert rep.arena_ptr_stable, "the arena was reallocated during the rollout"
    assert rep.retained_bytes_moved == 0, f"{rep.retained_bytes_moved} bytes of retained KV moved"
    # chunks 4-6 start at token >= (2 + 5) frames: the window has left the sinks behind
    assert len(rep.arena_used_bytes_after_window) == 7 - 4 and len(set(rep.arena_used_bytes_after_window)) == 1, (
        f"memory not flat after the window filled: {rep.arena_used_bytes_after_window}"
    )
    # text K/V: computed once per distinct prompt (2 videos + the shared null prompt), then served
    assert rep.text_cache_misses == 3 and rep.text_cache_hits > 0


def test_causal_dit_residual_reuse_skips_layers_and_commit_stays_exact():
    rep = run_causal_dit(num_chunks=4, steps=4, residual_threshold=0.5, seed=5)
    assert rep.skipped_layer_evals > 0, "threshold 0.5 should let some denoising steps reuse residuals"
    # commit passes never skip, so they are always checked (plus the unskipped denoising steps)
    assert rep.checked_passes >= 4
    assert rep.max_err <= MODEL_TOL[torch.float32]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=INTERPRETER)])
def test_causal_dit_training_step_matches_dense_gradients(backend):
    """Self-Forcing-style step: history under no_grad, the next chunk's denoising step with
    gradients through the slab pool (commit=False); parameter gradients equal the dense
    sink+window run with the history's K/V detached (the window starts inside chunk 2)."""
    rep = run_training_step(history_chunks=4, sink_frames=2, window_frames=5, backend=backend, seed=4)
    assert rep.params_with_grad > 30, "the loss must reach the attention and FFN weights"
    assert abs(rep.loss - rep.dense_loss) <= 1e-5 * abs(rep.dense_loss)
    assert rep.max_grad_rel_err <= 1e-4, f"parameter gradients differ from dense: {rep.max_grad_rel_err:.2e}"


def test_ar_decode_matches_dense_and_forks():
    rep = run_ar_decode(prompt_lens=(5, 17, 30), new_tokens=5, prefill_chunk=8, block_size=16, seed=2)
    assert rep.max_logit_err <= MODEL_TOL[torch.float32], f"max logit err vs dense: {rep.max_logit_err:.3e}"
    assert rep.greedy_match
    fork, base = rep.outputs["r0.fork"], rep.outputs["r0"]
    assert fork[:5] == base[:5] and fork[5] != base[5], "the fork shares the prompt and diverges after it"
    assert all(len(rep.outputs[f"r{i}"]) == n + 5 for i, n in enumerate((5, 17, 30)))


@pytest.mark.parametrize("block_size", [3, 48], ids=["bs3", "bs48"])
def test_ar_decode_odd_block_sizes(block_size):
    rep = run_ar_decode(prompt_lens=(1, 17, 100), new_tokens=3, prefill_chunk=33, block_size=block_size,
                        num_blocks=200, seed=4)
    assert rep.max_logit_err <= MODEL_TOL[torch.float32] and rep.greedy_match


def test_gemma3_like_decode_holds_a_window_in_its_sliding_groups():
    """5 sliding (window 64) : 1 full layers, a group each: logits equal the dense per-layer
    masks; each sliding group holds at most a window + 1 block per sequence (3 sequences:
    the fork included) while the full group holds the history."""
    rep = run_ar_decode(config=GEMMA3_LIKE, prompt_lens=(100, 37), new_tokens=40, prefill_chunk=32, block_size=16,
                        num_blocks=40, seed=3)
    assert rep.max_logit_err <= MODEL_TOL[torch.float32] and rep.greedy_match, rep.max_logit_err
    assert rep.group_windows == (63,) * 5 + (None,)
    full = rep.group_blocks_peak[5]
    assert full >= -(-(100 + 40) // 16) + -(-(37 + 40) // 16)  # r0 and r1's whole histories
    for peak in rep.group_blocks_peak[:5]:
        assert peak <= 3 * (-(-64 // 16) + 1) < full
    assert rep.arena_used_bytes_peak < full * 6 * rep.block_bytes


def _run_cli(*args, env_extra=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "kvarena", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


_WORKLOADS = ("causal DiT rollout (slab KV)", "AR decode (paged KV)", "hybrid decode (layer groups)")


def test_demo_cli_prints_table():
    """One progress line per workload, named as in the table; redirected output (a pipe
    here) has no carriage returns; the table and its legend; a checked OK."""
    res = _run_cli("demo", "--chunks", "5", "--new-tokens", "4")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "\r" not in res.stdout, "progress bars must not redraw when stdout is not a terminal"
    lines = res.stdout.splitlines()
    for name in _WORKLOADS:
        progress = [ln for ln in lines if ln.strip().startswith(name) and "done:" in ln]
        assert len(progress) == 1, f"expected one progress line for {name!r}, got {progress}\n{res.stdout}"
    header = next((ln for ln in lines if ln.startswith("| workload")), "")
    assert all(name in header for name in _WORKLOADS), f"table header names differ from the progress: {header!r}"
    for needle in ("tokens processed", "arena reserved", "retained KV bytes moved", "max error vs dense",
                   "flat after window", "wall time", "legend:", "result: OK"):
        assert needle in res.stdout, f"{needle!r} missing from:\n{res.stdout}"
    moved = next(ln for ln in lines if ln.startswith("| retained KV bytes moved"))
    assert moved.split("|")[2].strip() == "0", f"the slab rollout moved retained KV: {moved!r}"


def test_ar_decode_dense_check_catches_a_wrong_step():
    """The dense check runs once per sequence after the run: a single wrong logit in any
    step's rows must still show as an error and a greedy mismatch."""
    from kvarena.examples import ar_decode

    torch.manual_seed(0)
    model = ar_decode.TinyDecoder(ar_decode.DecoderConfig()).eval()
    seq = torch.randint(0, 97, (9,)).tolist()
    with torch.no_grad():
        dense = model.forward_dense(torch.tensor(seq))
    rows = [(0, dense[0:5].clone()), (5, dense[5:8].clone())]
    rep = ar_decode.DecodeReport()
    ar_decode._check_against_dense(model, {"r0": seq}, {"r0": rows}, rep, "cpu")
    assert rep.max_logit_err <= 1e-5 and rep.greedy_match, rep
    rows[1][1][-1] = -rows[1][1][-1]  # the second step's last row: wrong logits, another argmax
    rep = ar_decode.DecodeReport()
    ar_decode._check_against_dense(model, {"r0": seq}, {"r0": rows}, rep, "cpu")
    assert rep.max_logit_err > 1e-2 and not rep.greedy_match, rep


@pytest.mark.slow
def test_demo_cli_triton_interpreter():
    res = _run_cli("demo", "--backend", "triton", "--chunks", "2", "--new-tokens", "2",
                   env_extra={"TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "result: OK" in res.stdout


def test_version_cli():
    from kvarena import __version__

    res = _run_cli("--version")
    assert res.returncode == 0 and __version__ in res.stdout


def test_example_summaries_are_short_and_readable():
    """The examples print a few lines, not a dataclass repr (no ``Report(`` and no line
    a terminal would wrap many times over)."""
    from kvarena.examples import ar_decode, causal_dit

    texts = {
        "causal_dit": causal_dit.summary(run_causal_dit(num_chunks=1, steps=1, check=False)),
        "ar_decode": ar_decode.summary(run_ar_decode(prompt_lens=(3, 4), new_tokens=2, check=False)),
    }
    for name, text in texts.items():
        lines = text.splitlines()
        assert "Report(" not in text and 3 <= len(lines) <= 10, f"{name}:\n{text}"
        assert max(map(len, lines)) <= 160, f"{name}: a {max(map(len, lines))}-character line:\n{text}"
