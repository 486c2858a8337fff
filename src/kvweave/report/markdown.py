"""The markdown summary: the overview and per-run tables, with the command that produced each run."""

from __future__ import annotations

from typing import Any

from kvweave.report import data, page
from kvweave.report.data import Run


def _table(header: list[str], lines: list[list[str]], align: list[str]) -> str:
    rule = ["---:" if a == "r" else ":---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _num(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern % value


def _cell(accuracy: float | None, n: int) -> str:
    return "" if accuracy is None or n == 0 else f"{_pct(accuracy)} ({n})"


def overview_markdown(summary: list[dict[str, Any]]) -> str:
    """One table per context length: accuracy (trials) per task for every (model, method) run at it, with
    compression, memory and speed ratio at that length."""
    parts = []
    for context in sorted({entry["context"] for entry in summary}):
        label = data.column_label("", context).strip()
        parts += [f"### {label} tokens", "", overview_table(summary, context), ""]
    return "\n".join(parts).rstrip()


def overview_table(summary: list[dict[str, Any]], context: int | None = None) -> str:
    """Accuracy (trials) per task and context for every (model, method), with compression, memory and speed
    ratio (only ``context`` when given)."""
    tasks, lines = data.overview(summary, context)
    several = len({line["model"] for line in lines}) > 1
    if context is not None:
        tasks_shown = [t.rsplit(" ", 1)[0] for t in tasks]
        memory = "KV MiB"
    else:
        tasks_shown, memory = tasks, "KV MiB (longest context)"
    header = ["method", *tasks_shown, "compression", memory, "decode vs full"]
    rows = [
        [
            f"`{line['method']}`" if not several else f"{line['model']} `{line['method']}`",
            *[_cell(line["accuracy"][t], line["n"][t]) for t in tasks],
            _num(line["compression"], "%.2fx"),
            f"{line['kv_mb']:.2f}" if context is not None else f"{line['kv_mb']:.2f} @ {line['longest']}",
            _num(line["speed_vs_full"], "%.2f"),
        ]
        for line in lines
    ]
    return _table(header, rows, ["l"] + ["r"] * (len(header) - 1))


PPL_HEADER = ["model", "corpus", "window (scored)", "method", "windows", "compression", "perplexity", "vs full"]


def ppl_cells(entry: dict[str, Any]) -> list[str]:
    """One perplexity line: the setting, the method, and perplexity against ``full`` of the same setting."""
    change = entry.get("ppl_vs_full")
    return [
        str(entry.get("model")),
        str(entry.get("corpus")),
        f"{entry.get('window')} ({entry.get('target')}{', stepwise' if entry.get('stepwise') else ''})",
        f"`{entry['method']}`",
        str(entry["n"]),
        _num(entry.get("compression"), "%.2fx"),
        f"{entry['ppl']:.2f}",
        "-" if change is None else f"{100 * change:+.1f}%",
    ]


def perplexity_markdown(entries: list[dict[str, Any]]) -> str:
    """The perplexity table (``kvweave ppl`` runs): each window's prefix is prefilled and compressed, then its
    last tokens are scored through the same cache."""
    return _table(PPL_HEADER, [ppl_cells(e) for e in entries], ["l", "l", "r", "l", "r", "r", "r", "r"])


def run_markdown(run: Run, summary: list[dict[str, Any]]) -> str:
    """One run: its command, environment and per-(method, task, context) table."""
    header = [
        "method",
        "task",
        "context",
        "accuracy",
        "n",
        "KV MiB",
        "compression",
        "prefill s",
        "tok/s",
        "vs full",
    ]
    rows = [
        [
            f"`{s['method']}`",
            s["task"],
            str(s["context"]),
            _pct(s["accuracy"]),
            str(s["n"]),
            f"{s['kv_bytes'] / 2**20:.2f}",
            _num(s.get("compression"), "%.2fx"),
            _num(s.get("prefill_s"), "%.2f"),
            _num(s.get("decode_tok_s"), "%.1f"),
            _num(s.get("speed_vs_full"), "%.2f"),
        ]
        for s in summary
    ]
    parts = [f"### {run.name}", ""]
    if run.command:
        parts += ["Produced by:", "", "```sh", run.command, "```", ""]
    if run.environment:
        parts += [f"Environment: {page.environment_line(run.environment)}.", ""]
    if rows:
        parts.append(_table(header, rows, ["l", "l"] + ["r"] * 8))
    if run.ppl:
        parts.append(perplexity_markdown(data.perplexity_summary([run])))
    return "\n".join(parts).rstrip()


def render(runs: list[Run]) -> str:
    """The markdown summary of ``runs``."""
    summaries = [data.run_summary(run) for run in runs]
    summary = [entry for run_entries in summaries for entry in run_entries]
    parts = [
        "## kvweave results",
        "",
        "One table per context length: accuracy per task (number of trials in brackets), mean compression "
        "(16-bit full-cache bytes / bytes held), KV memory held (the largest sample), and median decode speed as "
        "a ratio against `full` measured in the same run (the median over the runs a method appears in at that "
        "length).",
        "",
        overview_markdown(summary),
        "",
    ]
    note = data.metric_note(entry["task"] for entry in summary)
    if note:
        parts[4:4] = [note, ""]
    ppl = data.perplexity_summary(runs)
    if ppl:
        parts += [
            "### Perplexity",
            "",
            "Each window's first tokens are prefilled and compressed, then its last (scored) tokens are fed "
            "through the same cache and scored by teacher forcing; perplexity is exp of the mean NLL over the "
            "windows, and its change is against `full` on the same windows.",
            "",
            perplexity_markdown(ppl),
            "",
        ]
    for run, run_entries in zip(runs, summaries, strict=True):
        parts += [run_markdown(run, run_entries), ""]
    return "\n".join(parts)
