"""kvarena inside vLLM: the backend's rules, and the real engine on CPU (the vLLM lane).

Two kinds of tests:

* The rules (:mod:`kvarena.integrations.vllm.support`, the plugin's checks): pure Python,
  they run everywhere.
* The engine: vLLM's v1 engine (``vllm-cpu``) serving tiny seeded-random checkpoints
  (``tests/integrations/vllm_lane/models.py``) once through vLLM's own CPU backend and once through
  kvarena's (``KVARENA_VLLM_CPU=1``), each engine in its own process
  (``tests/integrations/vllm_lane/engine.py``), and the runs compared (``tests/integrations/vllm_lane/compare.py``).
  They need a Python with vllm-cpu and kvarena installed: ``KVARENA_VLLM_PYTHON`` names it
  (``.ci/vllm-lane`` builds one in a fixed per-version location), or the running Python
  when it imports vllm; without one they skip, and with ``KVARENA_REQUIRE_VLLM=1`` (CI) a
  missing lane fails instead.

Tolerances (bf16 model and activations): a token's logprob ``lp`` within
``LOGPROB_TOL + LOGPROB_REL * |lp|`` of vLLM's own backend (a few bf16 rounding steps of
logits of that size), every prompt token's teacher-forced logprob too; greedy tokens equal
except where vLLM's own top-2 logprobs are within that bound (a near-tie bf16 rounding may
break either way; the request is compared up to there). fp8 KV runs are compared by their
teacher-forced distance to the bf16 run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvarena.integrations.vllm import plugin, support
from kvarena.integrations.vllm.support import Unsupported

sys.path.insert(0, str(Path(__file__).parent / "vllm_lane"))
from compare import distance, prompt_distance  # noqa: E402

LANE_DIR = Path(__file__).parent / "vllm_lane"
ROOT = Path(__file__).resolve().parents[2]
LOGPROB_TOL, LOGPROB_REL = 0.08, 0.01

# ---------------------------------------------------------------------------------------
# the rules, no vLLM needed

_LAYER = dict(head_size=64, num_heads=8, num_kv_heads=2, scale=0.125, alibi_slopes=None, sliding_window=None,
              kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder", model_dtype=torch.bfloat16, extra={})


@pytest.mark.parametrize("change, want", [
    ({}, dict(window_left=None, softcap=None, fp8=False)),
    ({"sliding_window": 4096}, dict(window_left=4095, softcap=None, fp8=False)),
    ({"sliding_window": 1}, dict(window_left=0, softcap=None, fp8=False)),
    ({"logits_soft_cap": 50.0}, dict(window_left=None, softcap=50.0, fp8=False)),
    ({"logits_soft_cap": 0}, dict(window_left=None, softcap=None, fp8=False)),
    ({"kv_cache_dtype": "fp8"}, dict(window_left=None, softcap=None, fp8=True)),
    ({"kv_cache_dtype": "fp8_e4m3", "model_dtype": torch.float16}, dict(window_left=None, softcap=None, fp8=True)),
    ({"kv_cache_dtype": "bfloat16"}, dict(window_left=None, softcap=None, fp8=False)),
    ({"extra": {"sinks": torch.zeros(8), "use_alibi_sqrt": False, "chunk_lookback": -1}},
     dict(window_left=None, softcap=None, fp8=False)),
], ids=["plain", "window", "window-1", "softcap", "softcap-0", "fp8", "fp8-fp16", "kv-bf16", "sinks"])
def test_layer_options_map_vllm_to_kvarena(change, want):
    opts = support.layer_options(**{**_LAYER, **change})
    got = dict(window_left=opts.window_left, softcap=opts.softcap, fp8=opts.fp8)
    assert got == want, f"{change}: got {got}, want {want}"
    assert opts.scale == 0.125


@pytest.mark.parametrize("change, needle", [
    ({"alibi_slopes": [0.5] * 8}, "ALiBi"),
    ({"attn_type": "encoder_only"}, "attention type"),
    ({"attn_type": "encoder_decoder"}, "attention type"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "'fp8_e5m2'"),
    ({"kv_cache_dtype": "fp8_per_token_head"}, "'fp8_per_token_head'"),
    ({"kv_cache_dtype": "int8_per_token_head"}, "'int8_per_token_head'"),
    ({"kv_cache_dtype": "float16"}, "'float16'"),
    ({"kv_cache_dtype": "fp8", "model_dtype": torch.float32}, "float32"),
    ({"model_dtype": torch.float64}, "torch.float64"),
    ({"head_size": 36}, "head_size 36"),
    ({"head_size": 264}, "head_size 264"),
    ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
    ({"sliding_window": 0}, "sliding_window 0"),
    ({"extra": {"use_alibi_sqrt": True}}, "use_alibi_sqrt"),
    ({"extra": {"chunk_lookback": 8}}, "chunk_lookback"),
    ({"extra": {"block_m": 64}}, "block_m"),
], ids=["alibi", "encoder-only", "cross", "e5m2", "fp8-per-token-head", "int8", "kv-fp16-model-bf16",
        "fp8-fp32-model", "fp64", "head-36", "head-264", "gqa-3", "window-0", "alibi-sqrt", "chunk-lookback",
        "flex-tiles"])
def test_layer_options_refuse_what_the_kernels_do_not_do(change, needle):
    with pytest.raises(Unsupported) as err:
        support.layer_options(**{**_LAYER, **change})
    msg = str(err.value)
    assert msg.startswith("kvarena:") and needle in msg, msg


def test_kv_head_sizes_and_scales_refused():
    with pytest.raises(Unsupported, match="different key and value head sizes"):
        support.check_head_size(64, 128)
    support.check_head_size(64, 64)
    support.check_kv_scale("k", torch.tensor(0.5))
    with pytest.raises(Unsupported, match="per-head or per-token KV scales"):
        support.check_kv_scale("k", torch.ones(4))
    assert [d for d in range(0, 300) if support.supports_head_size(d)] == list(range(8, 257, 8))


@pytest.mark.parametrize("value, want", [("1", True), ("0", False), ("", False), (None, False)])
def test_cpu_mode_reads_its_variable(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("KVARENA_VLLM_CPU", raising=False)
    else:
        monkeypatch.setenv("KVARENA_VLLM_CPU", value)
    assert plugin.cpu_mode() is want


def test_plugin_refuses_bad_settings_and_versions(monkeypatch):
    monkeypatch.setenv("KVARENA_VLLM_CPU", "yes")
    with pytest.raises(RuntimeError, match=r"^kvarena: .*KVARENA_VLLM_CPU: expected 0 or 1, got 'yes'"):
        plugin.register()
    for bad in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=rf"kvarena: vLLM {re.escape(bad)} is not supported"):
            plugin.check_vllm_version(bad)
    for good in ("0.32.0", "0.33.1rc1", "0.32.0+cpu"):
        plugin.check_vllm_version(good)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_plugin_without_vllm_fails_loudly(monkeypatch):
    monkeypatch.delenv("KVARENA_VLLM_CPU", raising=False)
    with pytest.raises(RuntimeError, match=r"^kvarena: the vLLM plugin failed to register .*ModuleNotFoundError"):
        plugin.register()


# ---------------------------------------------------------------------------------------
# the engine (the vLLM lane)

def _lane_python() -> str | None:
    if os.environ.get("KVARENA_VLLM_PYTHON"):
        return os.environ["KVARENA_VLLM_PYTHON"]
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


class Lane:
    """Engine runs of the lane, two at a time (the CI machine has two cores), each in its own process."""

    def __init__(self, python: str, workdir: Path):
        self.python, self.workdir = python, workdir
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.runs: dict[tuple, Future] = {}
        self.models = self._checkpoints()

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVARENA_VLLM_CPU")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return {**env, **extra}

    def _checkpoints(self) -> Path:
        out = self.workdir / "models"
        proc = subprocess.run([self.python, str(LANE_DIR / "models.py"), str(out), "llama", "mistral", "gemma2",
                               "gpt_oss"], env=self._env({}), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"writing the lane's checkpoints failed:\n{proc.stderr[-4000:]}"
        return out

    def _run(self, key: tuple, env: dict[str, str]) -> dict:
        family, backend, kv, workloads = key
        out = self.workdir / f"{family}-{backend}-{kv}-{workloads.replace(',', '+')}-{len(env)}.json"
        proc = subprocess.run([self.python, str(LANE_DIR / "engine.py"), str(self.models / family), backend, kv,
                               str(out), workloads], env=self._env(env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=900)
        result = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
        return {"returncode": proc.returncode, "log": proc.stdout, "result": result}  # vLLM logs to stdout

    def start(self, family: str, backend: str, kv: str = "auto", workloads: str = "all", **env: str) -> Future:
        key = (family, backend, kv, workloads if workloads != "all" else "mixed,prefix_warm,prefix,preempt")
        full = (*key, tuple(sorted(env.items())))
        if full not in self.runs:
            self.runs[full] = self.pool.submit(self._run, key, env)
        return self.runs[full]

    def result(self, *args, **kwargs) -> dict:
        run = self.start(*args, **kwargs).result()
        assert run["returncode"] == 0 and run["result"], (
            f"engine run {args} failed (exit {run['returncode']}):\n{run['log'][-6000:]}")
        return run


FULL = ("llama", "mistral")  # every workload: chunked prefill, prefix caching, preemption
MIXED_ONLY = ("gemma2", "gpt_oss")  # the family's attention feature on mixed prefill/decode steps


@pytest.fixture(scope="module")
def lane(tmp_path_factory):
    python = _lane_python()
    if python is None:
        if os.environ.get("KVARENA_REQUIRE_VLLM") == "1":
            pytest.fail("KVARENA_REQUIRE_VLLM=1 but no vLLM lane: set KVARENA_VLLM_PYTHON (see .ci/vllm-lane)")
        pytest.skip("no vLLM here: set KVARENA_VLLM_PYTHON to a Python with vllm-cpu and kvarena (.ci/vllm-lane)")
    lane = Lane(python, tmp_path_factory.mktemp("vllm_lane"))
    # queue every run now, in the order the tests read them, so the two workers never idle
    for fam in FULL:
        lane.start(fam, "native")
        lane.start(fam, "kvarena")
    for fam in MIXED_ONLY:
        lane.start(fam, "native", workloads="mixed")
        lane.start(fam, "kvarena", workloads="mixed")
    lane.start("llama", "native", "fp8", workloads="mixed")
    lane.start("llama", "kvarena", "fp8", workloads="mixed")
    lane.start("mistral", "no-window", workloads="mixed")
    lane.start("llama", "no-seq-lens", workloads="mixed")
    lane.start("llama", "kvarena", "fp8_e5m2", workloads="mixed")
    lane.start("llama", "kvarena", workloads="mixed", KVARENA_VLLM_CPU="2")
    yield lane
    lane.pool.shutdown(wait=False, cancel_futures=True)


def _check_close(ref: dict, got: dict, what: str) -> None:
    d = distance(ref, got, tol=LOGPROB_TOL, rel=LOGPROB_REL)
    p = prompt_distance(ref, got, tol=LOGPROB_TOL, rel=LOGPROB_REL)
    detail = f"{what}: {d.compared} generated tokens compared, max |dlogprob| {d.max_abs:.4f}; " \
             f"prompt logprobs max {p.max_abs:.4f} over {p.compared}"
    assert not d.mismatches, detail + "\n" + "\n".join(d.mismatches[:20])
    assert not p.mismatches, detail + "\n" + "\n".join(p.mismatches[:20])
    assert d.compared >= 0.5 * sum(len(r["tokens"]) for reqs in ref["workloads"].values() for r in reqs), (
        detail + ": most requests diverged at near-ties, which leaves too little compared")


@pytest.mark.slow
@pytest.mark.parametrize("family", [*FULL, *MIXED_ONLY])
def test_engine_matches_vllms_own_backend(lane, family):
    workloads = "all" if family in FULL else "mixed"
    native = lane.result(family, "native", workloads=workloads)["result"]
    ours = lane.result(family, "kvarena", workloads=workloads)["result"]
    assert native["attention_impls"] == ["CPUAttentionBackendImpl"], native["attention_impls"]
    assert ours["attention_impls"] == ["KVArenaAttentionImpl"], ours["attention_impls"]
    _check_close(native, ours, f"{family}: kvarena vs vLLM's CPU backend")


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL)
def test_engine_runs_exercised_the_scheduler(lane, family):
    """The full workloads really hit the prefix cache and really preempted (through kvarena)."""
    ours = lane.result(family, "kvarena")["result"]
    cached = [r["num_cached_tokens"] for r in ours["workloads"]["prefix"]]
    assert all(c >= 64 for c in cached), f"{family}: prefix requests cached {cached} tokens (want >= 2 blocks of 32)"
    assert ours["preemptions"] > 0, f"{family}: the KV budget forced no preemption"
    assert max(len(r["prompt_logprobs"]) for r in ours["workloads"]["mixed"]) > 64, "no prompt exceeds the budget"


@pytest.mark.slow
def test_engine_logs_the_backend_in_vllms_format(lane):
    log = lane.result("llama", "kvarena")["log"]
    line = re.search(r"INFO \d\d-\d\d [\d:]+ \[backend\.py:\d+\] Using KVArenaAttentionBackend \(kvarena .*", log)
    assert line, "no vLLM-format log line names KVArenaAttentionBackend:\n" + log[-3000:]


@pytest.mark.slow
def test_engine_fp8_kv_is_closer_to_bf16_than_vllms_cpu_fp8(lane):
    """kvarena stores fp8 rounding to nearest (vLLM's GPU rule); vLLM's CPU backend truncates.
    Teacher-forced over every prompt token, kvarena's fp8 run is no farther from the bf16 run."""
    bf16 = lane.result("llama", "native")["result"]
    ours = prompt_distance(bf16, lane.result("llama", "kvarena", "fp8", workloads="mixed")["result"])
    theirs = prompt_distance(bf16, lane.result("llama", "native", "fp8", workloads="mixed")["result"])
    assert ours.compared == theirs.compared > 200
    assert 0 < ours.mean_abs <= theirs.mean_abs, (
        f"mean |dlogprob| to bf16: kvarena fp8 {ours.mean_abs:.4f}, vLLM CPU fp8 {theirs.mean_abs:.4f}")
    assert ours.max_abs < 1.0, f"kvarena fp8: max |dlogprob| to bf16 {ours.max_abs:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("family, broken", [("mistral", "no-window"), ("llama", "no-seq-lens")])
def test_negative_controls_fail_the_comparison(lane, family, broken):
    native = lane.result(family, "native")["result"]
    bad = lane.result(family, broken, workloads="mixed")["result"]
    ref = {**native, "workloads": {"mixed": native["workloads"]["mixed"]}}
    with pytest.raises(AssertionError):
        _check_close(ref, bad, f"{family}: {broken}")


@pytest.mark.slow
@pytest.mark.parametrize("kv, env, needle", [
    ("fp8_e5m2", {}, "kvarena: kv_cache_dtype 'fp8_e5m2' is not served"),
    ("auto", {"KVARENA_VLLM_CPU": "2"}, "kvarena: the vLLM plugin failed to register KVArenaAttentionBackend: "
                                        "ValueError: KVARENA_VLLM_CPU: expected 0 or 1, got '2'"),
], ids=["refused-kv-dtype", "plugin-failure"])
def test_engine_start_fails_loudly(lane, kv, env, needle):
    run = lane.start("llama", "kvarena", kv, workloads="mixed", **env).result()
    assert run["returncode"] != 0 and run["result"] is None, "the engine started"
    assert needle in run["log"], run["log"][-4000:]
