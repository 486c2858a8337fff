"""Reading run folders and shaping their rows for the report: summaries, heatmap grids, frontiers, curves.

A run folder holds ``rows.jsonl`` (one result row per line, see :mod:`kvweave.eval.runner`) and
``config.json`` (``{"config": EvalConfig fields, "environment": ...}``); ``command.txt``, when present, is
the command line that produced it. Rows of several runs are pooled for the charts; summaries (and speed
ratios, which only mean something within one run on one machine) are computed run by run.

``kvweave bench --out FILE.jsonl`` rows (``kind == "bench"``, see :mod:`kvweave.eval.bench`) are read from a
folder's ``bench.jsonl`` or from the JSONL file itself; they carry their own speedup against ``full`` measured
in the same point, and their machine in ``environment``.
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
from kvweave.report.serving import serving_rows
from kvweave.report.specs import canonical_spec

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
    bench: list[dict[str, Any]] = field(default_factory=list)
    """Rows of ``kvweave bench --out`` (``kind == "bench"``): the folder's ``bench.jsonl``, or the file given."""
    bench_command: str = ""
    """The command behind the bench rows, when a ``command.txt`` beside them gives it (the file has none)."""
    serving: list[dict[str, Any]] = field(default_factory=list)
    """Rows of ``benchmarks/vllm_load.py`` (``kind == "vllm_load"``, in the folder's ``rows.jsonl``)."""
    serving_command: str = ""
    """The commands behind the serving rows (the folder's ``command.txt``)."""

    @property
    def name(self) -> str:
        """The folder name (the file name for a bench file given directly)."""
        return self.path.name

    @property
    def count(self) -> int:
        """Rows of every kind."""
        return len(self.rows) + len(self.ppl) + len(self.bench) + len(self.serving)


BENCH_FILE = "bench.jsonl"
"""The bench rows of a run folder (``kvweave bench --out RUN/bench.jsonl``)."""

_EXPECTED = (
    "a run folder with rows.jsonl, ppl.jsonl or bench.jsonl (`kvweave eval --out`, `kvweave ppl --out`, "
    "`kvweave bench --out`, `benchmarks/vllm_load.py --out`) or a JSONL file of `kvweave bench --out FILE.jsonl` "
    "rows"
)


def load_run(path: str | Path) -> Run:
    """Read a run folder: ``rows.jsonl`` (``kvweave eval``), ``ppl.jsonl`` (``kvweave ppl``) and/or
    ``bench.jsonl`` (``kvweave bench``) required; ``config.json`` and ``command.txt`` optional. A JSONL file
    of ``kvweave bench`` rows can be given directly (its ``command.txt`` is the one in its folder)."""
    folder = Path(path)
    if folder.is_file():
        return load_bench_file(folder)
    rows_path, ppl_path, bench_path = folder / "rows.jsonl", folder / "ppl.jsonl", folder / BENCH_FILE
    if not any(p.is_file() for p in (rows_path, ppl_path, bench_path)):
        what = "does not exist" if not folder.exists() else "has no rows.jsonl, ppl.jsonl or bench.jsonl"
        raise FileNotFoundError(f"{folder} is not a run folder: it {what}; expected {_EXPECTED}")
    meta: dict[str, Any] = {}
    if (folder / "config.json").is_file():
        meta = json.loads((folder / "config.json").read_text())
    config = meta.get("config", {})
    command_path = folder / "command.txt"
    if command_path.is_file() and command_path.read_text().strip():
        command = command_path.read_text().strip()
    else:
        command = eval_command(config, folder) if config else ""
    found = runner.read_rows(rows_path) if rows_path.is_file() else []
    rows = [r for r in found if _is_result(r)]
    serving = serving_rows(found)
    ppl = [r for r in runner.read_rows(ppl_path) if "nll" in r] if ppl_path.is_file() else []
    bench = bench_rows(runner.read_rows(bench_path)) if bench_path.is_file() else []
    for row in rows + ppl:  # rows written before an option was renamed or a default changed: today's spec
        if isinstance(row.get("method"), str):
            options = row.get("options") if isinstance(row.get("options"), dict) else None
            row["method"] = canonical_spec(
                row["method"],
                options,
                version=row.get("spec_version", 1),
                generated=bool(row.get("generated") or row.get("stepwise")),
            )
    for row in bench:  # `kvweave bench` rows: version 2 or later (older ones are of the same vocabulary)
        if isinstance(row.get("method"), str):
            row["method"] = canonical_spec(row["method"], version=row.get("spec_version", 2))
    run = Run(folder, rows, config, meta.get("environment", {}), command, ppl, bench, serving=serving)
    if bench:
        run.bench_command = bench_command(command_path)
    if serving:
        run.serving_command = command
    return run


