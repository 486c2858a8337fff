"""Which method for which need: the recommendations computed from result rows, shared by the markdown guide
(:func:`kvweave.report.markdown.guide_markdown`) and the HTML panel at the top of the page.

Everything works on :func:`kvweave.report.data.overview` lines of one context length and model (a method's
accuracy per task, mean compression against a 16-bit cache, median decode-speed ratio against ``full`` in the
same run), plus per-run prefill ratios:

- **most compression at no loss**: the highest compression whose mean score over the tasks shared with
  ``full`` is at most :data:`NO_LOSS_POINTS` below ``full``'s;
- **best accuracy within a byte budget**: per task group, the best mean score among the methods holding at
  most 1/4 (1/8, ...) of a 16-bit cache's bytes (:data:`BUDGETS`, with :data:`BUDGET_SLACK`);
- **fastest decode**: the highest median decode-speed ratio against ``full`` measured in the same run;
- **prefill cost**: prefill time as a ratio against ``full``'s on the same prompts in the same run.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvweave.report import data

NO_LOSS_POINTS = 5.0
"""No loss: a method's mean score over the tasks it shares with ``full`` is at most this many points
(of 100) below ``full``'s mean over the same tasks."""

BUDGETS = (4.0, 8.0)
"""Byte budgets, as compression against a 16-bit cache of the same tokens: 4x = a quarter of its bytes."""

BUDGET_SLACK = 0.15
"""A method fits a budget when its compression is at least ``(1 - BUDGET_SLACK)`` of it (3.4x counts as ~4x:
sink and recent tokens, page rounding and metadata keep real compressions a little under the nominal one)."""

TASK_GROUPS = (
    ("retrieval", ("passkey", "niah_")),
    ("tracing and aggregation", ("vt", "cwe", "fwe")),
    ("question answering", ("qa_",)),
    ("code", ("code",)),
)
"""Task groups of the byte-budget table: a task belongs to the first group one of whose names it equals or,
for names ending in ``_``, starts with; any other task is a group of its own."""


def task_group(task: str) -> str:
    """The group of ``task`` (:data:`TASK_GROUPS`), or the task itself."""
    for group, names in TASK_GROUPS:
        if any(task == name or (name.endswith("_") and task.startswith(name)) for name in names):
            return group
    return task


def mean(values: Iterable[float]) -> float:
    """The mean of a non-empty sequence."""
    values = list(values)
    return sum(values) / len(values)


def task_of(column: str) -> str:
    """``passkey 4K`` -> ``passkey``."""
    return column.rsplit(" ", 1)[0]


def scored(line: dict[str, Any]) -> list[str]:
    """The task columns ``line`` has a score for."""
    return [c for c, accuracy in line["accuracy"].items() if accuracy is not None and line["n"].get(c)]


def shared(line: dict[str, Any], full: dict[str, Any]) -> list[str]:
    """The task columns both ``line`` and ``full`` have scores for."""
    theirs = set(scored(full))
    return [column for column in scored(line) if column in theirs]


def mean_score(line: dict[str, Any], columns: list[str]) -> float:
    """``line``'s mean per-task score over ``columns``."""
    return mean(line["accuracy"][c] for c in columns)


def trials(line: dict[str, Any], columns: list[str]) -> int:
    """``line``'s trials over ``columns``."""
    return sum(line["n"][c] for c in columns)


def drop(line: dict[str, Any], full: dict[str, Any]) -> float | None:
    """Points (of 100) ``line``'s mean score lies below ``full``'s over their shared tasks (None: none)."""
    columns = shared(line, full)
    return 100 * (mean_score(full, columns) - mean_score(line, columns)) if columns else None


def is_reference(line: dict[str, Any]) -> bool:
    """``full`` or kvpress's uncompressed baseline."""
    return line["method"] in data.REFERENCE_METHODS


