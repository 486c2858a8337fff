"""Serving under load: the rows of ``benchmarks/vllm_load.py`` (``kind == "vllm_load"``) as charts and tables.

One group per (model, prompt length, dtype, KV space): output tokens/s, median time per output token and
median time to first token against concurrency, one line per method (vLLM's own cache is ``none``), and a
table with every point's requests, failures, p99 latencies, preemptions and accuracy. The HTML page and the
markdown summary both take their sections from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING, Any

from kvweave.report import svg
from kvweave.report.cells import html_table, markdown_table

if TYPE_CHECKING:
    from kvweave.report.data import Run

SERVING_KIND = "vllm_load"
SERVING_REQUIRED = (
    "method",
    "concurrency",
    "requests",
    "completed",
    "failed",
    "output_tokens_per_s",
    "tpot_median_s",
    "ttft_median_s",
)
"""Fields a serving row must have to be reported (the rest are shown where present)."""

OWN_CACHE = "none"
"""The method name of vLLM's own cache in the rows (no kvweave method installed)."""

SERVING_HEADER = [
    "method",
    "kernel",
    "concurrency",
    "requests (failed)",
    "output tok/s",
    "req/s",
    "TPOT median (p99) s",
    "TTFT median (p99) s",
    "KV tokens",
    "preemptions",
    "accuracy",
]

SERVING_INTRO = (
    "Measured by `benchmarks/vllm_load.py`: vLLM's OpenAI-compatible server on loopback with a fixed KV space, "
    "a bounded load generator sending distinct passkey prompts at each concurrency; `none` is vLLM's own cache. "
    "TPOT is the time per output token after the first, TTFT the time to the first token; accuracy is the share "
    "of answers that contain the passkey. Every row is one server run: compare methods within a group only."
)


def serving_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``vllm_load`` rows that have the fields the report needs, and those of points whose server refused to
    start (``refused``: the reason; shown in the table, not drawn)."""
    return [
        r
        for r in rows
        if r.get("kind") == SERVING_KIND
        and (
            all(r.get(k) is not None for k in SERVING_REQUIRED)
            or (r.get("refused") and r.get("method") is not None and r.get("concurrency") is not None)
        )
    ]


@dataclass
class ServingGroup:
    """The rows of one run measured under one setting (model, prompt length, dtype, KV space)."""

    run: Run
    title: str
    rows: list[dict[str, Any]]


def _model_name(row: dict[str, Any]) -> str:
    return str(row.get("model", "?")).rstrip("/").rsplit("/", 1)[-1]


def serving_groups(runs: Iterable[Run]) -> list[ServingGroup]:
    """Per run and setting, the latest row of each (method, concurrency), ordered by method then concurrency."""
    groups = []
    for run in runs:
        settings: dict[tuple[str, Any, Any, Any], list[dict[str, Any]]] = {}
        for row in run.serving:
            key = (_model_name(row), row.get("context"), row.get("dtype"), row.get("kv_space_gib"))
            settings.setdefault(key, []).append(row)
        for (model, context, dtype, space), rows in settings.items():
            latest: dict[tuple[str, int], dict[str, Any]] = {}
            for row in rows:  # a rerun (--restart) appends: the last row of a point is the one shown
                latest[(series_name(row), int(row["concurrency"]))] = row
            ordered = sorted(
                latest.values(), key=lambda r: (_method_order(series_name(r)), int(r["concurrency"]))
            )
            title = f"{model}, {context}-token prompts, {dtype}, KV space {space} GiB"
            groups.append(ServingGroup(run, title, ordered))
    return groups


def series_name(row: dict[str, Any]) -> str:
    """The method, with the decode kernel it was told to run when the row names one (``KVWEAVE_VLLM_KERNEL``):
    the same method through two kernels is two series."""
    kernel = row.get("kernel")
    return f"{row['method']} (kernel {kernel})" if kernel else str(row["method"])


def _method_order(name: str) -> tuple[int, str]:
    return (0 if name == OWN_CACHE else 1, name)


def methods(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The series of ``rows`` that have figures (not refused at start-up): vLLM's own cache first."""
    return sorted({series_name(r) for r in rows if not r.get("refused")}, key=_method_order)


