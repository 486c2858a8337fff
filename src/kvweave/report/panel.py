"""The "which method for which need" panel at the top of the HTML page, computed from the rows by
:mod:`kvweave.report.guide` (the logic the markdown guide uses): the best accuracy within each byte budget
per task group, the most compression at no loss, the fastest decode and the prefill cost at each context
length, and, with ``kvweave bench`` rows, the fastest method of each bench point. Every cell names the method
spec and the numbers behind it."""

from __future__ import annotations

from html import escape
from typing import Any

from kvweave.report import data, guide
from kvweave.report.data import Run


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _code(method: str) -> str:
    return f"<code>{escape(method)}</code>"


def _cell(method: str, detail: str, css: str = "") -> str:
    klass = f' class="pick {css}"' if css else ' class="pick"'
    return f"<td{klass}>{_code(method)}<br><small>{escape(detail)}</small></td>"


def _empty(text: str) -> str:
    return f'<td class="pick none"><small>{escape(text)}</small></td>'


def _table(head: list[str], rows: list[str]) -> str:
    header = "".join(f'<th class="name">{escape(h)}</th>' for h in head)
    return f'<table class="guide"><tr>{header}</tr>{"".join(rows)}</table>'


def _where(length: guide.Length, several_models: bool) -> list[str]:
    cells = [f'<td class="name">{escape(length.label)}</td>']
    return cells + ([f'<td class="name">{escape(str(length.model))}</td>'] if several_models else [])


def _versus(line: dict[str, Any], full: dict[str, Any] | None) -> str:
    """``mean 95% vs full 100% on 2 shared tasks (8 trials)``."""
    if full is None:
        columns = guide.scored(line)
        return f"mean {_pct(guide.mean_score(line, columns))} over {len(columns)} task(s), no full to compare"
    columns = guide.shared(line, full)
    if not columns:
        return "no task in common with full"
    return (
        f"mean {_pct(guide.mean_score(line, columns))} vs full {_pct(guide.mean_score(full, columns))} on "
        f"{len(columns)} shared task{'s' if len(columns) != 1 else ''} ({guide.trials(line, columns)} trials)"
    )


def _no_loss_kind(line: dict[str, Any], full: dict[str, Any] | None) -> str:
    points = guide.drop(line, full) if full is not None else None
    if points is None:
        return ""
    return "ok" if points <= guide.NO_LOSS_POINTS + 1e-9 else "loss"


# ----------------------------------------------------------------------------------------- budgets


def _budget_cell(pick: guide.BudgetPick | None, budget: float) -> str:
    if pick is None:
        return _empty(f"no method holds \u2264 1/{budget:g} of the bytes here")
    full = "" if pick.full_score is None else f" vs full {_pct(pick.full_score)}"
    detail = (
        f"{_pct(pick.score)}{full} on {len(pick.columns)}/{pick.group_tasks} task"
        f"{'s' if pick.group_tasks != 1 else ''} ({pick.trials} trials), {pick.line['compression']:.2f}x"
    )
    css = ""
    if pick.full_score is not None:
        css = "ok" if 100 * (pick.full_score - pick.score) <= guide.NO_LOSS_POINTS + 1e-9 else "loss"
    cell = _cell(pick.line["method"], detail, css)
    other = pick.better_on_fewer
    if other is None:
        return cell
    more = (
        f"<br><small>higher on fewer tasks: </small>{_code(other.line['method'])}<small> "
        f"{_pct(other.score)} on {len(other.columns)}/{pick.group_tasks} ({other.trials} trials), "
        f"{other.line['compression']:.2f}x</small></td>"
    )
    return cell.removesuffix("</td>") + more