@dataclass
class Length:
    """The overview lines of one context length and model, with its ``full`` line when there is one."""

    context: int
    model: Any
    lines: list[dict[str, Any]]
    full: dict[str, Any] | None

    @property
    def label(self) -> str:
        """``4K``."""
        return data.column_label("", self.context).strip()


def lengths(summary: list[dict[str, Any]]) -> Iterator[Length]:
    """Per context length (ascending), then model (in overview order): its overview lines."""
    for context in sorted({entry["context"] for entry in summary}):
        _, lines = data.overview(summary, context)
        by_model: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for line in lines:
            by_model[line["model"]].append(line)
        for model, model_lines in by_model.items():
            full = next((line for line in model_lines if line["method"] == "full"), None)
            yield Length(context, model, model_lines, full)


# ----------------------------------------------------------------------------------------- no loss


@dataclass
class NoLoss:
    """The most-compression-at-no-loss pick of one length: ``line`` qualifies when ``qualified``, else it is the
    closest candidate (None when there is none); ``compressing`` and ``candidates`` say why not."""

    line: dict[str, Any] | None
    drop: float | None
    qualified: bool
    compressing: int
    candidates: int


def no_loss(lines: list[dict[str, Any]], full: dict[str, Any]) -> NoLoss:
    """Among the methods holding fewer bytes than ``full``, the most compressed one at most
    :data:`NO_LOSS_POINTS` below it (else the one closest to it)."""
    floor = full["compression"] or 0.0
    compressing = [line for line in lines if not is_reference(line) and (line["compression"] or 0) > floor]
    candidates = [(line, points) for line in compressing if (points := drop(line, full)) is not None]
    qualified = [(line, points) for line, points in candidates if points <= NO_LOSS_POINTS + 1e-9]
    if qualified:
        line, points = max(qualified, key=lambda q: (q[0]["compression"], -q[1]))
        return NoLoss(line, points, True, len(compressing), len(candidates))
    if candidates:
        line, points = min(candidates, key=lambda c: (c[1], -c[0]["compression"]))
        return NoLoss(line, points, False, len(compressing), len(candidates))
    return NoLoss(None, None, False, len(compressing), 0)


# ----------------------------------------------------------------------------------------- speed