def _num(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern % value


def serving_cells(row: dict[str, Any]) -> list[str]:
    """One table line of a serving row."""
    if row.get("refused"):
        return [
            f"`{row['method']}`",
            "-",
            str(row["concurrency"]),
            f"refused at start-up: {row['refused']}",
        ] + ["-"] * (len(SERVING_HEADER) - 4)
    failed = int(row.get("failed") or 0)
    return [
        f"`{row['method']}`",
        str(row.get("kernel") or "-"),
        str(row["concurrency"]),
        f"{row['completed']} / {row['requests']}" + (f" ({failed} failed)" if failed else ""),
        _num(row.get("output_tokens_per_s"), "%.3f"),
        _num(row.get("requests_per_s"), "%.4f"),
        f"{_num(row.get('tpot_median_s'), '%.3f')} ({_num(row.get('tpot_p99_s'), '%.3f')})",
        f"{_num(row.get('ttft_median_s'), '%.2f')} ({_num(row.get('ttft_p99_s'), '%.2f')})",
        _num(row.get("kv_tokens"), "%d"),
        _num(row.get("preemptions"), "%d"),
        "-" if row.get("accuracy") is None else f"{100 * float(row['accuracy']):.0f}%",
    ]


def _series(rows: list[dict[str, Any]], metric: str, colors: dict[str, str]) -> list[svg.Series]:
    return [
        svg.Series(
            method,
            [
                (float(r["concurrency"]), float(r[metric]))
                for r in rows
                if series_name(r) == method and r.get(metric) is not None
            ],
            color=colors.get(method, ""),
        )
        for method in methods(rows)
    ]


CHARTS = (
    ("output_tokens_per_s", "output tokens / s vs concurrency", "output tokens / s (all requests)"),
    ("tpot_median_s", "time per output token vs concurrency", "TPOT, median (s)"),
    ("ttft_median_s", "time to first token vs concurrency", "TTFT, median (s)"),
)


def serving_charts(rows: list[dict[str, Any]]) -> list[str]:
    """The three line charts of one group (an x axis of concurrencies, base-2 log when there are several)."""
    colors = {m: svg.PALETTE[i % len(svg.PALETTE)] for i, m in enumerate(methods(rows))}
    several = len({int(r["concurrency"]) for r in rows}) > 1
    return [
        svg.line_chart(
            _series(rows, metric, colors),
            title=title,
            x_label="concurrent requests" + (" (log scale)" if several else ""),
            y_label=label,
            x_log=several,
            y_low=0.0,
        )
        for metric, title, label in CHARTS
    ]


def serving_section(runs: list[Run]) -> str:
    """The HTML section "Serving under load"; empty without serving rows."""
    groups = serving_groups(runs)
    if not groups:
        return ""
    several_runs = len({id(g.run) for g in groups}) > 1
    parts = [
        '<section id="serving"><h2>Serving under load (vLLM)</h2>',
        f'<p class="note">{escape(SERVING_INTRO)}</p>',
    ]
    for group in groups:
        heading = group.title + (f" ({group.run.name})" if several_runs else "")
        parts.append(f"<h3>{escape(heading)}</h3>")
        if group.run.serving_command:
            parts.append(f"<pre>{escape(group.run.serving_command)}</pre>")
        parts.append(f'<div class="charts">{"".join(serving_charts(group.rows))}</div>')
        parts.append(html_table(SERVING_HEADER, [serving_cells(r) for r in group.rows]))
    parts.append("</section>")
    return "\n".join(parts)


def serving_markdown(runs: list[Run]) -> str:
    """The markdown section "Serving under load"; empty without serving rows."""
    groups = serving_groups(runs)
    if not groups:
        return ""
    several_runs = len({id(g.run) for g in groups}) > 1
    parts = ["## Serving under load (vLLM)", "", SERVING_INTRO, ""]
    for group in groups:
        heading = group.title + (f" ({group.run.name})" if several_runs else "")
        parts += [f"### {heading}", ""]
        if group.run.serving_command:
            parts += ["Produced by:", "", "```sh", group.run.serving_command, "```", ""]
        parts += [markdown_table(SERVING_HEADER, [serving_cells(r) for r in group.rows]), ""]
    return "\n".join(parts).rstrip()