def load_bench_file(path: Path) -> Run:
    """A JSONL file of ``kvweave bench --out`` rows as a run (named after the file); anything else is refused
    with what was expected."""
    try:
        found = runner.read_rows(path)
    except UnicodeDecodeError:
        found = []
    bench = bench_rows(found)
    if not bench:
        hint = ""
        if any(_is_result(r) or "nll" in r for r in found):
            hint = f" (it holds `kvweave eval`/`kvweave ppl` rows: give their folder {path.parent})"
        raise FileNotFoundError(
            f'{path} is not a bench file: it has no rows with kind "bench"{hint}; expected {_EXPECTED}'
        )
    for row in bench:
        if isinstance(row.get("method"), str):
            row["method"] = canonical_spec(row["method"], version=row.get("spec_version", 2))
    return Run(path, [], bench=bench, bench_command=bench_command(path.parent / "command.txt"))


BENCH_REQUIRED = ("model", "method", "context", "batch", "ms_per_token", "tok_s", "speedup")
"""Fields a bench row must have to be reported (the rest are shown where present)."""


def bench_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``kind == "bench"`` rows that have the fields the report needs."""
    return [r for r in rows if r.get("kind") == "bench" and all(r.get(k) is not None for k in BENCH_REQUIRED)]


OTHER_COMMANDS = ("eval", "ppl", "demo", "generate", "report", "diagnose", "methods", "models")


def bench_command(path: Path) -> str:
    """The lines of ``command.txt`` (when there is one) that may have produced bench rows: every line except
    another ``kvweave`` sub-command's (an eval run folder records its own commands there too)."""
    if not path.is_file():
        return ""
    lines = []
    for line in path.read_text().splitlines():
        words = line.split()
        if not words:
            continue
        if len(words) > 1 and words[0].endswith("kvweave") and words[1] in OTHER_COMMANDS:
            continue
        lines.append(line.strip())
    return "\n".join(lines)


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


def _row_key(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=True)


def unique_rows(runs: Iterable[Run]) -> list[dict[str, Any]]:
    """Every eval row of ``runs`` once: a row copied into another folder to resume beside it (the same row,
    field for field) is a copy, not another trial."""
    seen: set[str] = set()
    rows = []
    for run in runs:
        for row in run.rows:
            key = _row_key(row)
            if key not in seen:
                seen.add(key)
                rows.append(row)
    return rows


def pooled_summary(runs: Iterable[Run]) -> list[dict[str, Any]]:
    """The summaries of ``runs`` for the tables across runs, each row counted once (see :func:`unique_rows`):
    a run's entries cover the rows no earlier run holds, and keep the speed ratio of the run's own summary
    (against the ``full`` rows in its folder, copied or not)."""
    seen: set[str] = set()
    pooled = []
    for run in runs:
        ratios = {
            (e.get("model"), e["method"], e["task"], e["context"]): e["speed_vs_full"]
            for e in run_summary(run)
        }
        fresh = []
        for row in run.rows:
            key = _row_key(row)
            if key not in seen:
                seen.add(key)
                fresh.append(row)
        for entry in runner.summarize(fresh):
            key4 = (entry.get("model"), entry["method"], entry["task"], entry["context"])
            entry["speed_vs_full"] = ratios.get(key4)
            entry["run"] = run.name
            pooled.append(entry)
    return pooled


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


# ----------------------------------------------------------------------------------------- bench


