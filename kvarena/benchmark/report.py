"""Reports: run metadata, the terminal table, JSON + CSV, and a PNG plot.

Files written into the output directory:

``results.jsonl``
    One JSON object per line, appended as the run goes (``{"type": "meta" | "ceilings" |
    "kernel" | "recycle" | "recycle_tokens" | "overhead", "data": ...}``): a run killed
    from outside keeps every finished row. ``kvarena bench --report DIR`` prints its
    tables as markdown.
``results.json``
    ``meta`` (commit, device, versions, set, wall time), ``ceilings``, ``kernels`` (one
    row per case x provider), ``recycle``, ``overhead``, ``notes``.
``results.csv``
    Every row of every section in one table (a ``section`` column, the union of the
    columns, run metadata repeated on each row so a row stands alone).
``plot.png``
    Time and throughput against the keys each query reads (context length), one line per
    provider (and per batch / model), decode and chunk attention side by side. Skipped
    with a note when matplotlib is not installed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_metadata", "commit_of", "format_table", "format_recycle", "format_overhead", "write_json",
           "write_csv", "write_plot", "write_all", "JsonLines", "markdown_from_jsonl"]


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def commit_of(repo: Path) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout at ``repo``.

    From git where the tree has its ``.git``; else (a working tree copied without it, as
    onto a lent GPU machine) from ``KVARENA_COMMIT`` or the file ``bench/COMMIT`` written
    beside the tree before it was copied (``bench/gpu.sh --stamp``), dirty unknown (None).
    """
    commit = _git(["rev-parse", "HEAD"], repo)
    if commit is not None:
        status = _git(["status", "--porcelain", "--untracked-files=no"], repo)
        return commit, None if status is None else bool(status)
    stamp = repo / "bench" / "COMMIT"
    text = os.environ.get("KVARENA_COMMIT") or (stamp.read_text().strip() if stamp.is_file() else "")
    return (text or None), None


def run_metadata(device, set_name: str) -> dict[str, Any]:
    """Commit, device name, torch/triton/python versions, host, for the reports."""
    import torch

    import kvarena

    repo = Path(kvarena.__file__).resolve().parent.parent
    commit, dirty = commit_of(repo)
    meta: dict[str, Any] = {
        "kvarena": kvarena.__version__,
        "commit": commit,
        "dirty": dirty,
        "set": set_name,
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": None,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if str(device).startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        meta["device_name"] = props.name
        meta["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        meta["sm"] = f"{props.major}{props.minor}"
    return meta


def _fmt(x, spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _table(headers: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) if lines else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(ln, widths)).rstrip() for ln in lines]
    return "\n".join(out)


def _kernel_lines(rows: list[dict], baselines: tuple[str, ...]) -> tuple[list[str], list[list[str]]]:
    from kvarena.benchmark.cases import NO_OUTPUT

    compared = [b for b in baselines if b not in NO_OUTPUT]
    headers = ["case", "provider", "ms med [p20-p80]", "GB/s", "TFLOP/s", "%ceil"]
    headers += [f"vs {b}" for b in baselines] + [f"err vs {b}" for b in compared] + ["note / reason"]
    lines = []
    for r in rows:
        name = r["case"] + (" *" if r.get("goal") else "")
        if r["status"] == "ok":
            t = f"{r['median_ms']:.4g} [{r['p20_ms']:.3g}-{r['p80_ms']:.3g}]"
            frac = _fmt(100 * r["frac_ceiling"], ".1f") if r["frac_ceiling"] is not None else "-"
            vs = [f"{r['vs'][b]:.2f}x" if r.get("vs", {}).get(b) is not None else "-" for b in baselines]
            err = [_fmt(r.get("err_vs", {}).get(b), ".2e") for b in compared]
            lines.append([name, r["provider"], t, _fmt(r["gbps"]), _fmt(r["tflops"]), frac, *vs, *err, r["note"]])
        else:
            lines.append([name, r["provider"], "skipped", "", "", "", *[""] * (len(baselines) + len(compared)),
                          r["reason"]])
    return headers, lines


def _by_kind(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    kinds = []
    for r in rows:
        if r["kind"] not in kinds:
            kinds.append(r["kind"])
    return [(k, [r for r in rows if r["kind"] == k]) for k in kinds]


def _ceiling_note(ceilings: dict) -> str:
    return (f"ceilings (this run): copy {ceilings['copy_gbps']:.1f} GB/s (read+write of "
            f"{_fmt_bytes(ceilings['copy_bytes'])}), matmul {ceilings['matmul_tflops']:.3g} TFLOP/s "
            f"({ceilings.get('matmul_dtype', 'bfloat16')} {ceilings['matmul_n']}^3). %ceil: decode GB/s / copy, "
            "chunk and train TFLOP/s / matmul, store GB/s / copy. vs X: X's time / the row's time (same run); "
            "err vs X: max |out - X's out| / max |X's out|. * marks a goal row.")


def format_table(rows: list[dict], ceilings: dict | None = None) -> str:
    """The kernel rows as fixed-width tables, one per kind, with a ratio and an error
    column per same-run baseline of the kind (skipped rows show their reason)."""
    from kvarena.benchmark.cases import BASELINES

    parts = []
    for kind, kr in _by_kind(rows):
        headers, lines = _kernel_lines(kr, BASELINES[kind])
        parts.append(f"{kind}:\n" + _table(headers, lines))
    text = "\n\n".join(parts)
    if ceilings:
        text += "\n" + _ceiling_note(ceilings)
    return text


def _md(headers: list[str], lines: list[list[str]]) -> str:
    def cell(x: str) -> str:
        return x.replace("|", "\\|")

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in ln) + " |" for ln in lines]
    return "\n".join(out)


