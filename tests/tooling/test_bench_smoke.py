"""Smoke test of ``kvarena bench --quick``: it runs, writes its files, reports every
provider, and the recycling claim holds (0 retained KV bytes moved by the slab ring,
more than 0 by the shift-left window once it is full).

One subprocess run (~15-30 s on 2 CPU cores, most of it the recycle rollout and the
overhead loops) shared by the tests of this module. No timing is asserted.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvarena.benchmark.cases import BASELINE, BASELINES, NO_OUTPUT, cases, providers_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvarena", "bench", "--quick", "--device", "cpu", "--out", str(out),
         "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    results = None
    if (out / "results.json").exists():
        results = json.loads((out / "results.json").read_text())
    return proc, out, results


def test_exits_0_and_writes_files(quick_run):
    proc, out, results = quick_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert results is not None
    assert (out / "results.csv").stat().st_size > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert any("matplotlib" in n for n in results["notes"])
    else:
        assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kvarena" in proc.stdout and "shift_left" in proc.stdout  # the tables were printed


def test_metadata(quick_run):
    _, out, results = quick_run
    meta = results["meta"]
    for key in ("commit", "device", "torch", "triton", "python", "set"):
        assert key in meta
    assert meta["set"] == "quick" and meta["device"] == "cpu"
    ceil = results["ceilings"]
    assert ceil["copy_gbps"] > 0 and ceil["matmul_tflops"] > 0
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {"kernels", "recycle", "overhead", "ceilings"} <= {r["section"] for r in rows}
    assert all("meta_torch" in r for r in rows)


def test_every_provider_row_present_or_skipped_with_reason(quick_run):
    _, _, results = quick_run
    rows = {(r["case"], r["provider"]): r for r in results["kernels"]}
    for case in cases("quick"):
        for prov in providers_for(case):
            r = rows.get((case.name, prov))
            assert r is not None, f"missing row {case.name} / {prov}"
            if r["status"] == "ok":
                assert r["median_ms"] > 0 and r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
            else:
                assert r["status"] == "skipped" and r["reason"], f"{case.name} / {prov} skipped without a reason"
        # kvarena and the kind's primary baseline always run on CPU; every other provider
        # that ran agrees with each baseline that ran (bf16 inputs, fp32 accumulation) and
        # has a time ratio to each.
        assert rows[(case.name, "kvarena")]["status"] == "ok"
        base = rows[(case.name, BASELINE[case.kind])]
        assert base["status"] == "ok" and base["vs_baseline"] == pytest.approx(1.0)
        ran = [b for b in BASELINES[case.kind] if rows[(case.name, b)]["status"] == "ok"]
        for prov in providers_for(case):
            r = rows[(case.name, prov)]
            if r["status"] != "ok":
                continue
            if prov in BASELINES[case.kind]:  # a baseline has ratios to itself and those before it
                assert prov in r["vs"] and set(r["vs"]) <= set(ran), (case.name, prov, r["vs"])
            else:
                assert set(r["vs"]) == set(ran), (case.name, prov, r["vs"])
            if prov in NO_OUTPUT:
                continue
            compared = {b: e for b, e in r["err_vs"].items()}
            want = {b for b in ran if b not in NO_OUTPUT and b != prov}
            if prov not in BASELINES[case.kind]:
                assert set(compared) == want, (case.name, prov, compared)
            assert all(e is not None and e < 3e-2 for e in compared.values()), (case.name, prov, compared)


def test_jsonl_has_every_row_once(quick_run):
    """results.jsonl: the run's metadata, its ceilings and one line per kernel row, written
    as each row finished (what a killed GPU run keeps)."""
    _, out, results = quick_run
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert recs[0]["type"] == "meta" and recs[0]["data"]["set"] == "quick"
    kernel = [(r["data"]["case"], r["data"]["provider"]) for r in recs if r["type"] == "kernel"]
    assert kernel == [(r["case"], r["provider"]) for r in results["kernels"]]
    assert {"ceilings", "recycle", "overhead"} <= {r["type"] for r in recs}


def test_goal_rows_come_first_in_both_sets():
    for set_name in ("quick", "gpu"):
        goal = [c.goal for c in cases(set_name)]
        assert any(goal) and goal == sorted(goal, reverse=True), f"{set_name}: goal rows are not first: {goal}"


def test_recycle_moves_no_retained_kv(quick_run):
    _, _, results = quick_run
    rec = results["recycle"]
    assert rec.get("status") != "skipped", rec.get("reason")
    cfg = rec["config"]
    fill = cfg["sinks"] + cfg["window"]
    kv, sl = rec["kvarena"]["counts"], rec["shift_left"]["counts"]
    assert kv["chunks_counted"] > fill + 1
    # The claim: the ring writes the new chunk and nothing else, every chunk.
    assert all(c["retained"] == 0 and c["temp"] == 0 for c in kv["per_chunk"])
    assert all(c["new"] == rec["new_chunk_bytes"] for c in kv["per_chunk"])
    # The baseline: nothing moves while the window fills, then (window - 1) chunks of K
    # and V per layer are cloned and written back on every chunk.
    assert all(c["retained"] == 0 for c in sl["per_chunk"][:fill])
    steady = sl["per_chunk"][fill:]
    assert steady and all(c["retained"] > 0 for c in steady)
    assert all(c["retained"] == rec["expected_shift_retained_bytes_per_chunk"] for c in steady)
    assert all(c["new"] == rec["new_chunk_bytes"] for c in sl["per_chunk"])
    # Same attention output from both schemes, and flat memory for the ring.
    assert rec["sanity"]["same_output"], rec["sanity"]
    assert rec["kvarena"]["memory"]["peak_kv_bytes"] < rec["shift_left"]["memory"]["peak_kv_bytes"]


def test_recycle_with_token_sinks_moves_no_retained_kv(quick_run):
    """Self-Forcing's token rule (1-frame sink, 7-frame window, 3-frame chunks after a
    1-frame first one): the ring still moves nothing; the rolling buffer moves W - T tokens."""
    _, _, results = quick_run
    rec = results["recycle_tokens"]
    assert rec.get("status") != "skipped", rec.get("reason")
    cfg = rec["config"]
    assert cfg["sink_tokens"] % cfg["chunk"] and cfg["window_tokens"] % cfg["chunk"], "not whole chunks"
    kv, sl = rec["kvarena"]["counts"], rec["shift_left"]["counts"]
    fill = kv["window_full_from_chunk"]
    assert kv["chunks_counted"] > fill + 1
    assert all(c["retained"] == 0 and c["temp"] == 0 for c in kv["per_chunk"])
    assert all(c["new"] == rec["new_chunk_bytes"] for c in kv["per_chunk"][1:])
    steady = sl["per_chunk"][fill:]
    assert steady and all(c["retained"] == rec["expected_shift_retained_bytes_per_chunk"] for c in steady)
    assert all(c["retained"] == 0 for c in sl["per_chunk"][:fill])
    assert rec["sanity"]["same_output"], rec["sanity"]


def test_overhead_rows(quick_run):
    _, _, results = quick_run
    rows = results["overhead"]
    for batch in (1, 64, 256):
        ok = {r["what"] for r in rows if r["batch"] == batch and r["status"] == "ok"}
        for what in ("paged.plan (decode step)", "paged.forward (per layer)", "paged.forward, ops stubbed",
                     "paged_attention validated, impl stubbed", "attend trusted, impl stubbed",
                     "slab.plan (new chunk)", "slab.forward commit (per layer)", "slab.forward commit, ops stubbed"):
            assert what in ok, f"batch {batch}: no {what!r} row ({[r for r in rows if r['batch'] == batch]})"


def test_report_of_a_killed_run_keeps_every_finished_row(quick_run, tmp_path, capsys):
    """A run killed mid-write leaves a truncated last line: ``kvarena bench --report``
    still prints every finished row (and only those) as markdown."""
    from kvarena.cli import main

    _, out, results = quick_run
    lines = (out / "results.jsonl").read_text().splitlines()
    kernel_at = [i for i, line in enumerate(lines) if '"type": "kernel"' in line]
    cut = kernel_at[len(kernel_at) // 2]
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:cut]) + "\n" + lines[cut][: len(lines[cut]) // 2])
    assert main(["bench", "--report", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    finished = [json.loads(line)["data"] for line in lines[:cut] if '"type": "kernel"' in line]
    table = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    shown = [(cells[0].removeprefix("| ").removesuffix(" *"), cells[1]) for cells in table]
    assert len(shown) == len(finished) == len(kernel_at) // 2
    assert sorted(shown) == sorted((row["case"], row["provider"]) for row in finished)
    assert f"commit {results['meta']['commit']}" in text


def test_report_of_a_missing_run_is_a_usage_error(tmp_path, capsys):
    from kvarena.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--report", str(tmp_path)])
    assert exc.value.code == 2 and "--report" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["env", "stamp-file", "none"])
def test_commit_is_recorded_without_git(tmp_path, monkeypatch, source):
    """A tree copied without .git (a lent GPU machine) still names its commit: from
    KVARENA_COMMIT, else from bench/COMMIT (``bench/gpu.sh --stamp``), else None."""
    from kvarena.benchmark.report import commit_of

    (tmp_path / "bench").mkdir()
    monkeypatch.delenv("KVARENA_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above tmp_path
    if source == "env":
        monkeypatch.setenv("KVARENA_COMMIT", "abc123")
    elif source == "stamp-file":
        (tmp_path / "bench" / "COMMIT").write_text("def456 dirty\n")
    want = {"env": "abc123", "stamp-file": "def456 dirty", "none": None}[source]
    assert commit_of(tmp_path) == (want, None)


def test_commit_comes_from_git_in_a_checkout():
    from kvarena.benchmark.report import commit_of

    commit, dirty = commit_of(ROOT)
    if (ROOT / ".git").exists():
        assert commit is not None and len(commit) == 40 and dirty in (True, False)
