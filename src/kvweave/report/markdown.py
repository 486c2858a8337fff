"""The markdown summary: a contents list, a "which method for which need" guide computed from the rows,
the overview and per-run tables, with the command that produced each run."""

from __future__ import annotations

import re
from typing import Any

from kvweave.report import data, guide, page
from kvweave.report.cells import BENCH_HEADER, PPL_HEADER, _num, bench_cells, markdown_table, ppl_cells
from kvweave.report.data import Run
from kvweave.report.guide import NO_LOSS_POINTS
from kvweave.report.serving import serving_markdown


def _table(header: list[str], lines: list[list[str]], align: list[str]) -> str:
    return markdown_table(header, lines, align)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


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


def perplexity_markdown(entries: list[dict[str, Any]]) -> str:
    """The perplexity table (``kvweave ppl`` runs): each window's prefix is prefilled and compressed, then its
    last tokens are scored through the same cache."""
    return _table(PPL_HEADER, [ppl_cells(e) for e in entries], ["l", "l", "r", "l", "r", "r", "r", "r"])


BENCH_INTRO = (
    "Measured by `kvweave bench`: per context length and batch size every method prefills the same prompt, "
    "then decodes in rounds interleaved with `full`; ms/token is the median over rounds. Speedup is `full`'s "
    "step time over the method's, measured in the same run; the bound (W + KV read by full) / (W + KV read) is "
    "the most a step that is bound by the bytes it reads can gain, and achieved/bound = speedup / bound. "
    "Overhead is prefill time beyond `full`'s (what compressing costs)."
)


def bench_markdown(runs: list[Run]) -> str:
    """The "Decode speed" section: per run, model, device and dtype, the command (when a ``command.txt``
    beside the bench rows gives it), the machine and the table; empty without bench rows."""
    groups = data.bench_groups(runs)
    if not groups:
        return ""
    several_runs = len({id(g.run) for g in groups}) > 1
    parts = ["## Decode speed", "", BENCH_INTRO, ""]
    for group in groups:
        shown = data.latest_bench(group.rows)
        heading = group.title + (f" ({group.run.name})" if several_runs else "")
        parts += [f"### {heading}", ""]
        if group.run.bench_command:
            parts += ["Produced by:", "", "```sh", group.run.bench_command, "```", ""]
        else:
            parts += [
                f"From `{group.run.path}`; the command is not recorded (`kvweave bench` writes none: a "
                "`command.txt` beside the file is shown here).",
                "",
            ]
        parts += [f"Measured on: {line}." for line in page.bench_hardware(shown)]
        parts += ["", _table(BENCH_HEADER, [bench_cells(r) for r in shown], ["l"] + ["r"] * 12), ""]
        notes = page.bench_notes(group.rows, shown)
        if notes:
            parts += [" ".join(notes), ""]
    return "\n".join(parts).rstrip()


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
    if run.command or run.bench_command:
        parts += ["Produced by:", "", "```sh", run.command or run.bench_command, "```", ""]
    if run.environment:
        parts += [f"Environment: {page.environment_line(run.environment)}.", ""]
    if rows:
        parts.append(_table(header, rows, ["l", "l"] + ["r"] * 8))
    if run.ppl:
        parts.append(perplexity_markdown(data.perplexity_summary([run])))
    if run.bench:
        if parts[-1]:
            parts.append("")
        parts.append(f"{len(run.bench)} bench rows: see [Decode speed](#decode-speed).")
    if run.serving:
        if parts[-1]:
            parts.append("")
        parts.append(
            f"{len(run.serving)} serving rows: see [Serving under load (vLLM)](#serving-under-load-vllm)."
        )
    return "\n".join(parts).rstrip()


def _tasks_phrase(columns: list[str]) -> str:
    names = [guide.task_of(column) for column in columns]
    return f"on {names[0]}" if len(names) == 1 else f"over the {len(names)} tasks it shares with `full`"


def _versus_full(line: dict[str, Any], full: dict[str, Any] | None) -> str:
    """``mean score 61.9% over the 14 tasks it shares with `full` (45 trials) vs `full`'s 61.9% (99 trials)``."""
    if full is None:
        columns = guide.scored(line)
        mean, trials = guide.mean_score(line, columns), guide.trials(line, columns)
        return f"mean score {100 * mean:.1f}% over {len(columns)} task(s) ({trials} trials; no `full` to compare)"
    columns = guide.shared(line, full)
    if not columns:
        return "no task in common with `full`"
    mine, theirs = (guide.mean_score(x, columns) for x in (line, full))
    trials, full_trials = (guide.trials(x, columns) for x in (line, full))
    return (
        f"mean score {100 * mine:.1f}% {_tasks_phrase(columns)} ({trials} trials) vs `full`'s "
        f"{100 * theirs:.1f}% ({full_trials} trials)"
    )


