"""The HTML report: one self-contained page (inline CSS and SVG, no scripts, nothing fetched)."""

from __future__ import annotations

import datetime
from html import escape
from typing import Any

from kvweave.report import data, panel, svg
from kvweave.report.data import Run
from kvweave.report.serving import serving_section

CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px 32px; color: #222;
       background: #fff; max-width: 1340px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 14px; margin: 16px 0 6px; }
p.note { color: #555; font-size: 13px; margin: 4px 0 10px; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; align-items: flex-start; }
.charts svg { border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 6px 8px; font-size: 12px; white-space: pre-wrap; word-break: break-all; }
table { border-collapse: collapse; font-size: 12px; margin: 6px 0 14px; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: right; }
th { background: #f3f3f3; }
td.name, th.name { text-align: left; }
table.guide td.pick { text-align: left; vertical-align: top; max-width: 330px; }
table.guide td.ok { background: #eaf6ec; }
table.guide td.loss { background: #fbecea; }
table.guide td.none { color: #777; }
table.guide code { overflow-wrap: anywhere; }
"""


def _series_name(model: str, name: str, several_models: bool) -> str:
    return f"{model} \u00b7 {name}" if several_models else name


def series_colors(rows: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """A colour per (model, method), the same in every chart; a family's first method lends it its colour."""
    keys = [
        (model, method)
        for model in data.models(rows)
        for method in data.methods([r for r in rows if str(r.get("model")) == model])
    ]
    colors = {key: svg.PALETTE[i % len(svg.PALETTE)] for i, key in enumerate(keys)}
    for model, method in keys:
        colors.setdefault((model, data.family(method)), colors[(model, method)])
    return colors


def heatmap_section(rows: list[dict[str, Any]]) -> str:
    """NIAH heatmaps: for each task with needle depths, one depth x context grid per (model, method)."""
    parts = []
    for task in data.tasks(rows):
        task_rows = [r for r in rows if r["task"] == task and r.get("depth") is not None]
        if not task_rows:
            continue
        several = len(data.models(task_rows)) > 1  # a model prefix only where the task has several
        charts = []
        for model in data.models(task_rows):
            for method in data.methods(task_rows):
                members = [r for r in task_rows if r["method"] == method and str(r.get("model")) == model]
                if not members:
                    continue
                depths, contexts, grid = data.heatmap_grid(members)
                charts.append(
                    svg.heatmap(
                        [f"{100 * d:.0f}%" for d in depths],
                        [svg.format_number(c) for c in contexts],
                        grid,
                        title=_series_name(model, method, several),
                    )
                )
        parts.append(f'<h3>{escape(task)}</h3>\n<div class="charts">{"".join(charts)}</div>')
    if not parts:
        return ""
    return (
        '<section id="heatmaps"><h2>Needle retrieval: depth \u00d7 context length</h2>'
        '<p class="note">Mean score (%) per needle depth and context length; one grid per method.</p>'
        + "\n".join(parts)
        + "</section>"
    )


def frontier_section(rows: list[dict[str, Any]]) -> str:
    """Accuracy vs compression, one chart per task, one series per method family."""
    colors = series_colors(rows)
    charts = []
    for task in data.tasks(rows):
        series = []
        several = len(data.models(r for r in rows if r["task"] == task)) > 1  # a model prefix only if needed
        for model in data.models(rows):
            members = [r for r in rows if r["task"] == task and str(r.get("model")) == model]
            for name, points in sorted(
                data.frontier(members).items(), key=lambda kv: data.method_order(kv[0])
            ):
                series.append(
                    svg.Series(
                        _series_name(model, name, several),
                        [(p.compression, p.accuracy) for p in points],
                        [data.options_label(p.method) for p in points],
                        color=colors.get((model, name), ""),
                    )
                )
        charts.append(
            svg.line_chart(
                series,
                title=f"{task}: accuracy vs compression",
                x_label="compression (16-bit full-cache bytes / bytes held, log scale)",
                y_label="accuracy",
                x_log=True,
                y_low=0.0,
                y_high=1.0,
                y_format=lambda v: f"{100 * v:.0f}%",
            )
        )
    contexts = sorted({r["context"] for r in rows})
    return (
        '<section id="frontier"><h2>Quality vs compression</h2>'
        f'<p class="note">Pooled over context lengths {", ".join(str(c) for c in contexts)}; points are '
        "labelled by their options; up and to the right is better.</p>"
        f'<div class="charts">{"".join(charts)}</div></section>'
    )


def _context_series(rows: list[dict[str, Any]], metric: str, scale: float) -> list[svg.Series]:
    colors = series_colors(rows)
    several = len(data.models(rows)) > 1
    series = []
    for model in data.models(rows):
        members = [r for r in rows if str(r.get("model")) == model]
        curves = data.by_context(members, metric)
        for method in data.methods(members):
            if method in curves:
                points = [(float(c), v * scale) for c, v in curves[method]]
                name = _series_name(model, method, several)
                series.append(svg.Series(name, points, color=colors[(model, method)]))
    return series


def _bars(series: list[svg.Series]) -> list[svg.Bar]:
    """One bar per series of one point each (its context named when the bars are not all at one)."""
    several = len({s.points[0][0] for s in series if s.points}) > 1
    return [
        svg.Bar(
            f"{s.name} ({svg.format_number(s.points[0][0])} tokens)" if several else s.name,
            s.points[0][1],
            s.color,
            dashed=s.dashed,
        )
        for s in series
        if s.points
    ]


def context_chart(series: list[svg.Series], title: str, y_label: str) -> str:
    """A chart against context length: lines on a log axis, or one bar per series when every series has a
    single length (a column of dots would say nothing)."""
    contexts = sorted({int(s.points[0][0]) for s in series if s.points})
    if contexts and all(len(s.points) <= 1 for s in series):
        at = f" at {svg.format_number(contexts[0])} tokens" if len(contexts) == 1 else ""
        note = (
            f"one context length ({contexts[0]} tokens): one bar per method"
            if len(contexts) == 1
            else "one context length per method: one bar each"
        )
        return svg.bar_chart(_bars(series), title=f"{title}{at}", value_label=y_label, note=note)
    return svg.line_chart(
        series,
        title=f"{title} vs context",
        x_label="context tokens (log scale)",
        y_label=y_label,
        x_log=True,
        y_low=0.0,
    )


def memory_speed_section(rows: list[dict[str, Any]]) -> str:
    """KV memory held and decode speed against context length (bars when there is one length)."""
    memory = _context_series(rows, "kv_bytes", 1 / 2**20)
    several = len(data.models(rows)) > 1
    for model in data.models(rows):
        members = [r for r in rows if str(r.get("model")) == model and r["method"] in data.REFERENCE_METHODS]
        members = members or [r for r in rows if str(r.get("model")) == model]
        reference = data.by_context(members, "full_kv_bytes")
        points = sorted({float(c): v / 2**20 for curve in reference.values() for c, v in curve}.items())
        memory.append(
            svg.Series(
                _series_name(model, "16-bit full cache", several), points, color="#555555", dashed=True
            )
        )
    speed = _context_series(rows, "decode_tok_s", 1.0)
    charts = [
        context_chart(memory, "KV cache held", "KV MiB (max over the answer)"),
        context_chart(speed, "decode speed", "decode tokens / s (median)"),
    ]
    return (
        '<section id="memory-speed"><h2>Memory and speed</h2>'
        '<p class="note">Memory is the bytes of the tensors the cache actually holds; speed is measured on '
        "this run's machine, so compare it as a ratio against <code>full</code> (tables below).</p>"
        f'<div class="charts">{"".join(charts)}</div></section>'
    )


def _fmt(value: Any, pattern: str, empty: str = "-") -> str:
    return empty if value is None else pattern % value


def overview_tables(summary: list[dict[str, Any]]) -> str:
    """One :func:`overview_table` per context length, each under its heading."""
    return "".join(
        f"<h3>{escape(data.column_label('', context).strip())} tokens</h3>{overview_table(summary, context)}"
        for context in sorted({entry["context"] for entry in summary})
    )


def overview_table(summary: list[dict[str, Any]], context: int | None = None) -> str:
    """Accuracy (trials) per task for every (model, method) run at ``context`` (every context when ``None``),
    compression, memory, speed ratio."""
    task_list, lines = data.overview(summary, context)
    several = len({line["model"] for line in lines}) > 1
    shown = [t.rsplit(" ", 1)[0] for t in task_list] if context is not None else task_list
    head = ['<th class="name">method</th>'] + [f"<th>{escape(t)}</th>" for t in shown]
    head += [
        "<th>compression</th>",
        "<th>KV MiB</th>" if context is not None else "<th>KV MiB (longest)</th>",
        "<th>decode vs full</th>",
    ]
    body = []
    for line in lines:
        cells = [f'<td class="name">{escape(_series_name(str(line["model"]), line["method"], several))}</td>']
        for task in task_list:
            value, n = line["accuracy"][task], line["n"][task]
            cells.append(f"<td>{'-' if value is None else f'{100 * value:.0f}% <small>({n})</small>'}</td>")
        cells.append(f"<td>{_fmt(line['compression'], '%.2fx')}</td>")
        cells.append(
            f"<td>{line['kv_mb']:.2f}</td>"
            if context is not None
            else f"<td>{line['kv_mb']:.2f} @ {line['longest']}</td>"
        )
        cells.append(f"<td>{_fmt(line['speed_vs_full'], '%.2f')}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{''.join(head)}</tr>{''.join(body)}</table>"


def summary_table(summary: list[dict[str, Any]]) -> str:
    """Every (method, task, context) entry of one run."""
    columns = [
        "method", "task", "context", "accuracy", "n", "KV MiB", "compression", "prefill s", "decode tok/s",
        "vs full",
    ]  # fmt: skip
    head = "".join(f'<th class="{"name" if c in ("method", "task") else ""}">{c}</th>' for c in columns)
    body = []
    for s in summary:
        cells = [
            f'<td class="name">{escape(s["method"])}</td>',
            f'<td class="name">{escape(s["task"])}</td>',
            f"<td>{s['context']}</td>",
            f"<td>{100 * s['accuracy']:.0f}%</td>",
            f"<td>{s['n']}</td>",
            f"<td>{s['kv_bytes'] / 2**20:.2f}</td>",
            f"<td>{_fmt(s.get('compression'), '%.2fx')}</td>",
            f"<td>{_fmt(s.get('prefill_s'), '%.2f')}</td>",
            f"<td>{_fmt(s.get('decode_tok_s'), '%.1f')}</td>",
            f"<td>{_fmt(s.get('speed_vs_full'), '%.2f')}</td>",
        ]
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def perplexity_table(entries: list[dict[str, Any]]) -> str:
    """Perplexity per setting and method, with the change against ``full`` on the same windows."""
    from kvweave.report.cells import PPL_HEADER, ppl_cells

    head = "".join(
        f'<th class="{"name" if c in ("model", "corpus", "method") else ""}">{c}</th>' for c in PPL_HEADER
    )
    body = []
    for entry in entries:
        cells = [cell.strip("`") for cell in ppl_cells(entry)]
        body.append(
            "<tr>"
            + "".join(
                f'<td class="{"name" if i in (0, 1, 3) else ""}">{escape(cell)}</td>'
                for i, cell in enumerate(cells)
            )
            + "</tr>"
        )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def perplexity_section(runs: list[Run]) -> str:
    """Perplexity change against ``full`` vs compression (one chart per model, corpus and window) and the
    table; empty when no run holds perplexity rows."""
    entries = data.perplexity_summary(runs)
    if not entries:
        return ""
    charts = []

    def setting(e: dict[str, Any]) -> tuple[Any, ...]:
        return (str(e["model"]), str(e["corpus"]), e["window"], e["target"], bool(e.get("stepwise")))

    for model, corpus, window, target, stepwise in sorted({setting(e) for e in entries}, key=str):
        members = [
            e
            for e in entries
            if setting(e) == (model, corpus, window, target, stepwise)
            and e.get("ppl_vs_full") is not None
            and e.get("compression")
        ]
        if not members:
            continue
        families: dict[str, list[dict[str, Any]]] = {}
        for entry in members:
            families.setdefault(data.family(entry["method"]), []).append(entry)
        series = [
            svg.Series(
                name,
                [
                    (e["compression"], 100 * e["ppl_vs_full"])
                    for e in sorted(group, key=lambda e: e["compression"])
                ],
                [data.options_label(e["method"]) for e in sorted(group, key=lambda e: e["compression"])],
            )
            for name, group in sorted(families.items(), key=lambda kv: data.method_order(kv[0]))
        ]
        charts.append(
            svg.line_chart(
                series,
                title=f"{model}, {corpus}, {window}-token windows{', stepwise' if stepwise else ''}: perplexity vs "
                "compression",
                x_label="compression (16-bit full-cache bytes / bytes held, log scale)",
                y_label="perplexity change vs full (%)",
                x_log=True,
                y_format=lambda v: f"{v:+.0f}%",
            )
        )
    return (
        '<section id="perplexity"><h2>Perplexity</h2>'
        '<p class="note">Each window\'s first tokens are prefilled and compressed, then its last (scored) tokens '
        "are fed through the same cache and scored by teacher forcing; perplexity is exp of the mean NLL over "
        "the windows. Lower and to the right is better.</p>"
        f'<div class="charts">{"".join(charts)}</div>{perplexity_table(entries)}</section>'
    )


def environment_line(environment: dict[str, Any]) -> str:
    """Hardware and versions in one line."""
    keys = (
        "machine",
        "processor",
        "gpu",
        "cpus",
        "threads",
        "cuda",
        "python",
        "torch",
        "transformers",
        "kvweave",
        "git",
    )
    return ", ".join(f"{k} {environment[k]}" for k in keys if environment.get(k) not in (None, ""))


def bench_hardware(rows: list[dict[str, Any]]) -> list[str]:
    """The machines and versions ``rows`` were measured with, one line each (usually one): the environment
    line, the measured copy bandwidth and the bytes of weights a step reads."""
    lines = []
    for environment, bandwidth, weights in data.distinct(
        (r.get("environment") or {}, r.get("bandwidth_gb_s"), r.get("weight_bytes")) for r in rows
    ):
        parts = [environment_line(environment)] if environment else []
        if bandwidth is not None:
            parts.append(f"measured copy bandwidth {bandwidth:g} GB/s")
        if weights is not None:
            parts.append(f"weights {weights / 2**20:.1f} MiB")
        lines.append(", ".join(p for p in parts if p) or "environment not recorded")
    return lines


def bench_notes(rows: list[dict[str, Any]], shown: list[dict[str, Any]]) -> list[str]:
    """What the peak column measures, and how repeated points were resolved."""
    notes = []
    kinds = data.distinct(r.get("peak_kind") for r in shown if r.get("peak_kind"))
    if kinds:
        notes.append("Peak MiB: " + "; ".join(str(k) for k in kinds) + ".")
    repeats = data.repeated_points(rows)
    if repeats:
        notes.append(
            f"{repeats} point{'s were' if repeats != 1 else ' was'} measured more than once (the bench file is "
            "appended to): the latest row of each is shown (the file and the bench CSV keep every row)."
        )
    return notes


def bench_colors(rows: list[dict[str, Any]]) -> dict[str, str]:
    """A colour per method spec, the same in every bench chart."""
    return {method: svg.PALETTE[i % len(svg.PALETTE)] for i, method in enumerate(data.methods(rows))}


def _ratio(value: float) -> str:
    return f"{value:g}x"


def bench_speed_chart(rows: list[dict[str, Any]], batch: int, colors: dict[str, str]) -> str:
    """Decode tok/s against context length at one batch size, one line per method (one bar per method when
    only one length was measured)."""
    members = [r for r in rows if int(r["batch"]) == batch]
    contexts = sorted({int(r["context"]) for r in members})
    series = [
        svg.Series(
            method,
            [(float(r["context"]), float(r["tok_s"])) for r in members if r["method"] == method],
            color=colors[method],
        )
        for method in data.methods(members)
    ]
    if len(contexts) == 1:
        return svg.bar_chart(
            _bars(series),
            title=f"batch {batch}: decode tok/s at {svg.format_number(contexts[0])} tokens",
            value_label="decode tokens / s (whole batch)",
            note=f"context tokens: one length measured ({contexts[0]}); one bar per method",
        )
    return svg.line_chart(
        series,
        title=f"batch {batch}: decode tok/s vs context",
        x_label="context tokens (log scale)",
        y_label="decode tokens / s (whole batch)",
        x_log=True,
        y_low=0.0,
    )


def bench_gap_chart(rows: list[dict[str, Any]], batch: int, colors: dict[str, str]) -> str:
    """Speedup against ``full`` (dot) and its bandwidth bound (diamond) against compression, at one batch
    size; points labelled by context length when there are several."""
    members = [
        r
        for r in rows
        if int(r["batch"]) == batch and r.get("compression") is not None and r.get("bound") is not None
    ]
    several = len({int(r["context"]) for r in members}) > 1
    series = []
    for method in data.methods(members):
        points = []
        for r in (r for r in members if r["method"] == method):
            of_bound = r.get("of_bound")
            tip = (
                f"{method}, {r['context']} tokens, batch {batch}: compression {r['compression']:.2f}x, speedup "
                f"{r['speedup']:.2f}x, bound {r['bound']:.2f}x"
                + (f" ({100 * of_bound:.0f}% of it)" if of_bound is not None else "")
            )
            # full is 1x against itself at every length: its labels would only pile up
            label = (
                svg.format_number(int(r["context"]))
                if several and method not in data.REFERENCE_METHODS
                else ""
            )
            points.append(
                svg.GapPoint(float(r["compression"]), float(r["speedup"]), float(r["bound"]), label, tip)
            )
        series.append(svg.GapSeries(method, points, color=colors[method]))
    return svg.gap_chart(
        series,
        title=f"batch {batch}: speedup vs compression",
        x_label="compression (16-bit full-cache bytes / bytes held, log scale)",
        y_label="speedup vs full (same run)",
        y_format=_ratio,
        measured_name="measured speedup",
        bound_name="bandwidth bound",
    )


def bench_table(rows: list[dict[str, Any]]) -> str:
    """One line per bench point: speed, speedup beside its bound, KV bytes held and read, prefill, peak."""
    from kvweave.report.cells import BENCH_HEADER, bench_cells, html_table

    return html_table(BENCH_HEADER, [bench_cells(r) for r in rows])


BENCH_INTRO = (
    "Measured by <code>kvweave bench</code>: per context length and batch size every method prefills the same "
    "prompt, then decodes in rounds interleaved with <code>full</code>; ms/token is the median over rounds. "
    "Speedup is <code>full</code>'s step time over the method's, measured in the same run; the bound "
    "(W + KV read by full) / (W + KV read) is the most a step that is bound by the bytes it reads can gain, "
    "and achieved/bound = speedup / bound. Compression is against a 16-bit cache (a float32 "
    "<code>full</code> shows 0.5x). Charts: tok/s against context length, and each method's speedup (dot) "
    "below or above its bound (diamond); the dashed line is <code>full</code>."
)


def bench_section(runs: list[Run]) -> str:
    """Decode speed from ``kvweave bench`` rows: per run, model, device and dtype, the tok/s and
    speedup-vs-bound charts of each batch size and the table; empty when no run holds bench rows."""
    groups = data.bench_groups(runs)
    if not groups:
        return ""
    colors = bench_colors([r for run in runs for r in run.bench])
    several_runs = len({id(g.run) for g in groups}) > 1
    parts = [
        '<section id="bench"><h2>Decode speed (kvweave bench)</h2>',
        f'<p class="note">{BENCH_INTRO}</p>',
    ]
    for group in groups:
        shown = data.latest_bench(group.rows)
        heading = group.title + (f" ({group.run.name})" if several_runs else "")
        parts.append(f"<h3>{escape(heading)}</h3>")
        for line in bench_hardware(shown):
            parts.append(f'<p class="note">{escape(line)}</p>')
        if group.run.bench_command:
            parts.append(f"<pre>{escape(group.run.bench_command)}</pre>")
        charts = []
        for batch in group.batches:
            charts += [bench_speed_chart(shown, batch, colors), bench_gap_chart(shown, batch, colors)]
        parts.append(f'<div class="charts">{"".join(charts)}</div>')
        parts.append(bench_table(shown))
        parts += [f'<p class="note">{escape(note)}</p>' for note in bench_notes(group.rows, shown)]
    parts.append("</section>")
    return "\n".join(parts)


def runs_section(runs: list[Run], summaries: list[list[dict[str, Any]]]) -> str:
    """Per run: the command that produced it, its environment and its full summary table."""
    parts = ['<section id="runs"><h2>Runs</h2>']
    for run, summary in zip(runs, summaries, strict=True):
        parts.append(
            f"<h3>{escape(run.name)} <small>({run.count} rows, {escape(str(run.path))})</small></h3>"
        )
        if run.command or run.bench_command:
            parts.append(f"<pre>{escape(run.command or run.bench_command)}</pre>")
        if run.environment:
            parts.append(f'<p class="note">{escape(environment_line(run.environment))}</p>')
        if run.rows:
            parts.append(summary_table(summary))
        if run.ppl:
            parts.append(perplexity_table(data.perplexity_summary([run])))
        if run.bench:
            parts.append(
                f'<p class="note">{len(run.bench)} bench rows: see <a href="#bench">Decode speed</a>.</p>'
            )
        if run.serving:
            parts.append(
                f'<p class="note">{len(run.serving)} serving rows: see <a href="#serving">Serving under '
                "load</a>.</p>"
            )
    parts.append("</section>")
    return "\n".join(parts)


def render(runs: list[Run]) -> str:
    """The whole HTML page for ``runs``."""
    rows = data.unique_rows(runs)  # across runs, a row copied to resume beside it counts once
    summaries = [data.run_summary(run) for run in runs]
    summary = data.pooled_summary(runs)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    names = ", ".join(run.name for run in runs)
    ppl, bench = sum(len(run.ppl) for run in runs), sum(len(run.bench) for run in runs)
    serving = sum(len(run.serving) for run in runs)
    counts = [f"{len(rows)} rows"] if rows or not (ppl or bench or serving) else []
    counts += [f"{ppl} perplexity rows"] if ppl else []
    counts += [f"{bench} bench rows"] if bench else []
    counts += [f"{serving} serving rows"] if serving else []
    body = [
        "<h1>kvweave report</h1>",
        f'<p class="note">{", ".join(counts)} from {escape(names)}; generated {stamp}.'
        + (" Question-agnostic unless the command says <code>--question-aware</code>." if rows else "")
        + "</p>",
        panel.panel(runs, summary),
    ]
    if rows or not (ppl or bench or serving):  # a perplexity, bench or serving run alone has no eval sections
        body += [
            '<section id="overview"><h2>Overview</h2>',
            '<p class="note">One table per context length: accuracy per task (mean over trials, their number '
            "in brackets), mean compression, KV memory held, and median decode speed as a ratio against "
            "<code>full</code> in the same run.</p>",
            *(
                [f'<p class="note">{escape(note)}</p>']
                if (note := data.metric_note(r["task"] for r in summary))
                else []
            ),
            overview_tables(summary),
            "</section>",
            heatmap_section(rows),
            frontier_section(rows),
            memory_speed_section(rows),
        ]
    body += [
        perplexity_section(runs),
        bench_section(runs),
        serving_section(runs),
        runs_section(runs, summaries),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>kvweave report: {escape(names)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(part for part in body if part)
        + "\n</body></html>\n"
    )