class JsonLines:
    """``results.jsonl``: one ``{"type", "data"}`` object per line, flushed as written.
    Opening truncates the file (a new run)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.write_text("")

    def write(self, kind: str, data) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"type": kind, "data": _clean(data)}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict]:
    """The records of a ``results.jsonl``; a truncated last line (a kill mid-write) is dropped."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def markdown_from_jsonl(path: Path) -> str:
    """Markdown tables of a run's ``results.jsonl``: run metadata, the kernel rows per
    kind (goal rows marked), and the recycle / overhead summaries that finished."""
    from kvarena.benchmark.cases import BASELINES

    recs = read_jsonl(path)
    meta = next((r["data"] for r in recs if r["type"] == "meta"), {})
    ceil = next((r["data"] for r in recs if r["type"] == "ceilings"), None)
    rows = [r["data"] for r in recs if r["type"] == "kernel"]
    keys = ("commit", "dirty", "device_name", "device", "sm", "device_memory_gib", "torch", "cuda", "triton",
            "python", "set", "backend")
    out = ["run: " + ", ".join(f"{k} {meta.get(k)}" for k in keys if k in meta)]
    if ceil:
        out.append(_ceiling_note(ceil))
    for kind, kr in _by_kind(rows):
        headers, lines = _kernel_lines(kr, BASELINES[kind])
        out.append(f"\n{kind} ({sum(r['status'] == 'ok' for r in kr)} of {len(kr)} rows ran)\n\n" + _md(headers, lines))
    for r in recs:
        if r["type"] in ("recycle", "recycle_tokens"):
            out.append("\n```\n" + format_recycle(r["data"]) + "\n```")
        elif r["type"] == "overhead":
            out.append("\n```\n" + format_overhead(r["data"]["rows"]) + "\n```")
    if not rows:
        out.append("\nno kernel row finished")
    return "\n".join(out)


