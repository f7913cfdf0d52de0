"""``kvarena check``: ahead-of-time compiles for sm_80/sm_90a with no spills and shared memory in bounds.

The compile needs the real Triton compiler, so it runs in a subprocess whose environment
has no TRITON_INTERPRET (this test session sets it on CPU machines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvarena import check


def _env_without_interpreter() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.mark.slow
def test_check_compiles_every_config_without_spills(tmp_path):
    out_json = tmp_path / "rows.json"
    res = subprocess.run(
        [sys.executable, "-m", "kvarena", "check", "--json", str(out_json)],
        env=_env_without_interpreter(), capture_output=True, text=True, timeout=900,
    )
    assert out_json.exists(), res.stdout[-4000:] + res.stderr[-4000:]
    rows = json.loads(out_json.read_text())
    n_cases = len(check.ATTENTION_CASES) + len(check.REDUCE_CASES) + len(check.STORE_CASES) + len(check.MERGE_CASES)
    assert len(rows) == 2 * n_cases, f"expected one row per config and target, got {len(rows)}"
    assert {r["target"] for r in rows} == {"sm_80", "sm_90a"}
    assert {r["kernel"] for r in rows} == {"attention", "split_reduce", "store_kv", "merge"}
    problems = [
        f"{r['kernel']} [{r['config']}] {r['target']}: regs {r['registers']}, spills "
        f"{r['spill_stores']}/{r['spill_loads']} B, shared {r['shared_bytes']} B {r['error']}"
        for r in rows
        if r["error"] or r["spill_stores"] or r["spill_loads"] or r["registers"] <= 0
        or r["shared_bytes"] > check.SHARED_LIMIT[80 if r["target"] == "sm_80" else 90]
    ]
    assert not problems, "\n".join(problems)
    assert all(r["fits"] for r in rows)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    # One printed table row per kernel/config/target.
    table_rows = [line for line in res.stdout.splitlines() if " sm_80 " in line or " sm_90a " in line]
    assert len(table_rows) == len(rows)


def test_check_refuses_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "kvarena", "check"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2
    assert "TRITON_INTERPRET" in res.stderr


def test_check_module_imports_neither_torch_nor_triton():
    code = (
        "import argparse, sys, kvarena.check\n"
        "kvarena.check.add_arguments(argparse.ArgumentParser())\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, "
        "[m for m in ('torch', 'triton') if m in sys.modules]\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
def test_check_all_variants_of_one_config(tmp_path):
    """``--all-variants`` adds every causal/kv_start/lse combination of an attention config."""
    out_json = tmp_path / "rows.json"
    res = subprocess.run(
        [sys.executable, "-m", "kvarena", "check", "--only", "decode 32q/8kv split", "--all-variants",
         "--target", "90", "--json", str(out_json)],
        env=_env_without_interpreter(), capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = json.loads(out_json.read_text())
    assert len(rows) == 4 and len({r["config"] for r in rows}) == 4  # a split always writes lse
    assert all(r["fits"] and r["target"] == "sm_90a" for r in rows)
