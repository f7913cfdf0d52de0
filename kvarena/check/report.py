"""What ``kvarena check`` prints and writes: the compile table, the workloads' launch plans
(``--perf``) and the CTAs-per-SM table of :mod:`kvarena.kernels.occupancy`."""

from __future__ import annotations

from kvarena.check.cases import WORKLOADS
from kvarena.check.compile import Row

#: The default table's width: wider configs wrap onto continuation lines (``--wide``: one line each).
TABLE_COLUMNS = 120


def _print_table(rows: list[Row], wide: bool = False) -> None:
    """One line per compile (plus continuation lines for a long config unless ``wide``).

    The default form fits :data:`TABLE_COLUMNS`: no kernel column (the config names its
    kind), short headers, the config wrapped, compile errors listed under the table.
    ``wide``: every column on one line, errors inline.
    """
    import textwrap

    perf = any(r.mma for r in rows)
    if wide:
        head = ("kernel", "config", "target", "regs", "spill st/ld", "shared KiB", "fits")
    else:
        head = ("config", "target", "regs", "spills", "smem KiB", "fits")
    if perf:
        head += ("CTAs/SM", "MMA", "K/V bufs", "loop SASS", "path SASS", "ref SASS", "ratio") if wide else \
            ("CTA/SM", "MMA", "K/V", "loop", "path", "ref", "ratio")

    def perf_cols(r: Row) -> tuple:
        if not r.mma:
            return ("",) * 7
        ratio = f"{r.path_sass / r.ref_loop_sass:.2f}" if r.path_sass > 0 and r.ref_loop_sass > 0 else "-"
        return (str(r.ctas_per_sm), r.mma, str(r.kv_buffers), str(r.loop_sass), str(r.path_sass),
                str(r.ref_loop_sass), ratio)

    def fits(r: Row) -> str:
        if r.fits:
            return "yes"
        return "NO: " + r.error if r.error and wide else "NO"

    body = [
        ((r.kernel,) if wide else ()) + (r.config, r.target, str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
                                         f"{r.shared_bytes / 1024:.1f}", fits(r))
        + (perf_cols(r) if perf else ())
        for r in rows
    ]
    _print_columns(head, body, 1 if wide else 0, wide)
    errors = [r for r in rows if not r.fits and r.error]
    if errors and not wide:
        print("compile errors:")
        for r in errors:
            print(textwrap.fill(f"{r.config} [{r.target}]: {r.error}", TABLE_COLUMNS, initial_indent="  ",
                                subsequent_indent="    "))


def _print_columns(head: tuple, body: list[tuple], cfg: int, wide: bool) -> None:
    """Columns left-aligned; unless ``wide``, column ``cfg`` (the config) is narrowed so the
    line fits :data:`TABLE_COLUMNS` and wraps onto continuation lines."""
    import textwrap

    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    if not wide:
        others = sum(w for i, w in enumerate(widths) if i != cfg) + 2 * (len(widths) - 1)
        widths[cfg] = max(len(head[cfg]), min(widths[cfg], TABLE_COLUMNS - others))
    for line in [head, tuple("-" * w for w in widths), *body]:
        parts = [line[cfg]]
        if len(line[cfg]) > widths[cfg]:  # only in the default form: --wide sized the column to fit
            parts = textwrap.wrap(line[cfg], widths[cfg], subsequent_indent="  ", break_on_hyphens=False)
        first = line[:cfg] + (parts[0],) + line[cfg + 1:]
        print("  ".join(x.ljust(w) for x, w in zip(first, widths)).rstrip())
        for more in parts[1:]:
            print(more.rstrip())


def _print_model(rows: list[Row], wide: bool = False) -> None:
    """The tile cycle model of every tensor-core main loop (docs/perf-model.md): SM cycles
    per iteration of the tensor cores, SFU, issue and shared memory, what runs beside the
    exp2s, the modelled tile time, its ratio to the tensor time and the predicted fraction
    of the dense tensor peak (the tile's own math over the tile time). ``wide`` adds the
    useful tensor cycles, the loop's MMA shapes, EX2s and barriers."""
    rows = [r for r in rows if r.tile_model]
    if not rows:
        return
    head = ("hot-loop tile model", "target", "TC", "SFU", "issue", "smem", "beside exp2", "tile", "/TC", "peak",
            "bound")
    if wide:
        head += ("useful TC", "MMAs per warp", "EX2", "ex2 under own MMA", "CTA/named bars", "wg arrive/wait")

    def cols(r: Row) -> tuple:
        m, c = r.tile_model, r.loop_counts
        out = (r.config, r.target, str(m["tc"]), str(m["sfu"]), str(m["issue"]), str(m["smem"]), m["overlap"],
               str(m["tile"]), f"{m['ratio']:.2f}", f"{100 * m['peak']:.0f}%", m["bound"])
        if wide:
            out += (str(m["useful"]), c["mma_shapes"], str(c["ex2"]), f"{c['ex2_under_mma']:.2f}",
                    f"{c['cta_barriers']}/{c['named_barriers']}", f"{c['wg_arrives']}/{c['wg_waits']}")
        return out

    _print_columns(head, [cols(r) for r in rows], 0, wide)