def format_recycle(rec: dict | None) -> str:
    """A few lines summarizing the recycle comparison."""
    if not rec:
        return "recycle: not run"
    if rec.get("status") == "skipped":
        return f"recycle: skipped ({rec.get('reason')})"
    cfg = rec["config"]
    if cfg.get("sink_tokens") is not None:
        vis = (f"sink {cfg['sink_tokens']} + window {cfg['window_tokens']} tokens, first chunk "
               f"{cfg['first_chunk'] or cfg['chunk']} tokens")
    else:
        vis = f"window {cfg['window']}, sinks {cfg['sinks']}"
    head = (f"recycle: {cfg['chunks']} chunks x {cfg['layers']} layers, chunk {cfg['chunk']} tokens, "
            f"{cfg['h_q']}q/{cfg['h_kv']}kv heads d{cfg['head_dim']} {cfg['dtype']}, {vis}, "
            f"batch {cfg['batch']} on {rec['device']}; bytes per chunk once the window is full "
            f"(all layers, K+V; new chunk = {_fmt_bytes(rec['new_chunk_bytes'])})")
    lines = []
    for name in ("kvarena", "shift_left"):
        s = rec[name]
        c = s["counts"]

        def mean(key, c=c):
            return c[key]["mean"] if c.get(key) else None

        lines.append([
            name, _fmt_bytes(mean("new_bytes_per_chunk")), _fmt_bytes(mean("retained_bytes_per_chunk")),
            _fmt_bytes(mean("temp_bytes_per_chunk")), _fmt_bytes(s["memory"]["peak_kv_bytes"]),
            _fmt(s["time"]["per_chunk_ms_median"], ".3g"), _fmt(s["time"]["total_s"], ".3g"),
            _fmt_bytes(s["memory"].get("cuda_peak_allocated_bytes")),
        ])
    body = _table(["scheme", "new KV written", "retained KV moved", "KV temp copies", "peak KV mem",
                   "ms/chunk (med)", "total s", "cuda peak"], lines)
    san = rec["sanity"]
    tail = (f"same attention output: {san['same_output']} (max rel err {san['max_rel_err']:.2e}, tol "
            f"{san['tolerance']:.0e}); expected shift retained bytes/chunk "
            f"{_fmt_bytes(rec['expected_shift_retained_bytes_per_chunk'])}")
    return "\n".join([head, body, tail])


def format_overhead(rows: list[dict] | None) -> str:
    """The host-overhead rows as a table."""
    if not rows:
        return "overhead: not run"
    lines = []
    for r in rows:
        if r.get("status") == "ok":
            spread = f"[{_fmt(r['us_p20'], '.1f')}-{_fmt(r['us_p80'], '.1f')}]" if r["us_p20"] is not None else ""
            lines.append([r["what"], str(r["batch"]), _fmt(r["us_median"], ".1f"), spread,
                          _fmt(r["us_min"], ".1f"), r.get("note", "")])
        else:
            lines.append([r["what"], str(r.get("batch", "")), "skipped", "", "", r.get("reason", "")])
    dev = rows[0].get("device", "")
    return (f"host overhead on {dev} (us per call; CPU rows include the PyTorch path's arithmetic)\n"
            + _table(["call", "batch", "us med", "[p20-p80]", "us min", "note"], lines))


