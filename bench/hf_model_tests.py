"""transformers' own model test files, run under the default attention and under kvarena.

Evidence script for the Hugging Face integration (not part of the suite: pytest does not
collect it, CI does not run it). Three steps::

    # 1. a test tree: transformers' tests/ at a commit (a git dir), the top-level
    #    tests/*.py of the installed release's sdist laid over it (optional)
    python bench/hf_model_tests.py prepare --git-dir G --ref main \\
        --sdist transformers-5.24.0.tar.gz --dest /tmp/hf_tests
    # 2. each backend, each family (one pytest process per file, one at a time)
    python bench/hf_model_tests.py run /tmp/hf_tests/tests --backend default --out bench/out/hf
    python bench/hf_model_tests.py run /tmp/hf_tests/tests --backend kvarena --out bench/out/hf
    # 3. the table: counts per family, and the tests that pass by default and fail
    #    under kvarena, grouped by their error's first line
    python bench/hf_model_tests.py compare bench/out/hf

``--backend kvarena`` loads the pytest plugin ``bench/_hf_force_kvarena.py``, which makes
every model built resolve ``"sdpa"`` / no request to ``attn_implementation="kvarena"``
(``"eager"``, the tests' reference, stays eager); ``--cache kvarena`` also makes
``generate`` build a ``KVArenaCache`` where it would build a ``DynamicCache``. The
selection is the CPU-runnable one: ``-m "not slow"`` and ``-k`` deselecting flash,
compile, multi-GPU, integration, torch.export, FSDP and tensor-parallel tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss")
DESELECT = ("flash", "compile", "multi_gpu", "integration", "torch_export", "fsdp", "tensor_parallel")
HERE = Path(__file__).resolve().parent
PLUGIN = "_hf_force_kvarena"

# The multi-process mixins: their tests are outside the selection, and their modules import
# helpers that differ between releases, so the prepared tree gets empty classes instead.
_STUB_MIXINS = {"test_fsdp_mixin.py": "FSDPTesterMixin",
                "test_tensor_parallel_mixin.py": "TensorParallelTesterMixin"}
# Top-level sdist files that stay the git tree's (they import distributed helpers).
_SDIST_SKIP = ("test_expert_parallel_mixin.py", *_STUB_MIXINS)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One test's result: ``passed`` / ``failed`` / ``skipped``, and its error's first line."""

    test: str
    status: str
    message: str = ""


@dataclasses.dataclass(frozen=True)
class FileRun:
    """One family's file under one backend."""

    family: str
    backend: str
    seconds: float
    returncode: int
    outcomes: tuple[Outcome, ...]

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)


def prepare(git_dir: str, ref: str, sdist: str | None, dest: str) -> None:
    """Lay out ``dest``: ``tests/`` and ``conftest.py`` from ``git_dir`` at ``ref``, the
    sdist's top-level ``tests/*.py`` over them, stubs for the multi-process mixins, and
    ``src/transformers`` linked to the installed package (some test modules import it by
    path)."""
    import transformers

    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", ref, "tests", "conftest.py"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    if sdist:
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") \
                        and parts[2] not in _SDIST_SKIP:
                    data = tar.extractfile(member).read()
                    (out / "tests" / parts[2]).write_bytes(data)
    for name, cls in _STUB_MIXINS.items():
        (out / "tests" / name).write_text(
            f'"""Stub: the multi-process {cls} tests are outside the CPU selection."""\n\n\n'
            f"class {cls}:\n    pass\n")
    link = out / "src" / "transformers"
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(transformers.__file__).parent)


def _test_file(tests_dir: Path, family: str) -> Path:
    return tests_dir / "models" / family / f"test_modeling_{family}.py"


def _first_line(node: ET.Element) -> str:
    text = (node.get("message") or node.text or "").strip()
    return text.splitlines()[0][:300] if text else ""


def parse_junit(path: Path) -> tuple[Outcome, ...]:
    """Per-test outcomes from a junit XML file (errors count as failures)."""
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            outcomes.append(Outcome(name, "failed", _first_line(bad)))
        elif skip is not None:
            outcomes.append(Outcome(name, "skipped", _first_line(skip)))
        else:
            outcomes.append(Outcome(name, "passed"))
    return tuple(outcomes)


