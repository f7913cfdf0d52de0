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

from kvarena.benchmark.cases import BASELINE, cases, providers_for

ROOT = Path(__file__).resolve().parent.parent


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
        # kvarena and the kind's baseline always run on CPU; every other provider that
        # ran agrees with kvarena on the same data (bf16 inputs, fp32 accumulation).
        assert rows[(case.name, "kvarena")]["status"] == "ok"
        base = rows[(case.name, BASELINE[case.kind])]
        assert base["status"] == "ok" and base["vs_baseline"] == pytest.approx(1.0)
        for prov in providers_for(case)[1:]:
            r = rows[(case.name, prov)]
            if r["status"] == "ok":
                assert r["max_rel_err"] is not None and r["max_rel_err"] < 3e-2, (case.name, prov, r["max_rel_err"])


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