def _clean(obj):
    """JSON-safe: NaN/inf become None, dict keys become strings."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: Path, results: dict) -> Path:
    """``results`` as indented JSON."""
    path.write_text(json.dumps(_clean(results), indent=1, sort_keys=False) + "\n")
    return path


def _flat_recycle(rec: dict, section: str = "recycle") -> list[dict]:
    if not rec or rec.get("status") == "skipped":
        return []
    rows = []
    for name in ("kvarena", "shift_left"):
        s = rec[name]
        c = s["counts"]
        row = {"section": section, "provider": name, **{f"cfg_{k}": v for k, v in rec["config"].items()}}
        for key in ("new_bytes_per_chunk", "retained_bytes_per_chunk", "temp_bytes_per_chunk"):
            row[key] = c[key]["mean"] if c.get(key) else None
        row.update({f"mem_{k}": v for k, v in s["memory"].items()})
        row.update({f"time_{k}": v for k, v in s["time"].items()})
        row["same_output"] = rec["sanity"]["same_output"]
        row["max_rel_err"] = rec["sanity"]["max_rel_err"]
        rows.append(row)
    return rows


def _flat_kernel(row: dict) -> dict:
    """A kernel row with its per-baseline dicts as ``vs_<baseline>`` / ``err_vs_<baseline>`` columns."""
    flat = {k: v for k, v in row.items() if k not in ("vs", "err_vs")}
    flat.update({f"vs_{b}": x for b, x in row.get("vs", {}).items()})
    flat.update({f"err_vs_{b}": x for b, x in row.get("err_vs", {}).items()})
    return flat


def write_csv(path: Path, results: dict) -> Path:
    """All sections in one CSV (a ``section`` column; metadata on every row)."""
    meta = {f"meta_{k}": v for k, v in results.get("meta", {}).items()}
    rows = [{"section": "kernels", **_flat_kernel(r)} for r in results.get("kernels", [])]
    rows += _flat_recycle(results.get("recycle"))
    rows += _flat_recycle(results.get("recycle_tokens"), "recycle_tokens")
    rows += [{"section": "overhead", **r} for r in results.get("overhead") or []]
    rows += [{"section": "ceilings", **(results.get("ceilings") or {})}]
    rows = [{**r, **meta} for r in rows]
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in _clean(r).items()})
    return path


def _variant_label(r: dict, kind: str) -> str:
    """The shape family and variant of a kernel row: one plotted line per (provider, label)."""
    sub = f"b{r['batch']}" if kind == "decode" else r["model"]
    variant = [r.get("step") or "", "fp8" if r.get("kv_dtype") else "", "rope" if r.get("rope") else "",
               f"pool{r['layers']}" if r.get("layers") else "",
               f"p{r['page']}" if kind != "decode" and r["page"] != r["chunk"] else ""]
    return " ".join([sub, *[v for v in variant if v]])


def _recycle_panel(ax_bytes, ax_ms, rec: dict) -> None:
    """Bytes written/moved per chunk and ms per chunk: kvarena's ring vs the shift-left cache."""
    names = [n for n in ("kvarena", "shift_left") if n in rec]
    keys = (("new_bytes_per_chunk", "new KV written"), ("retained_bytes_per_chunk", "retained KV moved"),
            ("temp_bytes_per_chunk", "KV temp copies"))
    width = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        vals = [((rec[n]["counts"].get(key) or {}).get("mean") or 0) / 2**20 for n in names]
        ax_bytes.bar([x + i * width for x in range(len(names))], vals, width, label=label)
    ax_bytes.set_xticks([x + width for x in range(len(names))], names)
    ax_bytes.set_ylabel("MiB per chunk (all layers, K+V)")
    ax_bytes.set_title("recycle: bytes per chunk once the window is full")
    ax_bytes.legend(fontsize=8)
    ms = [rec[n]["time"]["per_chunk_ms_median"] or 0 for n in names]
    bars = ax_ms.bar(names, ms, color=["tab:blue", "tab:gray"][:len(names)])
    ax_ms.bar_label(bars, fmt="%.3g ms", fontsize=8)
    ax_ms.set_ylabel("ms per chunk (median)")
    ax_ms.set_title("recycle: time per chunk vs the shift-left baseline")