@dataclass
class BenchGroup:
    """The bench rows of one run for one (model, device, dtype): one table, and a pair of charts per batch."""

    run: Run
    model: str
    device: str
    dtype: str
    rows: list[dict[str, Any]]

    @property
    def title(self) -> str:
        """``model, device dtype``."""
        return f"{self.model}, {self.device} {self.dtype}"

    @property
    def batches(self) -> list[int]:
        """Distinct batch sizes, ascending."""
        return sorted({int(r["batch"]) for r in self.rows})

    @property
    def contexts(self) -> list[int]:
        """Distinct context lengths, ascending."""
        return sorted({int(r["context"]) for r in self.rows})


def bench_groups(runs: Iterable[Run]) -> list[BenchGroup]:
    """The bench rows of ``runs``, grouped by run, model, device and dtype (speedups and absolute speeds only
    compare within one machine), in file order within each group."""
    groups: list[BenchGroup] = []
    for run in runs:
        keyed: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
        for row in run.bench:
            keyed[(str(row["model"]), str(row.get("device", "?")), str(row.get("dtype", "?")))].append(row)
        for (model, device, dtype), members in sorted(keyed.items()):
            groups.append(BenchGroup(run, model, device, dtype, members))
    return groups


def bench_key(row: dict[str, Any]) -> tuple[str, int, int]:
    """What one bench point measures: ``(method, context, batch)``."""
    return (str(row["method"]), int(row["context"]), int(row["batch"]))


def latest_bench(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (method, context, batch): the last one written (``kvweave bench --out`` appends, so a
    rerun of a point supersedes the earlier measurement), sorted by context, batch and method."""
    latest: dict[tuple[str, int, int], dict[str, Any]] = {}
    for row in rows:
        latest[bench_key(row)] = row
    return bench_sorted(latest.values())


def bench_sorted(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows by context, batch, then method (``full`` first); file order among repeats."""
    indexed = list(enumerate(rows))
    indexed.sort(
        key=lambda item: (
            int(item[1]["context"]),
            int(item[1]["batch"]),
            method_order(item[1]["method"]),
            item[0],
        )
    )
    return [row for _, row in indexed]


def repeated_points(rows: Iterable[dict[str, Any]]) -> int:
    """How many (method, context, batch) points were measured more than once."""
    counts: dict[tuple[str, int, int], int] = defaultdict(int)
    for row in rows:
        counts[bench_key(row)] += 1
    return sum(1 for n in counts.values() if n > 1)


def distinct(values: Iterable[Any]) -> list[Any]:
    """Distinct values in first-seen order (dicts compared by content)."""
    seen: dict[str, Any] = {}
    for value in values:
        seen.setdefault(json.dumps(value, sort_keys=True, default=str), value)
    return list(seen.values())


BENCH_CSV_COLUMNS = (
    "run",
    "model",
    "method",
    "context",
    "batch",
    "device",
    "dtype",
    "steps",
    "rounds",
    "ms_per_token",
    "tok_s",
    "speedup",
    "bound",
    "of_bound",
    "prefill_s",
    "overhead_s",
    "kv_bytes",
    "kv_read_bytes",
    "full_kv_bytes_16bit",
    "compression",
    "weight_bytes",
    "bandwidth_gb_s",
    "step_bound_ms",
    "peak_bytes",
    "peak_kind",
    "gpu",
    "processor",
    "threads",
    "torch",
    "transformers",
    "git",
)
"""Columns of the bench CSV ``kvweave report --csv`` writes beside the cells CSV (``<stem>-bench.csv``): one
line per bench row, with the machine and versions from its environment."""

BENCH_ENVIRONMENT_FIELDS = ("gpu", "processor", "threads", "torch", "transformers", "git")


def bench_csv(runs: list[Run]) -> str:
    """Every bench row of ``runs`` as CSV, in file order (empty fields where a value is missing)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=BENCH_CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for run in runs:
        for row in run.bench:
            environment = row.get("environment") or {}
            line = {**row, **{k: environment.get(k) for k in BENCH_ENVIRONMENT_FIELDS}, "run": run.name}
            writer.writerow({k: ("" if line.get(k) is None else line.get(k)) for k in BENCH_CSV_COLUMNS})
    return out.getvalue()