def _largest_drop(line: dict[str, Any], full: dict[str, Any]) -> str:
    drops = [(full["accuracy"][c] - line["accuracy"][c], c) for c in guide.shared(line, full)]
    if len(drops) < 2:
        return ""
    drop, column = max(drops, key=lambda d: (d[0], d[1]))
    if drop <= 0:
        return "; no task scores below `full`"
    return (
        f"; its largest single-task drop: {guide.task_of(column)} {_pct(full['accuracy'][column])} "
        f"({full['n'][column]}) \u2192 {_pct(line['accuracy'][column])} ({line['n'][column]})"
    )


def _no_loss_line(lines: list[dict[str, Any]], full: dict[str, Any] | None) -> str:
    head = "- **Most compression at no loss:** "
    if full is None:
        return head + "no `full` rows at this length to compare against."
    pick = guide.no_loss(lines, full)
    if pick.qualified and pick.line is not None:
        line = pick.line
        return (
            f"{head}`{line['method']}` at {line['compression']:.2f}x, {_versus_full(line, full)}"
            f"{_largest_drop(line, full)}."
        )
    text = head + "no method qualifies: "
    if not pick.compressing:
        return text + f"no method here holds fewer bytes than `full` ({_num(full['compression'], '%.2fx')})."
    if pick.line is None:
        return text + "no method that holds fewer bytes than `full` shares a task with it here."
    text += (
        f"none that holds fewer bytes than `full` ({_num(full['compression'], '%.2fx')}) keeps its mean score "
        f"within {NO_LOSS_POINTS:g} points of `full`'s"
    )
    line = pick.line
    return f"{text}; the closest is `{line['method']}` at {line['compression']:.2f}x, {_versus_full(line, full)}."


def _speed_phrase(summary: list[dict[str, Any]], line: dict[str, Any], context: int) -> str:
    cells, trials = guide.speed_cells(summary, line, context)
    against = "kvpress's uncompressed baseline" if line["method"].startswith("kvpress:") else "`full`"
    where = f"median of {cells} cells, one per run and task" if cells > 1 else "1 cell"
    return (
        f"`{line['method']}`, decoding at {line['speed_vs_full']:.2f}x the speed of {against} "
        f"({where}; {trials} trials)"
    )


def _fastest_line(
    summary: list[dict[str, Any]], lines: list[dict[str, Any]], full: dict[str, Any] | None, context: int
) -> str:
    head = "- **Fastest decode:** "
    timed = guide.timed(lines)
    best = guide.fastest(timed)
    if best is None:
        return head + "no decode speed measured against `full` at this length."
    text = f"{head}{_speed_phrase(summary, best, context)}, {_versus_full(best, full)}"
    second = guide.fastest([line for line in timed if not line["method"].startswith("kvpress:")])
    if best["method"].startswith("kvpress:") and second is not None:
        text += f"; fastest kvweave method: {_speed_phrase(summary, second, context)}, {_versus_full(second, full)}"
    return text + "."


def trained_context(model: Any) -> int | None:
    """The trained context of a registry model (rows name their model but do not carry its trained
    length); ``None`` for a model kvweave's registry does not know."""
    from kvweave.models import REGISTRY

    spec = REGISTRY.get(str(model))
    return spec.trained_context if spec else None


def _beyond_line(lines: list[dict[str, Any]], full: dict[str, Any] | None, model: Any, context: int) -> str:
    head = "- **Beyond the trained context:** "
    trained = trained_context(model)
    if trained is None:
        return f"{head}skipped: nothing in the rows or kvweave's registry gives {model}'s trained context."
    trained_label = data.column_label("", trained).strip()
    if context <= trained:
        return head + f"no such rows at this length ({model} is trained to {trained_label})."
    tried = [line for line in lines if line["method"] not in data.REFERENCE_METHODS]
    text = head + f"{model} is trained to {trained_label}, these rows run {context / trained:g}x past it"
    if not tried:
        return text + (f"; only `full` was run: {_versus_full(full, None)}." if full else ".")

    def score(line: dict[str, Any]) -> float:
        columns = (
            guide.shared(line, full) if full else [c for c, a in line["accuracy"].items() if a is not None]
        )
        return guide.mean_score(line, columns) if columns else -1.0

    best = max(tried, key=score)
    others = f" (best of {len(tried)} methods tried)" if len(tried) > 1 else ""
    return (
        f"{text}: `{best['method']}`{others}, {_versus_full(best, full)}; compression "
        f"{_num(best['compression'], '%.2fx')}, decode {_num(best['speed_vs_full'], '%.2fx')} `full`."
    )


GUIDE_RULES = (
    "Computed from the rows in the tables below, for each context length (and model, where a length has "
    "several). **Most compression at no loss**: among the methods that hold fewer bytes than `full` "
    "(compression above `full`'s), the one with the highest compression whose mean score over the tasks it "
    "shares with `full` is at most {points} points below `full`'s mean over the same tasks; a mean can hide "
    "one task's loss, so its largest single-task drop is given too. **Fastest decode**: the highest median "
    "decode-speed ratio against `full` measured in the same run (kvpress presses: against kvpress's own "
    "uncompressed baseline), with its mean score on the same terms. **Beyond the trained context**: rows at "
    "lengths above the model's trained context (as kvweave's model registry gives it). Scores are per-task "
    "means as in the tables; with 3 trials, one answer moves a task's score by 33 points."
)


