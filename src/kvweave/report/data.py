"""Reading run folders and shaping their rows for the report: summaries, heatmap grids, frontiers, curves.

A run folder holds ``rows.jsonl`` (one result row per line, see :mod:`kvweave.eval.runner`) and
``config.json`` (``{"config": EvalConfig fields, "environment": ...}``); ``command.txt``, when present, is
the command line that produced it. Rows of several runs are pooled for the charts; summaries (and speed
ratios, which only mean something within one run on one machine) are computed run by run.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shlex
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvweave.eval import runner
from kvweave.registry import canonical_spec

REFERENCE_METHODS = ("full", "kvpress:full")
"""Methods that speed ratios are taken against (kvweave's ``full``; the uncompressed kvpress baseline)."""


@dataclass
class Run:
    """One run folder: its rows, its config and environment, and the command that produced it."""

    path: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    ppl: list[dict[str, Any]] = field(default_factory=list)
    """Rows of ``kvweave ppl --out`` (``ppl.jsonl``), when the folder holds a perplexity run."""

    @property
    def name(self) -> str:
        """The folder name."""
        return self.path.name


def load_run(path: str | Path) -> Run:
    """Read a run folder: ``rows.jsonl`` (``kvweave eval``) and/or ``ppl.jsonl`` (``kvweave ppl``) required;
    ``config.json`` and ``command.txt`` optional."""
    folder = Path(path)
    rows_path, ppl_path = folder / "rows.jsonl", folder / "ppl.jsonl"
    if not rows_path.is_file() and not ppl_path.is_file():
        raise FileNotFoundError(
            f"{folder} is not a run folder: it has no rows.jsonl or ppl.jsonl (run `kvweave eval --out` "
            "or `kvweave ppl --out`)"
        )
    meta: dict[str, Any] = {}
    if (folder / "config.json").is_file():
        meta = json.loads((folder / "config.json").read_text())
    config = meta.get("config", {})
    command_path = folder / "command.txt"
    if command_path.is_file() and command_path.read_text().strip():
        command = command_path.read_text().strip()
    else:
        command = eval_command(config, folder) if config else ""
    rows = [r for r in runner.read_rows(rows_path) if _is_result(r)] if rows_path.is_file() else []
    ppl = [r for r in runner.read_rows(ppl_path) if "nll" in r] if ppl_path.is_file() else []
    for row in rows + ppl:  # rows written before an option was renamed read under the current names
        if isinstance(row.get("method"), str):
            row["method"] = canonical_spec(row["method"])
    return Run(folder, rows, config, meta.get("environment", {}), command, ppl)


def perplexity_summary(runs: Iterable[Run]) -> list[dict[str, Any]]:
    """Perplexity per (run, model, corpus, window, target, method), with the change against ``full``."""
    from kvweave.eval.perplexity import summarize_perplexity

    summary = []
    for run in runs:
        for entry in summarize_perplexity(run.ppl):
            entry["run"] = run.name
            summary.append(entry)
    return summary


def _is_result(row: dict[str, Any]) -> bool:
    required = ("method", "task", "context", "score", "kv_bytes", "full_kv_bytes")
    return all(key in row for key in required)


def eval_command(config: dict[str, Any], folder: Path) -> str:
    """The ``kvweave eval`` command line equivalent to a saved :class:`~kvweave.eval.runner.EvalConfig`."""
    parts = ["kvweave", "eval", "--model", str(config.get("model", "?"))]
    parts += ["--task", ",".join(config.get("tasks", []))]
    parts += ["--context", ",".join(str(c) for c in config.get("contexts", []))]
    parts += ["--methods", ",".join(config.get("methods", []))]
    parts += ["--trials", str(config.get("trials", 3))]
    if config.get("question_aware"):
        parts.append("--question-aware")
    if config.get("dtype", "float32") != "float32":
        parts += ["--dtype", str(config["dtype"])]
    for key, flag in (
        ("haystack", "--haystack"),
        ("data_dir", "--data"),
        ("max_new_tokens", "--max-new-tokens"),
    ):
        if config.get(key) is not None:
            parts += [flag, str(config[key])]
    if config.get("seed", 0):
        parts += ["--seed", str(config["seed"])]
    if config.get("beyond_trained"):
        parts.append("--beyond-trained")
    if config.get("shared_prefill") is False:
        parts.append("--no-shared-prefill")
    parts += ["--out", str(folder)]
    return shlex.join(parts)


# ----------------------------------------------------------------------------------------- names


def family(method: str) -> str:
    """The series a method spec belongs to: ``snapkv:ratio=0.25`` -> ``snapkv``; ``kvpress:SnapKV:0.5`` ->
    ``kvpress:SnapKV``."""
    if method.startswith("kvpress:"):
        return ":".join(method.split(":")[:2])
    return method.split(":", 1)[0]


def options_label(method: str) -> str:
    """What distinguishes a method spec inside its family: ``ratio=0.25``, ``0.5``, or ``default``."""
    if method.startswith("kvpress:"):
        parts = method.split(":")
        return parts[2] if len(parts) > 2 else "default"
    _, _, options = method.partition(":")
    return options or "default"


# ----------------------------------------------------------------------------------------- summaries


def speed_ratios(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``speed_vs_full``: decode tok/s over the reference method's at the same (model, task, context).

    The reference is kvweave's ``full`` (or, in a kvpress run, its uncompressed baseline); entries with no
    reference get ``None``.
    """
    reference: dict[tuple[Any, ...], float] = {}
    for entry in summary:
        if entry["method"] in REFERENCE_METHODS and entry.get("decode_tok_s"):
            reference.setdefault((entry.get("model"), entry["task"], entry["context"]), entry["decode_tok_s"])
    for entry in summary:
        base = reference.get((entry.get("model"), entry["task"], entry["context"]))
        speed = entry.get("decode_tok_s")
        entry["speed_vs_full"] = speed / base if base and speed else None
    return summary


def run_summary(run: Run) -> list[dict[str, Any]]:
    """The per-(model, method, task, context) summary of one run, with speed ratios and the run name."""
    summary = speed_ratios(runner.summarize(run.rows))
    for entry in summary:
        entry["run"] = run.name
    return summary


CSV_COLUMNS = (
    "run",
    "model",
    "method",
    "task",
    "context",
    "n",
    "accuracy",
    "compression",
    "kv_bytes",
    "full_kv_bytes",
    "prefill_s",
    "decode_tok_s",
    "speed_vs_full",
)
"""Columns of ``kvweave report --csv``: one line per (run, model, method, task, context)."""


def summary_csv(runs: list[Run]) -> str:
    """The per-cell summaries of ``runs`` as CSV (empty fields where a value was not measured)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for run in runs:
        for entry in run_summary(run):
            writer.writerow({k: ("" if entry.get(k) is None else entry.get(k)) for k in CSV_COLUMNS})
    return out.getvalue()


def _mean(values: Iterable[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _median(values: Iterable[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def overview(
    summary: list[dict[str, Any]], context: int | None = None
) -> tuple[list[str], list[dict[str, Any]]]:
    """``(columns, lines)``: one line per (model, method) with ``(accuracy, n)`` per task and context length
    (columns like ``passkey 4K``), mean compression, KV MB at the longest context and the median speed ratio
    against ``full``; with ``context``, only the entries at that context length."""
    if context is not None:
        summary = [s for s in summary if s["context"] == context]
    keys = sorted({(s["task"], s["context"]) for s in summary})
    tasks = [column_label(task, context) for task, context in keys]
    groups: dict[tuple[Any, str], list[dict[str, Any]]] = defaultdict(list)
    for entry in summary:
        groups[(entry.get("model"), entry["method"])].append(entry)
    lines = []
    for (model, method), entries in groups.items():
        longest = max(e["context"] for e in entries)
        lines.append(
            {
                "model": model,
                "method": method,
                "accuracy": {
                    column_label(task, context): _weighted_accuracy(
                        [e for e in entries if e["task"] == task and e["context"] == context]
                    )
                    for task, context in keys
                },
                "n": {
                    column_label(task, context): sum(
                        e["n"] for e in entries if e["task"] == task and e["context"] == context
                    )
                    for task, context in keys
                },
                "compression": _mean(e.get("compression") for e in entries),
                "kv_mb": max(e["kv_bytes"] for e in entries if e["context"] == longest) / 2**20,
                "longest": longest,
                "speed_vs_full": _median(e.get("speed_vs_full") for e in entries),
                "decode_tok_s": _median(e.get("decode_tok_s") for e in entries),
            }
        )
    return tasks, sorted(lines, key=lambda line: (str(line["model"]), method_order(line["method"])))


METRIC_WORDS = {
    "choice": "multiple-choice accuracy",
    "f1": "mean token F1 against the reference answer",
    "edit_sim": "mean edit similarity of the predicted line",
}


def metric_note(task_names: Iterable[str]) -> str | None:
    """A sentence naming the score of each task not scored by exact-match accuracy (None if there is none)."""
    from kvweave.eval.tasks import TASKS

    names = {label.split(" ")[0] for label in task_names}
    parts = [
        f"{name}: {METRIC_WORDS[TASKS[name].metric]}"
        for name in sorted(names)
        if name in TASKS and TASKS[name].metric in METRIC_WORDS
    ]
    return "Scores other than recall accuracy: " + "; ".join(parts) + "." if parts else None


def column_label(task: str, context: int) -> str:
    """``passkey 4K`` (contexts that are whole multiples of 1024 in K, others in tokens)."""
    return f"{task} {context // 1024}K" if context % 1024 == 0 else f"{task} {context}"


def _weighted_accuracy(entries: list[dict[str, Any]]) -> float | None:
    total = sum(e["n"] for e in entries)
    return sum(e["accuracy"] * e["n"] for e in entries) / total if total else None


def method_order(method: str) -> tuple[int, str]:
    """Sort key: ``full`` first, kvweave methods next, kvpress presses last."""
    if method in REFERENCE_METHODS:
        return (0 if method == "full" else 2, method)
    return (3 if method.startswith("kvpress:") else 1, method)


# ----------------------------------------------------------------------------------------- chart data


def models(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Distinct model names of the rows, sorted."""
    return sorted({str(r.get("model")) for r in rows})


def methods(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Distinct method specs, ``full`` first, kvpress presses last."""
    return sorted({r["method"] for r in rows}, key=method_order)


def tasks(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Distinct task names, sorted."""
    return sorted({r["task"] for r in rows})


def heatmap_grid(
    rows: Iterable[dict[str, Any]],
) -> tuple[list[float], list[int], list[list[float | None]]]:
    """``(depths, contexts, scores)``: mean score per needle depth (rows) and context length (columns)."""
    cells: dict[tuple[float, int], list[float]] = defaultdict(list)
    for row in rows:
        if row.get("depth") is not None:
            cells[(round(float(row["depth"]), 3), int(row["context"]))].append(float(row["score"]))
    depth_list = sorted({d for d, _ in cells})
    context_list = sorted({c for _, c in cells})
    grid = [
        [(sum(cells[(d, c)]) / len(cells[(d, c)])) if cells.get((d, c)) else None for c in context_list]
        for d in depth_list
    ]
    return depth_list, context_list, grid


@dataclass
class FrontierPoint:
    """One method spec on the accuracy-vs-compression plane (pooled over context lengths)."""

    method: str
    compression: float
    accuracy: float
    n: int


def frontier(rows: Iterable[dict[str, Any]]) -> dict[str, list[FrontierPoint]]:
    """Points by method family: accuracy = mean score, compression = total 16-bit bytes / total bytes held."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row["method"]].append(row)
    series: dict[str, list[FrontierPoint]] = defaultdict(list)
    for method, members in groups.items():
        held = sum(r["kv_bytes"] for r in members)
        full = sum(r["full_kv_bytes"] for r in members)
        if not held:
            continue
        accuracy = sum(float(r["score"]) for r in members) / len(members)
        series[family(method)].append(FrontierPoint(method, full / held, accuracy, len(members)))
    return dict(series)


def by_context(rows: Iterable[dict[str, Any]], metric: str) -> dict[str, list[tuple[int, float]]]:
    """Per method, ``(context, value)`` points: the median of ``metric`` over the rows at that length.

    ``metric`` is a row field (``kv_bytes``, ``decode_tok_s``, ...); rows without a value are skipped.
    """
    values: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        value = row.get(metric)
        if value is not None and math.isfinite(float(value)):
            values[row["method"]][int(row["context"])].append(float(value))
    return {
        method: sorted((context, statistics.median(v)) for context, v in per_context.items())
        for method, per_context in values.items()
    }
