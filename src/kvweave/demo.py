"""``kvweave demo``: every registered method at 4x and 8x against a 16-bit cache, on a real model, in minutes.

Question-agnostic pass-key and multi-key NIAH at one modest context length on the default model
(:data:`kvweave.models.DEFAULT_MODEL`): the document is prefilled and compressed before the question is
seen. It is an ordinary ``kvweave eval`` run (rows in a run folder, resumable), run method by method so each
method's line is printed as soon as its trials are done, followed by a verdict computed from the numbers
just measured, and ``report.html`` + ``summary.md`` + ``summary.csv`` in the run folder.

Budgets are what users budget: bytes against a 16-bit cache. Every method stores the exact tokens it keeps at
16 bits (``storage=auto``), so ``ratio=0.125`` is 8x for every evictor. Methods come from the registry at run
time, each asked for 4x and 8x through its first budget option (``Method.budget_options``): a quarter / an
eighth held, 4x / 8x targeted, a quarter / an eighth attended per step (DK-Cache, whose held bytes are its
INT8 tiers), or 4 / 2 bits (``quant``); a method that is not registered is skipped with a note. The prompt's
exact prefill is recorded once per sample and replayed into every method that attends the prompt exactly.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvweave.models import DEFAULT_MODEL

DEMO_TASKS = ("passkey", "niah_multikey")
"""Retrieval tasks the demo runs (one needle in filler; the asked needle among distractors)."""

LEVELS = (4, 8)
"""Compressions the demo asks every method for, against a 16-bit cache."""

CANDIDATES = ("full", "window", "keydiff", "snapkv", "h2o", "quant", "dkcache", "depthweave")
"""Methods the demo tries, in table order (``full`` once, every other at each of :data:`LEVELS`)."""

NEAR = 0.75
"""A method counts as reaching a level when its measured compression is at least this fraction of it (short
prompts leave fixed costs: a recent window, sinks, page summaries, an exact residual)."""

SHARED_PREFILL_BYTES = 3 << 30
"""Recorded prefills kept for replay across methods (the demo runs method by method)."""


def budget_value(kind: str, level: int) -> float | int | None:
    """The value of a budget option of ``kind`` (``Method.budget_options``) that asks for ``level``x."""
    values: dict[str, float | int] = {
        "held fraction": 1 / level,
        "compression": float(level),
        "attended fraction": 1 / level,
        "bits": 16 // level,
    }
    return values.get(kind)


def _spec(name: str, options: dict[str, Any]) -> str:
    """``name:key=value,...`` (floats written short: 0.25, 4)."""
    text = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in options.items()]
    return name + (":" + ",".join(text) if text else "")


def method_spec(name: str, level: int | None) -> tuple[str | None, str]:
    """``(spec, note)`` for one candidate at ``level``x (``None``: its defaults); ``spec`` is ``None`` when
    the method is not registered or has no budget option that asks for ``level``x."""
    import kvweave.methods  # noqa: F401  (registers the built-in methods)
    from kvweave.registry import METHODS, parse_method

    cls = METHODS.get(name)
    if cls is None:
        return None, f"{name}: not registered, skipped"
    if level is None:
        return name, ""
    for option_name, kind in cls.budget_options.items():
        value = budget_value(kind, level)
        if value is None:
            continue
        spec = _spec(name, {option_name: value})
        try:
            parse_method(spec)
        except ValueError as err:
            return None, f"{name}: {option_name}={value:g} for {level}x is refused ({err}); skipped"
        return spec, ""
    return None, f"{name}: no budget option asks for {level}x (kinds {sorted(cls.budget_options.values())})"


def default_methods() -> tuple[list[str], list[str]]:
    """``(specs, notes)``: ``full`` and the registered candidates at each of :data:`LEVELS`, with a note per
    skipped one."""
    specs, notes = [], []
    for name in CANDIDATES:
        for level in (None,) if name == "full" else LEVELS:
            spec, note = method_spec(name, level)
            if spec is not None and spec not in specs:
                specs.append(spec)
            if note and note not in notes:
                notes.append(note)
    return specs, notes


def default_out(model: str, context: int) -> Path:
    """``runs/demo-<model>-<context>`` (a model folder contributes its last path component)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model).name or model).strip("-")
    return Path("runs") / f"demo-{slug}-{context}"


# ----------------------------------------------------------------------------------------- table + verdict


