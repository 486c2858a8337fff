"""``kvweave demo``: every registered method at about 4x against ``full``, on a real model, in minutes.

Question-agnostic pass-key and multi-key NIAH at one modest context length on the default model
(:data:`kvweave.models.DEFAULT_MODEL`): the document is prefilled and compressed before the question is
seen. It is an ordinary ``kvweave eval`` run (rows in a run folder, resumable), followed by the table
and ``report.html`` + ``summary.md`` + ``summary.csv`` written into the run folder.

Methods come from the registry at run time: the baselines and kvweave's own methods are asked to keep a
quarter of the prompt through their budget option (``Method.budget_options``: a quarter held, 4x targeted,
or for DK-Cache a quarter attended), ``quant`` runs
at 4 bits, and a method that is not registered is skipped with a note.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvweave.models import DEFAULT_MODEL

DEMO_TASKS = ("passkey", "niah_multikey")
"""Retrieval tasks the demo runs (one needle in filler; the asked needle among distractors)."""

KEEP = 0.25
"""Fraction of the prompt the evicting methods keep: about 4x compression."""

CANDIDATES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("full", {}),
    ("window", {"ratio": KEEP}),
    ("keydiff", {"ratio": KEEP}),
    ("snapkv", {"ratio": KEEP}),
    ("h2o", {"ratio": KEEP}),
    ("quant", {"bits": 4}),
    ("dkcache", {"ratio": KEEP}),
    ("depthweave", {"ratio": KEEP}),
)
"""Methods the demo tries, in table order, with the options that put them near 4x."""

BUDGET_VALUES = {"held fraction": KEEP, "compression": 1 / KEEP, "attended fraction": KEEP}
"""How a wanted ``ratio`` (a quarter of the prompt) maps to each kind of budget option (``Method.budget_options``)."""


def _spec(name: str, options: dict[str, Any]) -> str:
    """``name:key=value,...`` (floats written short: 0.25, 4)."""
    text = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in options.items()]
    return name + (":" + ",".join(text) if text else "")


def method_spec(name: str, wanted: dict[str, Any]) -> tuple[str | None, str]:
    """``(spec, note)`` for one candidate: ``spec`` is ``None`` when the method is not registered.

    A wanted ``ratio`` goes to the method's first budget option (``Method.budget_options``) of a kind in
    :data:`BUDGET_VALUES`: a quarter held, 4x targeted, or a quarter attended.
    """
    import kvweave.methods  # noqa: F401  (registers the built-in methods)
    from kvweave.registry import METHODS, parse_method

    cls = METHODS.get(name)
    if cls is None:
        return None, f"{name}: not registered, skipped"
    options = {o["name"] for o in cls.describe()["options"]}
    fixed = {k: v for k, v in wanted.items() if k != "ratio" and k in options}
    if "ratio" not in wanted:
        return _spec(name, fixed), ""
    chosen = next(
        ((option, kind) for option, kind in cls.budget_options.items() if kind in BUDGET_VALUES), None
    )
    if chosen is None:
        return _spec(
            name, fixed
        ), f"{name}: has no budget option of a kind {sorted(BUDGET_VALUES)}; defaults used"
    option_name, kind = chosen
    spec = _spec(name, {**fixed, option_name: BUDGET_VALUES[kind]})
    try:
        parse_method(spec)
    except ValueError as err:
        return _spec(
            name, fixed
        ), f"{name}: {option_name}={BUDGET_VALUES[kind]:g} is refused ({err}); defaults used"
    return spec, ""


def default_methods() -> tuple[list[str], list[str]]:
    """``(specs, notes)``: the registered candidates at about 4x, and a note per skipped or adjusted one."""
    specs, notes = [], []
    for name, wanted in CANDIDATES:
        spec, note = method_spec(name, wanted)
        if spec is not None:
            specs.append(spec)
        if note:
            notes.append(note)
    return specs, notes


def default_out(model: str, context: int) -> Path:
    """``runs/demo-<model>-<context>`` (a model folder contributes its last path component)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model).name or model).strip("-")
    return Path("runs") / f"demo-{slug}-{context}"


def run_demo(
    model: str = DEFAULT_MODEL,
    context: int = 2048,
    trials: int = 3,
    methods: Sequence[str] | None = None,
    out: str | Path | None = None,
    dtype: str = "float32",
    max_new_tokens: int = 16,
    command: str | None = None,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], Path]:
    """Run the demo; returns the summary (with speed ratios) and the run folder.

    Writes ``rows.jsonl``, ``config.json``, ``command.txt`` (``command``, else the equivalent ``kvweave demo``
    line), ``report.html``, ``summary.md`` and ``summary.csv`` into the run folder; a rerun resumes.
    """
    from kvweave.eval import runner
    from kvweave.report import write_report

    notes: list[str] = []
    if methods:
        specs = list(methods)
    else:
        specs, notes = default_methods()
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
    )
    folder = Path(out) if out else default_out(model, context)
    todo = runner.plan(config)
    done = runner.finished_keys(folder / "rows.jsonl")
    left = sum(t.key() not in done for t in todo)
    print(
        f"demo: {len(specs)} methods x {len(DEMO_TASKS)} tasks x {trials} trials at {context} tokens on "
        f"{model} = {len(todo)} trials ({left} to run; the progress bar shows the ETA)\n"
        f"methods: {', '.join(specs)}\nrun folder: {folder}",
        file=sys.stderr,
    )
    folder.mkdir(parents=True, exist_ok=True)
    if command is None:
        command = demo_command(
            model, context, trials, specs if methods else None, folder, dtype, max_new_tokens
        )
    (folder / "command.txt").write_text(command + "\n")
    rows = runner.run(config, out_dir=folder, progress=progress)
    summary = runner.add_speed_ratios(runner.summarize(rows))
    write_report([folder], folder / "report.html", markdown=folder / "summary.md", csv=folder / "summary.csv")
    return summary, folder


def demo_command(
    model: str,
    context: int,
    trials: int,
    methods: Sequence[str] | None,
    out: Path,
    dtype: str = "float32",
    max_new_tokens: int = 16,
) -> str:
    """The ``kvweave demo`` command line that reproduces a run (written to ``command.txt``)."""
    parts = ["kvweave", "demo", "--model", model, "--context", str(context), "--trials", str(trials)]
    if methods:
        parts += ["--methods", ",".join(methods)]
    if dtype != "float32":
        parts += ["--dtype", dtype]
    if max_new_tokens != 16:
        parts += ["--max-new-tokens", str(max_new_tokens)]
    return shlex.join([*parts, "--out", str(out)])
