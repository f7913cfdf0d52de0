"""``kvarena`` flags: a bad value ends as argparse ends it, and only a real run reports OK.

Everything runs in-process through ``kvarena.cli.main`` (the entry point external code
calls). A bad flag must raise ``SystemExit(2)`` with the usage and exactly one ``error:``
line naming the flag on stderr, no traceback, and before any work starts. The two
positive runs are the cheapest real ones (one DiT chunk and one AR token; one bench case
on two providers), a few seconds together on 2 CPU cores; the Triton backend is not run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvarena import __version__
from kvarena.cli import build_parser, main

# (argv, the flag the error must name). "{file}" is an existing regular file and "{dir}"
# an existing directory, both made by the test. Tests run as root, for whom a chmod-ed
# directory stays writable, so "{file}/sub" stands for an unwritable location.
BAD_FLAGS = [
    (["demo", "--chunks", "-1"], "--chunks"),
    (["demo", "--chunks", "0"], "--chunks"),
    (["demo", "--chunks", "two"], "--chunks"),
    (["demo", "--new-tokens", "-2"], "--new-tokens"),
    (["demo", "--new-tokens", "0"], "--new-tokens"),
    (["demo", "--device", "bogus"], "--device"),
    (["bench", "--device", "bogus"], "--device"),
    (["bench", "--device", "cuda:x"], "--device"),
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--threads", "-3"], "--threads"),
    (["bench", "--budget-s", "0"], "--budget-s"),
    (["bench", "--budget-s", "nan"], "--budget-s"),
    (["bench", "--out", "{file}"], "--out"),
    (["bench", "--out", "{file}/sub"], "--out"),
    (["bench", "--out", ""], "--out"),
    (["bench", "--sections", ""], "--sections"),
    (["bench", "--sections", "kernels,nope"], "--sections"),
    (["bench", "--providers", "nope"], "--providers"),
    (["bench", "--cases", ","], "--cases"),
    (["bench", "--device", "cpu", "--cases", "no-such-case"], "--cases"),
    (["bench", "--device", "cpu", "--quick", "--set", "gpu"], "--quick"),
    (["check", "--json", "{file}/sub/rows.json"], "--json"),
    (["check", "--json", "{file}/rows.json"], "--json"),
    (["check", "--json", "{dir}"], "--json"),
    (["check", "--json", "{dir}/missing/rows.json"], "--json"),
    (["check", "--only", ""], "--only"),
]


def _usage_error(capsys, argv: list[str]) -> str:
    """Run ``main(argv)``, assert it ended as an argparse error, return its one error line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2, f"exit {exc.value.code}\nstdout:\n{out}\nstderr:\n{err}"
    assert "Traceback" not in err and err.startswith("usage: kvarena"), err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert "OK" not in out and "result" not in out, out  # nothing ran, so nothing reports
    return errors[0]