def _print_workloads(rows: list[dict]) -> None:
    head = ("workload", "target", "tile", "programs", "splits", "CTAs/SM", "waves", "wave eff.", "reduce grid",
            "reduce/SMs")
    body = [(r["workload"], r["target"], r["tile"], str(r["programs"]), str(r["splits"]), str(r["ctas_per_sm"]),
             f"{r['waves']:.2f}", f"{r['efficiency']:.3f}",
             "x".join(map(str, r["reduce_grid"])) if r["reduce_grid"] else "-",
             f"{r['reduce_waves']:.2f}" if r["reduce_grid"] else "-") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    for line in [head, tuple("-" * w for w in widths), *body]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip())


def _workload_rows(targets) -> list[dict]:
    """The launch plans of the contract's workloads (pure host math, no compile): the
    attention grid and, for a split launch, the reduce's grid and its programs per SM."""
    from kvarena.kernels.arch import arch_named
    from kvarena.kernels.attn_plan import plan_launch
    from kvarena.kernels.split_reduce import _reduce_tile

    rows = []
    for target in targets:
        arch = arch_named(target)
        sms = arch.sm_count
        for name, d, group, h_kv, b, q_len, k_len, block, causal, own in WORKLOADS:
            plan = plan_launch(head_dim=d, group=group, elem_bytes=2, num_seqs=b, num_kv_heads=h_kv,
                               max_seqlen_q=q_len, max_seqlen_k=k_len, block_size=block, causal=causal,
                               window_left=None, sink_tokens=0, softcap=False, num_splits=None,
                               deterministic=False, arch=arch, own_len=own)
            if own and not plan.own:
                name += " (NOT one launch)"
            ctas = plan.programs * plan.num_splits
            slots = sms * max(1, plan.ctas_per_sm)
            reduce = _reduce_tile(b * q_len * group * h_kv, d, plan.num_splits, sms) if plan.num_splits > 1 else None
            rows.append(dict(workload=name, target=target, tile=f"{plan.cfg['BLOCK_M']}x{plan.cfg['BLOCK_N']}",
                             programs=plan.programs, splits=plan.num_splits, ctas_per_sm=plan.ctas_per_sm,
                             waves=round(ctas / slots, 2), efficiency=round(plan.wave_efficiency(), 3),
                             reduce_grid=list(reduce.grid) if reduce else None,
                             reduce_waves=round(reduce.programs / sms, 2) if reduce else None))
    return rows


def _write_occupancy(rows: list[Row]) -> str:
    """Rewrite occupancy.CTAS_PER_SM from attention rows: the fewest CTAs per key."""
    from kvarena.kernels import occupancy

    table: dict[tuple, int] = {}
    for r in rows:
        if r.kernel == "attention" and r.occupancy_key and r.fits:
            key = tuple(r.occupancy_key)
            table[key] = min(table.get(key, r.ctas_per_sm), r.ctas_per_sm)
    path = occupancy.__file__
    with open(path) as f:
        text = f.read()
    head, sep, _ = text.partition("CTAS_PER_SM: dict[tuple, int] = {")
    if not sep:
        raise RuntimeError(f"{path}: no CTAS_PER_SM table to rewrite")
    body = "".join(f"    {k!r}: {v},\n" for k, v in sorted(table.items()))
    with open(path, "w") as f:
        f.write(head + sep + "\n" + body + "}\n")
    return path


def _markdown_tables(rows: list[Row], workloads: list[dict]) -> str:
    """One markdown table per target (registers, spills, shared memory, fits and, with
    ``--perf``, CTAs per SM, MMA kind and K/V buffers), then the workloads' waves."""
    from kvarena.kernels.arch import ARCHS

    perf = any(r.mma for r in rows)
    out = []
    for target in dict.fromkeys(r.target for r in rows):
        mine = [r for r in rows if r.target == target]
        arch = ARCHS[target]
        bad = sum(not r.fits for r in mine)
        out.append(f"### {target} ({arch.gpus}): {len(mine) - bad} of {len(mine)} fit\n")
        regs = "VGPRs" if arch.is_amd else "regs"
        head = ["config", regs, "spills st/ld", "smem KiB", "fits"] + (["CTAs/SM", "MMA", "K/V bufs"] if perf else [])
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in mine:
            cells = [r.config, str(r.registers), f"{r.spill_stores}/{r.spill_loads}", f"{r.shared_bytes / 1024:.1f}",
                     "yes" if r.fits else "**NO**"]
            if perf:
                cells += [str(r.ctas_per_sm), r.mma, str(r.kv_buffers)] if r.mma else ["", "", ""]
            out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        out.append("")
    if workloads:
        out.append("### Decode and chunk waves per target (`--perf`)\n")
        out.append("| workload | target | tile | programs | splits | CTAs/SM | waves | wave eff. |")
        out.append("|---|---|---|---|---|---|---|---|")
        for w in workloads:
            out.append(f"| {w['workload']} | {w['target']} | {w['tile']} | {w['programs']} | {w['splits']} | "
                       f"{w['ctas_per_sm']} | {w['waves']:.2f} | {w['efficiency']:.3f} |")
        out.append("")
    return "\n".join(out)
