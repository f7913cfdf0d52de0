"""``kvarena check --perf`` in the background for tests/test_check.py.

The check compiles every kernel configuration for sm_80 and sm_90a ahead of time, one
process per target: about two minutes of two busy cores, while the rest of the suite
runs on one core (pytest is single-threaded). Started as soon as the session has
collected a test that needs it (conftest's ``pytest_collection_finish``), it overlaps
the other tests instead of running alone; the fixture then only waits for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

_RUN: dict = {}
TIMEOUT_S = 900


def env_without_interpreter() -> dict:
    """The compile needs the real Triton compiler: no TRITON_INTERPRET (set on CPU test runs)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def start() -> None:
    """Start the check once (a no-op when it already runs)."""
    if _RUN:
        return
    d = tempfile.mkdtemp(prefix="kvarena-check-")
    out = {name: open(os.path.join(d, name), "w+") for name in ("stdout", "stderr")}  # noqa: SIM115 - closed in result()
    args = [sys.executable, "-m", "kvarena", "check", "--perf", "--json", os.path.join(d, "perf.json")]
    _RUN.update(args=args, dir=d, files=out,
                proc=subprocess.Popen(args, env=env_without_interpreter(), stdout=out["stdout"], stderr=out["stderr"]))


def result() -> tuple[subprocess.CompletedProcess, str]:
    """Wait for the check (starting it if nothing did) -> ``(completed process, JSON path)``."""
    start()
    proc = _RUN["proc"]
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    texts = []
    for f in _RUN["files"].values():
        f.seek(0)
        texts.append(f.read())
    return subprocess.CompletedProcess(_RUN["args"], proc.returncode, *texts), os.path.join(_RUN["dir"], "perf.json")


def stop() -> None:
    """Kill a check nobody waited for (a session that ended early)."""
    proc = _RUN.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