def _overhead_panel(ax, rows: list[dict]) -> None:
    ok = [r for r in rows if r.get("status") == "ok" and r.get("us_median") is not None]
    labels = [f"{r['what']} (b{r.get('batch', '')})" for r in ok]
    bars = ax.barh(labels, [r["us_median"] for r in ok], color="tab:green")
    ax.bar_label(bars, fmt="%.1f us", fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("us per call (median, host; log scale)")
    ax.set_title("host overhead per call")


def write_plot(path: Path, results: dict) -> tuple[Path | None, str]:
    """Time and throughput vs keys read, one line per (provider, shape, variant); then the
    recycle comparison and the host-overhead rows. Returns ``(path or None, note)``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "plot skipped: matplotlib is not installed (pip install matplotlib)"
    rows = [r for r in results.get("kernels", []) if r["status"] == "ok"]
    kinds = [k for k in ("decode", "chunk", "train") if any(r["kind"] == k for r in rows)]
    rec = results.get("recycle") if (results.get("recycle") or {}).get("status") != "skipped" else None
    rec = rec if rec and "kvarena" in rec else None
    overhead = [r for r in results.get("overhead") or [] if r.get("status") == "ok"]
    extra = bool(rec) + bool(overhead)
    if not kinds and not extra:
        return None, "plot skipped: no kernel, recycle or overhead rows ran"
    n_rows = 2 * len(kinds) + extra
    fig = plt.figure(figsize=(16, 4.2 * n_rows + (0.12 * len(overhead) if overhead else 0)))
    grid = fig.add_gridspec(n_rows, 3, width_ratios=[1, 1, 1.1],
                            height_ratios=[1] * (n_rows - bool(overhead)) + ([max(1, len(overhead) / 12)] if overhead else []))
    meta = results.get("meta", {})
    ceil = results.get("ceilings") or {}
    styles = ["-", "--", "-.", ":"]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    for j, kind in enumerate(kinds):
        kr = [r for r in rows if r["kind"] == kind]
        groups: dict[tuple, list[dict]] = {}
        for r in kr:  # variants (step, page, fp8, RoPE, a pool arena) are lines of their own
            groups.setdefault((r["provider"], _variant_label(r, kind)), []).append(r)
        metric, label = ("gbps", "KV GB/s") if kind == "decode" else ("tflops", "TFLOP/s")
        ax_t = fig.add_subplot(grid[2 * j, :2])
        ax_m = fig.add_subplot(grid[2 * j + 1, :2])
        providers = sorted({p for p, _ in groups})
        colors = {p: plt.cm.tab10(i % 10) for i, p in enumerate(providers)}
        variants = sorted({v for _, v in groups})
        for (prov, sub), rs in sorted(groups.items()):
            rs.sort(key=lambda r: r["kv_tokens"])
            xs = [r["kv_tokens"] for r in rs]
            vi = variants.index(sub)
            kw = dict(color=colors[prov], ls=styles[vi % len(styles)], marker=markers[vi % len(markers)],
                      lw=2.0 if prov == "kvarena" else 1.2, ms=5, label=f"{prov} | {sub}")
            ax_t.plot(xs, [r["median_ms"] for r in rs], **kw)
            ax_m.plot(xs, [r[metric] for r in rs], **kw)
        cval = ceil.get("copy_gbps") if kind == "decode" else ceil.get("matmul_tflops")
        if cval:
            what = "device copy" if kind == "decode" else "dense matmul"
            ax_m.axhline(cval, color="k", lw=1.0, ls=":")
            ax_m.annotate(f"ceiling: {what} this run, {cval:.3g} {label}", xy=(0.01, cval),
                          xycoords=("axes fraction", "data"), xytext=(0, 4), textcoords="offset points",
                          fontsize=8)
        ax_t.set_title(f"{kind}: time vs keys read")
        ax_t.set_ylabel("ms (median)")
        ax_m.set_title(f"{kind}: {label} vs keys read")
        ax_m.set_ylabel(label)
        for ax in (ax_t, ax_m):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("keys per query (context / sinks+window tokens)")
            ax.grid(True, which="both", alpha=0.3)
        # One legend per kind, outside the data (the third column of the grid).
        handles, labels = ax_t.get_legend_handles_labels()
        ax_leg = fig.add_subplot(grid[2 * j:2 * j + 2, 2])
        ax_leg.axis("off")
        ax_leg.legend(handles, labels, loc="upper left", fontsize=8, title=f"{kind}: provider | shape variant",
                      title_fontsize=9, frameon=False, ncol=1 if len(labels) <= 26 else 2)
    if rec:
        row = 2 * len(kinds)
        _recycle_panel(fig.add_subplot(grid[row, 0]), fig.add_subplot(grid[row, 1]), rec)
    if overhead:
        _overhead_panel(fig.add_subplot(grid[n_rows - 1, :]), overhead)
    fig.suptitle(f"kvarena bench ({meta.get('set')}) on {meta.get('device_name')} "
                 f"[{meta.get('device')}], commit {str(meta.get('commit'))[:10]}")
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, ""


def write_all(out_dir: str | os.PathLike, results: dict) -> dict[str, str | None]:
    """Write JSON, CSV and PNG into ``out_dir``; returns their paths (PNG may be None)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, note = write_plot(out / "plot.png", results)
    if note:
        results.setdefault("notes", []).append(note)
    paths = {"json": str(write_json(out / "results.json", results)),
             "csv": str(write_csv(out / "results.csv", results)),
             "png": str(png) if png else None}
    return paths