def method_lines(summary: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method (in first-seen order): accuracy per task, mean accuracy, the least compression over its
    tasks (against a 16-bit cache, from the bytes held), held MiB, median decode tok/s and the ratio to
    ``full``'s."""
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in summary:
        by_method[entry["method"]].append(entry)
    full_speed = _median([e["decode_tok_s"] for e in by_method.get("full", []) if e.get("decode_tok_s")])
    lines = {}
    for method, entries in by_method.items():
        speed = _median([e["decode_tok_s"] for e in entries if e.get("decode_tok_s")])
        lines[method] = {
            "tasks": {e["task"]: e["accuracy"] for e in entries},
            "n": sum(e["n"] for e in entries),
            "accuracy": sum(e["accuracy"] * e["n"] for e in entries) / sum(e["n"] for e in entries),
            "compression": min((e["compression"] or 0.0) for e in entries),
            "mib": max(e["kv_bytes"] for e in entries) / 2**20,
            "tok_s": speed,
            "vs_full": speed / full_speed if speed and full_speed else None,
        }
    return lines


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def table_header(tasks: Sequence[str]) -> str:
    """The header of the demo's table (one line per method)."""
    cells = "".join(f" {task:>13}" for task in tasks)
    return f"{'method':<30}{cells} {'KV MiB':>7} {'vs 16-bit':>9} {'tok/s':>6} {'vs full':>7}"


def table_line(method: str, line: dict[str, Any], tasks: Sequence[str]) -> str:
    """One method's line: accuracy per task, MiB held, compression against 16-bit, decode speed."""
    scores = [f"{100 * line['tasks'][t]:.0f}%" if t in line["tasks"] else "-" for t in tasks]
    cells = "".join(f" {score:>13}" for score in scores)
    speed = f"{line['tok_s']:.1f}" if line["tok_s"] else "-"
    ratio = f"{line['vs_full']:.2f}x" if line["vs_full"] else "-"
    return f"{method:<30}{cells} {line['mib']:>7.2f} {line['compression']:>8.2f}x {speed:>6} {ratio:>7}"


def _named(method: str, line: dict[str, Any]) -> str:
    speed = f", decode {line['vs_full']:.2f}x of full" if line["vs_full"] else ""
    return f"{method} ({line['compression']:.1f}x, {100 * line['accuracy']:.0f}%{speed})"


def verdict(
    summary: list[dict[str, Any]], context: int, trials: int, labels: dict[str, str] | None = None
) -> str:
    """One paragraph from the numbers just measured: which methods kept ``full``'s accuracy at which measured
    compression (at least :data:`NEAR` of each level), which did not, and the fastest decode. ``labels`` names a
    row's method as it was asked for (``quant:bits=4`` for the row ``quant``)."""
    lines = {(labels or {}).get(m, m): v for m, v in method_lines(summary).items()}
    full = lines.get("full")
    if full is None:
        return "Verdict: no `full` rows, so nothing to compare against."
    parts = [
        f"Verdict ({trials} trials per task at {context} tokens, just measured): full scored "
        f"{100 * full['accuracy']:.0f}% and holds the model's float32 ({full['compression']:.2f}x of a "
        "16-bit cache)."
    ]
    others = {m: v for m, v in lines.items() if m != "full"}
    placed: set[str] = set()
    for level in sorted(LEVELS, reverse=True):
        here = {m: v for m, v in others.items() if v["compression"] >= NEAR * level and m not in placed}
        placed |= set(here)
        if not here:
            continue
        kept = sorted((m for m, v in here.items() if v["accuracy"] >= full["accuracy"] - 1e-9), key=str)
        lost = sorted((m for m in here if m not in kept), key=lambda m: -here[m]["accuracy"])
        text = f"At about {level}x of a 16-bit cache (measured {NEAR * level:g}x or more), "
        text += (
            ", ".join(_named(m, here[m]) for m in kept) + " kept full's accuracy"
            if kept
            else "no method kept full's accuracy"
        )
        if lost:
            text += "; " + ", ".join(_named(m, here[m]) for m in lost) + " did not"
        parts.append(text + ".")
    rest = {m: v for m, v in others.items() if m not in placed}
    if rest:
        text = f"Below {NEAR * min(LEVELS):g}x held: " + ", ".join(_named(m, v) for m, v in rest.items())
        if any(m.startswith("dkcache") for m in rest):
            text += (
                " (DK-Cache's budget is the fraction each decode step attends; it holds every token, its "
                "steady and far tiers at INT8)"
            )
        parts.append(text + ".")
    timed = {m: v for m, v in others.items() if v["vs_full"]}
    if timed:
        fastest = max(timed, key=lambda m: timed[m]["vs_full"])
        parts.append(
            f"Fastest decode: {fastest} at {timed[fastest]['vs_full']:.2f}x of full (short answers at "
            f"{context} tokens: speed is dominated by the weights here; `kvweave bench` measures it at 16K)."
        )
    parts.append("Longer contexts and more tasks: docs/results.md.")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------- run


class LinePrinter:
    """Prints each method's table line as soon as all its trials are done (``on_row`` of the runner)."""

    def __init__(
        self,
        expected: int,
        tasks: Sequence[str],
        write: Callable[[str], None],
        labels: dict[str, str] | None = None,
    ) -> None:
        self.expected, self.tasks, self.write = expected, list(tasks), write
        self.labels = labels or {}
        self.rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.printed: set[str] = set()

    def header(self) -> None:
        self.write(table_header(self.tasks))

    def __call__(self, row: dict[str, Any]) -> None:
        from kvweave.eval import runner

        self.rows[row["method"]].append(row)
        if len(self.rows[row["method"]]) < self.expected or row["method"] in self.printed:
            return
        self.printed.add(row["method"])
        done = [r for rows in self.rows.values() for r in rows]
        lines = method_lines(runner.summarize(done))
        label = self.labels.get(row["method"], row["method"])
        self.write(table_line(label, lines[row["method"]], self.tasks))


def run_demo(
    model: str = DEFAULT_MODEL,
    context: int = 1024,
    trials: int = 2,
    methods: Sequence[str] | None = None,
    out: str | Path | None = None,
    dtype: str = "float32",
    max_new_tokens: int = 10,
    command: str | None = None,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], Path, dict[str, str]]:
    """Run the demo; returns the summary (with speed ratios), the run folder and the label of each row's
    method (the spec as asked for).

    Prints each method's line when its trials are done (to stdout, the progress bar on stderr). Writes
    ``rows.jsonl``, ``config.json``, ``command.txt`` (``command``, else the equivalent ``kvweave demo``
    line), ``report.html``, ``summary.md`` and ``summary.csv`` into the run folder; a rerun resumes.
    """
    from tqdm import tqdm

    from kvweave.eval import runner
    from kvweave.report import write_report

    notes: list[str] = []
    from kvweave.registry import parse_method

    if methods:
        specs = list(methods)
    else:
        specs, notes = default_methods()
    labels = {parse_method(spec).spec(): spec for spec in specs}  # rows name a method without its defaults
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    config = runner.EvalConfig(
        model=model,
        tasks=list(DEMO_TASKS),
        contexts=[context],
        methods=specs,
        trials=trials,
        dtype=dtype,
        max_new_tokens=max_new_tokens,
        order="method",
    )
    folder = Path(out) if out else default_out(model, context)
    todo = runner.plan(config)
    done = runner.finished_keys(folder / "rows.jsonl")
    left = sum(t.key() not in done for t in todo)
    print(
        f"demo: {len(specs)} methods x {len(DEMO_TASKS)} tasks x {trials} trials at {context} tokens on "
        f"{model} = {len(todo)} trials ({left} to run; the progress bar shows the ETA)\n"
        f"methods: {', '.join(specs)}\nrun folder: {folder}\n"
        "Each method's line prints when its trials are done (KV MiB: bytes held; vs 16-bit: a 16-bit cache's "
        "bytes / those; tok/s: median decode speed).",
        file=sys.stderr,
    )
    folder.mkdir(parents=True, exist_ok=True)
    if command is None:
        command = demo_command(
            model, context, trials, specs if methods else None, folder, dtype, max_new_tokens
        )
    (folder / "command.txt").write_text(command + "\n")
    printer = LinePrinter(len(DEMO_TASKS) * trials, DEMO_TASKS, tqdm.write, labels)
    printer.header()
    for row in runner.read_rows(folder / "rows.jsonl") if (folder / "rows.jsonl").is_file() else []:
        if row.get("key") in {t.key() for t in todo}:
            printer(row)  # a resumed run prints what it already has
    rows = runner.run(
        config, out_dir=folder, progress=progress, on_row=printer, shared_bytes=SHARED_PREFILL_BYTES
    )
    summary = runner.add_speed_ratios(runner.summarize(rows))
    write_report([folder], folder / "report.html", markdown=folder / "summary.md", csv=folder / "summary.csv")
    return summary, folder, labels


def demo_command(
    model: str,
    context: int,
    trials: int,
    methods: Sequence[str] | None,
    out: Path,
    dtype: str = "float32",
    max_new_tokens: int = 10,
) -> str:
    """The ``kvweave demo`` command line that reproduces a run (written to ``command.txt``)."""
    parts = ["kvweave", "demo", "--model", model, "--context", str(context), "--trials", str(trials)]
    if methods:
        parts += ["--methods", ",".join(methods)]
    if dtype != "float32":
        parts += ["--dtype", dtype]
    if max_new_tokens != 10:
        parts += ["--max-new-tokens", str(max_new_tokens)]
    return shlex.join([*parts, "--out", str(out)])
