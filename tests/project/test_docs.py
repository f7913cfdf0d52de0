"""Documentation checks.

* Every module of the ``kvarena`` package whose source holds ``>>>`` runs its docstring
  examples through doctest (one case per module; ELLIPSIS and NORMALIZE_WHITESPACE).
  Modules without examples are not imported here, so the Triton kernel modules (which
  have none) are never loaded by this file.
* No text file of the repository points at a repo file that does not exist: no mention
  of the retired DESIGN.md anywhere (the contract lives under ``docs/``), every relative
  markdown link resolves, and every ``dir/.../name.py`` style path that starts at a
  top-level directory of the repository exists.

The file lists come from ``git ls-files --cached --others --exclude-standard``: the
tracked files plus the new files not ignored yet (what the next commit would carry),
minus files deleted in the working tree. Outside a git checkout those tests skip.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import io
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

import kvarena

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# Modules known to carry examples: the walk must find at least these (guards against a
# walk that silently collects nothing).
EXPECTED_WITH_EXAMPLES = {
    "kvarena.attention.ops",
    "kvarena.attention.spec",
    "kvarena.cache.arena",
    "kvarena.cache.feature",
    "kvarena.cache.handle",
    "kvarena.cache.keys",
    "kvarena.cache.paged",
    "kvarena.cache.residual",
    "kvarena.cache.slab",
    "kvarena.integrations.causal_wan",
}


# --------------------------------------------------------------------------- doctests
def _modules_with_examples() -> list[str]:
    """The package's modules whose source contains ``>>>`` (found without importing them)."""
    names = []
    for info in pkgutil.walk_packages(kvarena.__path__, "kvarena."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue  # importing it runs the command line
        spec = importlib.util.find_spec(info.name)
        origin = None if spec is None else spec.origin
        if origin and origin.endswith(".py") and ">>>" in Path(origin).read_text(encoding="utf-8"):
            names.append(info.name)
    return sorted(names)


MODULES_WITH_EXAMPLES = _modules_with_examples()


def test_doctest_modules_collected():
    missing = EXPECTED_WITH_EXAMPLES - set(MODULES_WITH_EXAMPLES)
    assert not missing, f"modules with examples not collected: {sorted(missing)}"


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_doctests(name):
    module = importlib.import_module(name)
    tests = sorted(
        (t for t in doctest.DocTestFinder().find(module) if t.examples), key=lambda t: t.name
    )
    assert tests, f"{name} contains '>>>' but doctest finds no example in its docstrings"
    torch.manual_seed(0)
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    report = io.StringIO()
    failed = attempted = 0
    for test in tests:
        result = runner.run(test, out=report.write)
        failed += result.failed
        attempted += result.attempted
    if failed:
        pytest.fail(
            f"{failed} of {attempted} doctest examples of {name} failed:\n{report.getvalue()}",
            pytrace=False,
        )


# --------------------------------------------------------------------------- references
CHECKED_SUFFIXES = (".py", ".md", ".sh", ".toml")
_MAX_TEXT_BYTES = 2 << 20


def _repo_files() -> list[str]:
    """Repo-relative paths of the tracked and new (not ignored) files that exist."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout (or git is missing): no file list to check")
    names = sorted({n for n in out.decode("utf-8", "surrogateescape").split("\0") if n})
    return [n for n in names if (ROOT / n).is_file()]


def _text(rel: str) -> str | None:
    """The file's text, or None for a binary / non-UTF-8 / very large file."""
    path = ROOT / rel
    if path.stat().st_size > _MAX_TEXT_BYTES:
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _is_checked(rel: str, text: str) -> bool:
    """``*.py, *.md, *.sh, *.toml``, plus extension-less shell scripts (``.ci/run``)."""
    if rel.endswith(CHECKED_SUFFIXES):
        return True
    first = text.split("\n", 1)[0]
    return "." not in Path(rel).name and first.startswith("#!") and "sh" in first


@pytest.fixture(scope="module")
def repo_texts() -> dict[str, str]:
    out = {}
    for rel in _repo_files():
        text = _text(rel)
        if text is not None:
            out[rel] = text
    assert out, "git lists no text file"
    return out


def _report(offenders: list[str], what: str) -> None:
    if offenders:
        pytest.fail(f"{len(offenders)} {what}:\n" + "\n".join(offenders), pytrace=False)


def test_no_design_md_mentions(repo_texts):
    """The contract moved into docs/; a mention of the old file is a dangling reference."""
    old = "DESIGN.md"
    offenders = [
        f"{rel}:{i}: {line.strip()}"
        for rel, text in repo_texts.items()
        if rel != THIS
        for i, line in enumerate(text.splitlines(), 1)
        if old in line
    ]
    _report(offenders, f"mention(s) of {old}, which no longer exists (the contract is in docs/)")


_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(
    r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _markdown_targets(text: str):
    """``(line number, target)`` of the inline links, images and link definitions outside code."""
    in_fence = None
    for i, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            if in_fence is None:
                in_fence = fence.group(1)
            elif fence.group(1) == in_fence:
                in_fence = None
            continue
        if in_fence is not None:
            continue
        line = _CODE_SPAN.sub("", line)
        for m in _INLINE_LINK.finditer(line):
            yield i, m.group(1)
        m = _REF_DEF.match(line)
        if m:
            yield i, m.group(1)


def _link_path(rel: str, target: str) -> Path | None:
    """The file a relative link target names, or None for URLs and same-page anchors."""
    target = target.strip("<>")
    if not target or target.startswith(("#", "//")) or _SCHEME.match(target):
        return None
    target = unquote(target.split("#", 1)[0].split("?", 1)[0])
    if not target:
        return None
    if target.startswith("/"):  # GitHub resolves a leading / at the repository root
        return ROOT / target.lstrip("/")
    return (ROOT / rel).parent / target


def test_markdown_links_resolve(repo_texts):
    offenders = []
    for rel, text in repo_texts.items():
        if not rel.endswith(".md"):
            continue
        for i, target in _markdown_targets(text):
            path = _link_path(rel, target)
            if path is not None and not path.exists():
                offenders.append(f"{rel}:{i}: link target {target!r} does not exist")
    _report(offenders, "markdown link(s) to missing files")


def test_repo_paths_exist(repo_texts):
    """``dir/.../name.ext`` paths starting at a top-level directory name an existing file."""
    top = {rel.split("/", 1)[0] for rel in repo_texts if "/" in rel} | {"docs"}
    prefixes = "|".join(sorted(re.escape(d) for d in top))
    pattern = re.compile(
        rf"(?<![\w./\-])((?:{prefixes})/[\w./\-]*?\w\.(?:py|md|sh|toml))(?![\w/\-]|\.\w)"
    )
    offenders = []
    for rel, text in repo_texts.items():
        if not _is_checked(rel, text):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            for m in pattern.finditer(line):
                ref = m.group(1)
                if not (ROOT / ref).exists() and not ((ROOT / rel).parent / ref).exists():
                    offenders.append(f"{rel}:{i}: {ref} does not exist")
    _report(offenders, "reference(s) to missing repo files")


# --------------------------------------------------------------------------- README blocks
_README = ROOT / "README.md"

# What the Hugging Face section says the reader brings (a checkpoint path, token ids and
# their mask): a tiny random Llama saved to a temporary directory, no download.
_HF_PRELUDE = '''
import tempfile
from transformers import AutoModelForCausalLM, LlamaConfig
path = tempfile.mkdtemp()
AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).save_pretrained(path)
input_ids = torch.tensor([[0, 5, 7, 9], [3, 1, 4, 1]])
mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
'''


def _readme_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", _README.read_text(), flags=re.S | re.M)


def test_readme_python_blocks_run_as_written(tmp_path):
    """Every ```python block of README.md, top to bottom in one fresh interpreter (later
    blocks use earlier blocks' names, as in a notebook), on the CPU; the Hugging Face block
    gets the checkpoint path and inputs its text says the reader brings. No warning about a
    deprecated argument may appear (transformers' generate keywords included)."""
    import socket

    blocks = _readme_python_blocks()
    assert len(blocks) >= 3, f"expected the HF, API-tour and context-parallel blocks, found {len(blocks)}"
    hf = importlib.util.find_spec("transformers") is not None
    diffusers = importlib.util.find_spec("diffusers") is not None
    cache_dit = importlib.util.find_spec("cache_dit") is not None
    parts = ["import warnings\nwarnings.simplefilter('always')\nimport torch\n"]
    skipped = 0
    for i, block in enumerate(blocks):
        if "from kvarena.integrations.diffusers import" in block and not diffusers:
            skipped += 1  # the [diffusers] extra is not installed here
            continue
        if "from kvarena.integrations.cache_dit import" in block and not cache_dit:
            skipped += 1  # the [cache-dit] extra is not installed here
            continue
        if "from kvarena.integrations import hf" in block:
            if not hf:
                skipped += 1  # the [hf] extra is not installed here: the other blocks still run
                continue
            parts.append(_HF_PRELUDE)
        parts.append(block)
        parts.append(f"\nprint('README block {i} ran', flush=True)\n")
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n".join(parts))
    with socket.socket() as s:  # the context-parallel block's group of one needs a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, f"a README block failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    ran = res.stdout.count("README block ")
    assert ran == len(blocks) - skipped, f"{ran} of {len(blocks)} blocks ran:\n{res.stdout}"
    deprecated = [ln for ln in res.stderr.splitlines() if "deprecat" in ln.lower()]
    assert not deprecated, "deprecation warnings from the README's code:\n" + "\n".join(deprecated)