def guide_markdown(summary: list[dict[str, Any]]) -> str:
    """The "which method for which need" section, per context length and model: most compression at no loss,
    fastest decode, and what ran beyond the model's trained context, each naming the spec, its numbers and
    trials."""
    parts = ["## Which method for which need", "", GUIDE_RULES.format(points=f"{NO_LOSS_POINTS:g}"), ""]
    note = data.metric_note(entry["task"] for entry in summary)
    if note:
        parts += [note, ""]
    beyond_any = False
    for length in guide.lengths(summary):
        trained = trained_context(length.model)
        beyond_any = beyond_any or (trained is not None and length.context > trained)
        parts += [
            f"**[{length.label} tokens](#{anchor(f'{length.label} tokens', {})})** ({length.model})",
            "",
            _no_loss_line(length.lines, length.full),
            _fastest_line(summary, length.lines, length.full, length.context),
            _beyond_line(length.lines, length.full, length.model, length.context),
            "",
        ]
    if not beyond_any:
        parts += ["No rows lie beyond their model's trained context.", ""]
    return "\n".join(parts).rstrip()


def anchor(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2``, ...
    for repeats (``seen`` counts the anchors given so far)."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return slug if count == 0 else f"{slug}-{count}"


def contents_markdown(body: str) -> str:
    """A contents list for ``body``: each ``##`` section a line, its ``###`` sections inline after it."""
    seen: dict[str, int] = {}
    entries: list[tuple[str, list[str]]] = []
    fenced = False
    for text in body.splitlines():
        if text.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"(#{1,3}) (.+)", text)
        if not match:
            continue
        level, title = len(match.group(1)), match.group(2).strip()
        link = f"[{title.replace('`', '')}](#{anchor(title, seen)})"
        if level == 2:
            entries.append((link, []))
        elif level == 3 and entries:
            entries[-1][1].append(link)
    out = ["**Contents**", ""]
    for link, children in entries:
        out.append(f"- {link}" + (": " + " \u00b7 ".join(children) if children else ""))
    return "\n".join(out)


def render(runs: list[Run]) -> str:
    """The markdown summary of ``runs``: contents, the guide, tables by length, perplexity, then each run."""
    summaries = [data.run_summary(run) for run in runs]
    summary = data.pooled_summary(runs)  # across runs, a row copied to resume beside it counts once
    rows, windows = len(data.unique_rows(runs)), sum(len(run.ppl) for run in runs)
    copies = sum(len(run.rows) for run in runs) - rows
    bench, serving = sum(len(run.bench) for run in runs), sum(len(run.serving) for run in runs)
    counts = f"{rows} result rows"
    counts += f" and {copies} copies of them in the folders that resumed beside them" if copies else ""
    counts += f", {windows} perplexity rows" if windows else ""
    counts += f", {bench} bench rows" if bench else ""
    counts += f", {serving} serving rows" if serving else ""
    noun = "run folder" if all(run.path.is_dir() for run in runs) else "run"
    title = [
        "# kvweave results",
        "",
        f"Generated by `kvweave report` from {len(runs)} {noun}{'s' if len(runs) != 1 else ''} "
        f"({counts}); every run's section gives the command that produced it.",
        "",
        "",
    ]
    parts: list[str] = []
    note = data.metric_note(entry["task"] for entry in summary)
    if summary:
        parts += [guide_markdown(summary), ""]
        parts += [
            "## Results by context length",
            "",
            "One table per context length: accuracy per task (number of trials in brackets), mean compression "
            "(16-bit full-cache bytes / bytes held), KV memory held (the largest sample), and median decode "
            "speed as a ratio against `full` measured in the same run (the median over the runs a method "
            "appears in at that length).",
            "",
            *([note, ""] if note else []),
            overview_markdown(summary),
            "",
        ]
    ppl = data.perplexity_summary(runs)
    if ppl:
        parts += [
            "## Perplexity",
            "",
            "Each window's first tokens are prefilled and compressed, then its last (scored) tokens are fed "
            "through the same cache and scored by teacher forcing; perplexity is exp of the mean NLL over the "
            "windows, and its change is against `full` on the same windows.",
            "",
            perplexity_markdown(ppl),
            "",
        ]
    bench_part = bench_markdown(runs)
    if bench_part:
        parts += [bench_part, ""]
    serving_part = serving_markdown(runs)
    if serving_part:
        parts += [serving_part, ""]
    runs_intro = "Each run folder: the command that produced it, its environment and its table."
    parts += ["## Runs", "", runs_intro, ""]
    for run, run_entries in zip(runs, summaries, strict=True):
        parts += [run_markdown(run, run_entries), ""]
    body = "\n".join(parts)
    return "\n".join(title) + contents_markdown("\n".join(title) + body) + "\n\n" + body