@pytest.mark.parametrize("argv, flag", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_a_usage_error(capsys, tmp_path, argv, flag):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    argv = [a.format(file=afile, dir=tmp_path) for a in argv]
    line = _usage_error(capsys, argv)
    assert f"argument {flag}:" in line, line
    assert list(tmp_path.iterdir()) == [afile], "a rejected run created files"


@pytest.mark.parametrize("command", ["demo", "bench"])
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_cuda(capsys, monkeypatch, command, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _usage_error(capsys, [command, "--device", device])
    assert "argument --device:" in line and "CUDA is not available" in line, line


def test_bench_unusable_default_out_dir(capsys, monkeypatch, tmp_path):
    """Without --out the default directory is made before anything is measured; a file in
    its place is a usage error that names --out, not a traceback after the run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kvarena-bench").write_text("in the way")
    line = _usage_error(capsys, ["bench", "--device", "cpu", "--quick", "--cases", "store-tiny", "--no-progress"])
    assert "argument --out:" in line and "kvarena-bench" in line, line


def test_demo_triton_on_cpu_without_interpreter(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    line = _usage_error(capsys, ["demo", "--device", "cpu", "--backend", "triton"])
    assert "argument --backend:" in line and "TRITON_INTERPRET" in line, line


def test_parsed_values():
    parser = build_parser()
    args = parser.parse_args(["bench", "--sections", "recycle, overhead", "--threads", "2", "--budget-s", "1.5"])
    assert args.sections == ["recycle", "overhead"] and args.threads == 2 and args.budget_s == 1.5
    assert parser.parse_args(["bench"]).sections == ["kernels", "recycle", "overhead"]
    args = parser.parse_args(["demo", "--device", "cpu", "--chunks", "1", "--new-tokens", "3"])
    assert (args.device, args.chunks, args.new_tokens) == ("cpu", 1, 3)
    assert parser.parse_args(["demo"]).chunks is None  # only an absent flag means the default


def test_parsing_cpu_device_imports_no_torch():
    """--device is checked when parsed, not at import, and torch only for a CUDA value."""
    code = (
        "import sys\n"
        "from kvarena.cli import build_parser\n"
        "build_parser().parse_args(['demo', '--device', 'cpu', '--backend', 'triton'])\n"
        "build_parser().parse_args(['bench', '--device', 'cpu', '--providers', 'kvarena'])\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and __version__ in capsys.readouterr().out


def test_bench_sections_list(capsys):
    assert main(["bench", "--device", "cpu", "--sections", "recycle", "--list"]) == 0
    assert "store-tiny-w3" in capsys.readouterr().out


def test_demo_smallest_run_reports_ok(capsys):
    assert main(["demo", "--device", "cpu", "--backend", "torch", "--chunks", "1", "--new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 chunks x 4 streams" in out and "result: OK" in out, out


@pytest.fixture
def keep_torch_threads():
    # bench sets torch's intra-op thread count for the process; give the next tests theirs back.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_bench_smallest_run_creates_out_dir(capsys, tmp_path, keep_torch_threads):
    out_dir = tmp_path / "new" / "out"
    code = main(["bench", "--device", "cpu", "--quick", "--sections", "kernels", "--cases", "store-tiny",
                 "--providers", "kvarena,shift_left", "--threads", "1", "--budget-s", "120",
                 "--out", str(out_dir), "--no-progress"])
    assert code == 0, capsys.readouterr()
    rows = json.loads((out_dir / "results.json").read_text())["kernels"]
    assert {(r["provider"], r["status"]) for r in rows} == {("kvarena", "ok"), ("shift_left", "ok")}


def test_short_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["-V"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"kvarena {__version__}"


@pytest.mark.parametrize("argv", [[], ["demo"], ["check"], ["bench"]], ids=["top", "demo", "check", "bench"])
def test_help_is_plain_text_with_timed_examples(capsys, argv):
    """--help has no reStructuredText markup, and gives an example command with the time
    it takes: for each subcommand at the top level, and for the subcommand itself."""
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "``" not in out and ":class:" not in out, f"raw RST in the help:\n{out}"
    examples = out[out.index("examples:"):].splitlines()[1:] if "examples:" in out else []
    commands = [ln.split("#")[0].split()[1] for ln in examples if ln.startswith("  kvarena ") and "#" in ln]
    want = argv or ["demo", "check", "bench"]
    assert set(want) <= set(commands), f"examples for {want} expected, got {commands}:\n{out}"
    assert all(any(unit in ln for unit in (" s", "min")) for ln in examples if ln.startswith("  kvarena ")), out


def test_bench_progress_without_a_terminal_is_plain_lines(capsys):
    """Redirected stderr (capsys here) gets one plain line per run, no tqdm redraws."""
    from kvarena.benchmark.runner import progress

    bar = progress(2, "bench")
    for name in ("case-a", "case-b"):
        bar.set_postfix_str(name)
        bar.update()
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, repr(err)
    assert err.splitlines() == ["[bench 1/2] case-a", "[bench 2/2] case-b"], err