def timed(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The methods (not the references) with a decode-speed ratio against ``full``."""
    return [line for line in lines if not is_reference(line) and line["speed_vs_full"] is not None]


def fastest(candidates: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The line with the highest decode-speed ratio (None for none)."""
    return max(candidates, key=lambda line: line["speed_vs_full"]) if candidates else None


def fastest_at_no_loss(lines: list[dict[str, Any]], full: dict[str, Any] | None) -> dict[str, Any] | None:
    """The fastest method whose mean score is at most :data:`NO_LOSS_POINTS` below ``full``'s."""
    if full is None:
        return None
    kept = [
        line
        for line in timed(lines)
        if (points := drop(line, full)) is not None and points <= NO_LOSS_POINTS + 1e-9
    ]
    return fastest(kept)


def speed_cells(summary: list[dict[str, Any]], line: dict[str, Any], context: int) -> tuple[int, int]:
    """``(cells, trials)`` behind a line's median speed ratio at ``context``."""
    cells = [
        e
        for e in summary
        if e.get("model") == line["model"]
        and e["method"] == line["method"]
        and e["context"] == context
        and e.get("speed_vs_full") is not None
    ]
    return len(cells), sum(e["n"] for e in cells)


# ----------------------------------------------------------------------------------------- budgets


@dataclass
class Scored:
    """A method's mean score over some task columns."""

    line: dict[str, Any]
    columns: list[str]
    score: float
    trials: int


@dataclass
class BudgetPick(Scored):
    """The best method of one task group within one byte budget, with ``full``'s score on the same tasks and,
    when one scores higher on fewer of the group's tasks, that one too (``better_on_fewer``)."""

    group_tasks: int = 0
    full_score: float | None = None
    full_trials: int = 0
    better_on_fewer: Scored | None = None


def groups(lines: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The task columns that any line scores, by task group (in :data:`TASK_GROUPS` order)."""
    found: dict[str, list[str]] = defaultdict(list)
    for column in sorted({c for line in lines for c in scored(line)}):
        found[task_group(task_of(column))].append(column)
    order = [name for name, _ in TASK_GROUPS]
    return dict(sorted(found.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else 99, kv[0])))


def fits(line: dict[str, Any], budget: float) -> bool:
    """Whether ``line`` holds at most ``1 / budget`` of a 16-bit cache's bytes (with :data:`BUDGET_SLACK`)."""
    return not is_reference(line) and (line["compression"] or 0.0) >= budget * (1 - BUDGET_SLACK) - 1e-9


def _best(candidates: list[Scored]) -> Scored:
    """The highest score (ties: more compression, then more trials)."""
    return max(candidates, key=lambda c: (c.score, c.line["compression"], c.trials))


def budget_pick(
    lines: list[dict[str, Any]], full: dict[str, Any] | None, columns: list[str], budget: float
) -> BudgetPick | None:
    """Among the methods within ``budget`` run on the most of ``columns``: the best mean score (ties: more
    compression, then more trials). None when no method fits."""
    covered = []
    for line in lines:
        own = [c for c in scored(line) if c in columns]
        if own and fits(line, budget):
            covered.append(Scored(line, own, mean_score(line, own), trials(line, own)))
    if not covered:
        return None
    most = max(len(c.columns) for c in covered)
    best = _best([c for c in covered if len(c.columns) == most])
    fewer = [c for c in covered if len(c.columns) < most and c.score > best.score]
    theirs = [c for c in best.columns if full is not None and c in scored(full)]
    return BudgetPick(
        best.line,
        best.columns,
        best.score,
        best.trials,
        group_tasks=len(columns),
        full_score=mean_score(full, theirs) if full is not None and theirs else None,
        full_trials=trials(full, theirs) if full is not None and theirs else 0,
        better_on_fewer=_best(fewer) if fewer else None,
    )


# ----------------------------------------------------------------------------------------- prefill


def prefill_ratios(summary: list[dict[str, Any]]) -> dict[tuple[Any, str, int], list[float]]:
    """Per (model, method, context), the prefill-time ratios against the reference method on the same task
    in the same run (``full``, or kvpress's uncompressed baseline in a kvpress run), one per cell."""
    reference: dict[tuple[Any, ...], float] = {}
    for entry in summary:
        if entry["method"] in data.REFERENCE_METHODS and entry.get("prefill_s"):
            key = (entry.get("run"), entry.get("model"), entry["task"], entry["context"])
            reference.setdefault(key, entry["prefill_s"])
    ratios: dict[tuple[Any, str, int], list[float]] = defaultdict(list)
    for entry in summary:
        base = reference.get((entry.get("run"), entry.get("model"), entry["task"], entry["context"]))
        if base and entry.get("prefill_s") is not None:
            ratios[(entry.get("model"), entry["method"], entry["context"])].append(entry["prefill_s"] / base)
    return ratios


@dataclass
class Prefill:
    """A method's median prefill ratio against ``full`` at one length, and the cells behind it."""

    method: str
    ratio: float
    cells: int


def prefill_costs(ratios: dict[tuple[Any, str, int], list[float]], length: Length) -> dict[str, Prefill]:
    """Every method of ``length`` with a prefill ratio (references excluded), by method spec."""
    costs = {}
    for line in length.lines:
        found = ratios.get((length.model, line["method"], length.context))
        if found and not is_reference(line):
            costs[line["method"]] = Prefill(line["method"], statistics.median(found), len(found))
    return costs


def full_prefill_s(summary: list[dict[str, Any]], length: Length) -> float | None:
    """``full``'s median prefill seconds at ``length`` (None without ``full`` rows)."""
    values = [
        e["prefill_s"]
        for e in summary
        if e["method"] == "full"
        and e.get("model") == length.model
        and e["context"] == length.context
        and e.get("prefill_s") is not None
    ]
    return statistics.median(values) if values else None