def run_family(tests_dir: Path, family: str, backend: str, cache: str, out: Path,
               timeout: float) -> FileRun:
    """One pytest process over one family's file; its junit XML and log land in ``out``."""
    label = _label(backend, cache)
    xml = out / f"{label}_{family}.xml"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    env.pop("KVARENA_HF_FORCE", None)
    if backend == "kvarena":
        env["KVARENA_HF_FORCE"] = "1"
        env["KVARENA_HF_CACHE"] = cache
    cmd = [sys.executable, "-m", "pytest", str(_test_file(tests_dir, family)), "-q", "-rA",
           "-p", "no:cacheprovider", "-p", PLUGIN, "-m", "not slow",
           "-k", " and ".join(f"not {word}" for word in DESELECT), f"--junitxml={xml}"]
    start = time.monotonic()
    with open(out / f"{label}_{family}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=tests_dir.parent, env=env, stdout=log,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    seconds = time.monotonic() - start
    outcomes = parse_junit(xml) if xml.exists() else ()
    return FileRun(family, label, round(seconds, 1), rc, outcomes)


def _label(backend: str, cache: str) -> str:
    """The run's name in file names and tables: ``default``, ``kvarena``, ``kvarena-cache``."""
    return "kvarena-cache" if backend == "kvarena" and cache == "kvarena" else backend


def _save(run: FileRun, out: Path) -> None:
    (out / f"{run.backend}_{run.family}.json").write_text(json.dumps(dataclasses.asdict(run), indent=1))


def _load(path: Path) -> FileRun:
    data = json.loads(path.read_text())
    data["outcomes"] = tuple(Outcome(**o) for o in data["outcomes"])
    return FileRun(**data)


def _regressions(base: FileRun, other: FileRun) -> list[Outcome]:
    passed = {o.test for o in base.outcomes if o.status == "passed"}
    return [o for o in other.outcomes if o.test in passed and o.status != "passed"]


def compare(out: Path, against: str = "kvarena") -> str:
    """The markdown table and the regression groups of every family run both by default and
    as ``against`` (``kvarena`` or ``kvarena-cache``)."""
    rows = [f"| family | default pass/fail/skip (s) | {against} pass/fail/skip (s) | "
            f"pass by default, fail under {against} |", "|---|---|---|---|"]
    groups: dict[str, list[str]] = defaultdict(list)
    changes: list[str] = []
    for family in FAMILIES:
        base_path, kv_path = out / f"default_{family}.json", out / f"{against}_{family}.json"
        if not (base_path.exists() and kv_path.exists()):
            continue
        base, kv = _load(base_path), _load(kv_path)
        lost = _regressions(base, kv)
        changes += _changes(family, base, kv)
        for o in lost:
            groups[o.message or o.status].append(f"{family}: {o.test}")
        cells = [f"{r.count('passed')}/{r.count('failed')}/{r.count('skipped')} ({r.seconds:.0f})"
                 for r in (base, kv)]
        rows.append(f"| {family} | {cells[0]} | {cells[1]} | {len(lost)} |")
    lines = rows + ["", f"Pass by default, fail under {against}, grouped by the error's first line:", ""]
    for message, tests in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- ({len(tests)}) `{message}`")
        lines.extend(f"  - {t}" for t in sorted(tests))
    lines += ["", f"Other status changes (tests that skip or fail by default, default -> {against}):", ""]
    lines.extend(f"- {c}" for c in changes or ["none"])
    return "\n".join(lines) + "\n"


def _changes(family: str, base: FileRun, other: FileRun) -> list[str]:
    """Status changes other than pass -> not pass (those are the regressions)."""
    was = {o.test: o.status for o in base.outcomes}
    return [f"{family}: {o.test}: {was[o.test]} -> {o.status}" + (f" (`{o.message}`)" if o.message else "")
            for o in other.outcomes
            if o.test in was and was[o.test] != o.status and was[o.test] != "passed"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="lay out a transformers test tree")
    p.add_argument("--git-dir", required=True)
    p.add_argument("--ref", default="HEAD")
    p.add_argument("--sdist", help="the installed release's sdist (its tests/*.py win)")
    p.add_argument("--dest", required=True)
    r = sub.add_parser("run", help="run the families' test files under one backend")
    r.add_argument("tests_dir", type=Path, help="transformers' tests/ directory")
    r.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    r.add_argument("--backend", choices=("default", "kvarena"), required=True)
    r.add_argument("--cache", choices=("dynamic", "kvarena"), default="dynamic",
                   help="kvarena backend: the cache generate builds by itself")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds per file")
    c = sub.add_parser("compare", help="the table of the runs in a folder")
    c.add_argument("out", type=Path)
    c.add_argument("--against", choices=("kvarena", "kvarena-cache"), default="kvarena")
    c.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.git_dir, args.ref, args.sdist, args.dest)
        return 0
    if args.command == "compare":
        table = compare(args.out, args.against)
        print(table)
        if args.markdown:
            args.markdown.write_text(table)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for family in args.families:
        run = run_family(args.tests_dir.resolve(), family, args.backend, args.cache, args.out, args.timeout)
        _save(run, args.out)
        print(f"{family} {run.backend}: {run.count('passed')} passed, {run.count('failed')} failed, "
              f"{run.count('skipped')} skipped in {run.seconds:.0f}s (rc {run.returncode})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