def budget_table(summary: list[dict[str, Any]], several_models: bool) -> str:
    """Per context length, model and task group: ``full``'s score and the best method within each budget."""
    head = [
        "context",
        *(["model"] if several_models else []),
        "task group (tasks)",
        "full (16-bit reference)",
    ]
    head += [f"\u2264 1/{b:g} of a 16-bit cache (~{b:g}x)" for b in guide.BUDGETS]
    rows = []
    for length in guide.lengths(summary):
        for group, columns in guide.groups(length.lines).items():
            names = escape(", ".join(guide.task_of(c) for c in columns))
            cells = [
                *_where(length, several_models),
                f'<td class="name">{escape(group)} <small>({names})</small></td>',
            ]
            full = length.full
            own = [c for c in columns if full is not None and c in guide.scored(full)]
            if full is not None and own:
                cells.append(
                    f'<td class="pick"><small>{_pct(guide.mean_score(full, own))} on {len(own)} task'
                    f"{'s' if len(own) != 1 else ''} ({guide.trials(full, own)} trials), "
                    f"{_num(full['compression'])}</small></td>"
                )
            else:
                cells.append(_empty("not run"))
            for budget in guide.BUDGETS:
                cells.append(_budget_cell(guide.budget_pick(length.lines, full, columns, budget), budget))
            rows.append(f"<tr>{''.join(cells)}</tr>")
    return _table(head, rows)


# ----------------------------------------------------------------------------------------- per length


def _speed_detail(summary: list[dict[str, Any]], line: dict[str, Any], length: guide.Length) -> str:
    cells, trials = guide.speed_cells(summary, line, length.context)
    against = "kvpress's baseline" if line["method"].startswith("kvpress:") else "full"
    where = f"median of {cells} cells" if cells > 1 else "1 cell"
    return (
        f"decodes at {line['speed_vs_full']:.2f}x {against} ({where}, {trials} trials), "
        f"{_versus(line, length.full)}"
    )


def _no_loss_cell(length: guide.Length) -> str:
    if length.full is None:
        return _empty("no full rows to compare against")
    pick = guide.no_loss(length.lines, length.full)
    if pick.line is None:
        if not pick.compressing:
            return _empty(f"no method holds fewer bytes than full ({length.full['compression']:.2f}x)")
        return _empty("no compressing method shares a task with full")
    detail = f"{pick.line['compression']:.2f}x, {_versus(pick.line, length.full)}"
    if not pick.qualified:
        return _cell(
            pick.line["method"], f"none within {guide.NO_LOSS_POINTS:g} points; closest: {detail}", "loss"
        )
    return _cell(pick.line["method"], detail, "ok")


def _fastest_cell(summary: list[dict[str, Any]], line: dict[str, Any] | None, length: guide.Length) -> str:
    if line is None:
        return _empty("no decode speed measured against full")
    return _cell(line["method"], _speed_detail(summary, line, length), _no_loss_kind(line, length.full))


def length_table(summary: list[dict[str, Any]], several_models: bool) -> str:
    """Per context length and model: the most compression at no loss, the fastest decode overall and at no
    loss."""
    head = ["context", *(["model"] if several_models else [])]
    head += [
        "most compression at no loss",
        "fastest decode",
        f"fastest decode within {guide.NO_LOSS_POINTS:g} points of full",
    ]
    rows = []
    for length in guide.lengths(summary):
        timed = guide.timed(length.lines)
        no_loss_fast = guide.fastest_at_no_loss(length.lines, length.full)
        cells = [
            *_where(length, several_models),
            _no_loss_cell(length),
            _fastest_cell(summary, guide.fastest(timed), length),
            _fastest_cell(summary, no_loss_fast, length)
            if no_loss_fast is not None or length.full is None or not timed
            else _empty(f"no timed method within {guide.NO_LOSS_POINTS:g} points of full"),
        ]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return _table(head, rows)


def _prefill_cell(cost: guide.Prefill | None, length: guide.Length) -> str:
    if cost is None:
        return _empty("-")
    line = _line(length, cost.method)
    where = f"median of {cost.cells} cells" if cost.cells > 1 else "1 cell"
    detail = f"{cost.ratio:.2f}x full's prefill time ({where}), {_num(line['compression'])} compression"
    return _cell(cost.method, detail)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def prefill_table(summary: list[dict[str, Any]], several_models: bool) -> str:
    """Per context length and model: ``full``'s prefill seconds, the cheapest and the costliest prefill of a
    compressing method, and the prefill of the no-loss pick, as ratios against ``full`` in the same run."""
    ratios = guide.prefill_ratios(summary)
    head = ["context", *(["model"] if several_models else [])]
    head += [
        "full's prefill (median s)",
        "cheapest prefill",
        "costliest prefill",
        "prefill of the no-loss pick",
    ]
    rows = []
    for length in guide.lengths(summary):
        costs = guide.prefill_costs(ratios, length)
        floor = (length.full or {}).get("compression") or 0.0
        compressing = [c for c in costs.values() if (_line(length, c.method)["compression"] or 0.0) > floor]
        pick = guide.no_loss(length.lines, length.full) if length.full is not None else None
        chosen = costs.get(pick.line["method"]) if pick and pick.qualified and pick.line else None
        seconds = guide.full_prefill_s(summary, length)
        cells = [
            *_where(length, several_models),
            f'<td class="pick"><small>{"-" if seconds is None else f"{seconds:.2f} s"}</small></td>',
            _prefill_cell(min(compressing, key=lambda c: c.ratio) if compressing else None, length),
            _prefill_cell(max(compressing, key=lambda c: c.ratio) if compressing else None, length),
            _prefill_cell(chosen, length) if chosen else _empty("no no-loss pick"),
        ]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return _table(head, rows)


