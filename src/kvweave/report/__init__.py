"""``kvweave report``: an HTML page and a markdown summary generated from run folders and bench files.

Results are data, the report is derived from them (never the other way round)::

    from kvweave.report import write_report
    write_report(["runs/demo-qwen2.5-coder-0.5b-2048"], "report.html", markdown="summary.md")

The page is self-contained (inline CSS and SVG charts, no scripts, nothing fetched): NIAH heatmaps (depth
x context per method and task), accuracy-vs-compression frontiers per task, KV memory and decode speed
against context length, and tables with speed as a ratio against ``full`` in the same run; with
``kvweave bench`` rows (a folder's ``bench.jsonl`` or the JSONL file itself), decode speed against context
length, speedup against compression beside its bandwidth bound, and their tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvweave.report.data import Run, load_run

__all__ = [
    "Run",
    "bench_csv_path",
    "load_run",
    "render_bench_csv",
    "render_csv",
    "render_html",
    "render_markdown",
    "write_report",
]


def render_html(runs: Sequence[Run]) -> str:
    """The HTML page for ``runs``."""
    from kvweave.report import page

    return page.render(list(runs))


def render_markdown(runs: Sequence[Run]) -> str:
    """The markdown summary for ``runs``."""
    from kvweave.report import markdown

    return markdown.render(list(runs))


def render_csv(runs: Sequence[Run]) -> str:
    """One CSV line per (run, model, method, task, context): the numbers behind every table and chart."""
    from kvweave.report import data

    return data.summary_csv(list(runs))


def render_bench_csv(runs: Sequence[Run]) -> str:
    """One CSV line per ``kvweave bench`` row (``data.BENCH_CSV_COLUMNS``)."""
    from kvweave.report import data

    return data.bench_csv(list(runs))


def bench_csv_path(csv: str | Path) -> Path:
    """Where the bench rows go beside the cells CSV ``csv``: ``cells.csv`` -> ``cells-bench.csv``."""
    path = Path(csv)
    return path.with_name(f"{path.stem}-bench{path.suffix or '.csv'}")


def write_report(
    run_dirs: Sequence[str | Path],
    html: str | Path,
    markdown: str | Path | None = None,
    csv: str | Path | None = None,
) -> list[Run]:
    """Read ``run_dirs`` (run folders or bench JSONL files), write the HTML page to ``html`` (the markdown
    summary to ``markdown``, the per-cell numbers to ``csv``, and when there are bench rows, those to
    :func:`bench_csv_path` of ``csv``)."""
    if not run_dirs:
        raise ValueError(
            "give at least one run folder (written by `kvweave eval --out`) or bench file (`kvweave bench --out`)"
        )
    runs = [load_run(folder) for folder in run_dirs]
    empty = [run.name for run in runs if not run.count]
    if len(empty) == len(runs):
        raise ValueError(f"no result rows in {', '.join(empty)}; nothing to report")
    Path(html).parent.mkdir(parents=True, exist_ok=True)
    Path(html).write_text(render_html(runs), encoding="utf-8")
    if markdown is not None:
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown).write_text(render_markdown(runs), encoding="utf-8")
    if csv is not None:
        Path(csv).parent.mkdir(parents=True, exist_ok=True)
        Path(csv).write_text(render_csv(runs), encoding="utf-8", newline="")
        if any(run.bench for run in runs):
            bench_csv_path(csv).write_text(render_bench_csv(runs), encoding="utf-8", newline="")
    return runs