def _line(length: guide.Length, method: str) -> dict[str, Any]:
    return next(line for line in length.lines if line["method"] == method)


# ----------------------------------------------------------------------------------------- bench


def bench_fastest_table(runs: list[Run]) -> str:
    """Per bench group, batch and context length: the method with the highest speedup against ``full``
    measured in the same point (empty without bench rows)."""
    rows = []
    for group in data.bench_groups(runs):
        shown = data.latest_bench(group.rows)
        for batch in group.batches:
            for context in group.contexts:
                point = [
                    r
                    for r in shown
                    if int(r["batch"]) == batch
                    and int(r["context"]) == context
                    and r["method"] not in data.REFERENCE_METHODS
                ]
                if not point:
                    continue
                best = max(point, key=lambda r: float(r["speedup"]))
                bound = "" if best.get("bound") is None else f" (bound {best['bound']:.2f}x)"
                compression = (
                    "" if best.get("compression") is None else f", {best['compression']:.2f}x compression"
                )
                detail = f"{best['speedup']:.2f}x full's decode speed{bound}{compression}, {_speed_of(best)}"
                cells = [
                    f'<td class="name">{escape(group.title)}</td>',
                    f'<td class="name">{batch}</td>',
                    f'<td class="name">{escape(data.column_label("", context).strip())}</td>',
                    _cell(str(best["method"]), detail),
                ]
                rows.append(f"<tr>{''.join(cells)}</tr>")
    if not rows:
        return ""
    return _table(["bench (model, device dtype)", "batch", "context", "fastest decode (kvweave bench)"], rows)


def _speed_of(row: dict[str, Any]) -> str:
    return f"{float(row['tok_s']):.1f} tok/s"


RULES = (
    "Computed from the rows of this report. <b>Byte budget</b>: a method fits \u2264 1/N of a 16-bit cache when "
    "its compression against a 16-bit cache of the same tokens is at least {slack:.0%} of N; among the methods "
    "that fit and were run on the most of the group's tasks, the best mean per-task score (ties: more "
    "compression). <b>No loss</b>: a mean score over the tasks shared with <code>full</code> at most "
    "{points:g} points below <code>full</code>'s (green; red: more). <b>Decode speed</b> and <b>prefill</b> "
    "are ratios against <code>full</code> on the same prompts in the same run (kvpress presses: against "
    "kvpress's uncompressed baseline), the median over cells (one per run and task). With 3 trials, one "
    "answer moves a task's score by 33 points."
)


def panel(runs: list[Run], summary: list[dict[str, Any]]) -> str:
    """The whole panel (empty when there is nothing to recommend from)."""
    bench = bench_fastest_table(runs)
    if not summary and not bench:
        return ""
    several = len({entry.get("model") for entry in summary}) > 1
    rules = RULES.format(slack=1 - guide.BUDGET_SLACK, points=guide.NO_LOSS_POINTS)
    parts = ['<section id="guide"><h2>Which method for which need</h2>', f'<p class="note">{rules}</p>']
    note = data.metric_note(entry["task"] for entry in summary)
    if note:
        parts.append(f'<p class="note">{escape(note)}</p>')
    if summary:
        parts += [
            "<h3>Best accuracy within a byte budget</h3>",
            budget_table(summary, several),
            "<h3>Compression and decode speed at each context length</h3>",
            length_table(summary, several),
            "<h3>Prefill cost</h3>",
            prefill_table(summary, several),
        ]
    if bench:
        parts += ["<h3>Fastest decode in kvweave bench</h3>", bench]
    parts.append("</section>")
    return "\n".join(parts)
