"""Long-document QA task builders on optional data: L-Eval QuALITY and LooGLE short-dependency QA.

Reads the JSON-lines files from the data folder (:data:`_QUALITY`, :data:`_LOOGLE`); QuALITY places a
whole story among distractor paragraphs, LooGLE cuts an article window around the evidence sentence.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvweave.eval.tasks.data import Haystack, _count, _require_data
from kvweave.eval.tasks.fitting import _Ctx, _Draft, _pick_depth, _Plan, _prose_plan

_QUALITY = "leval/quality.jsonl"
_LOOGLE = "loogle/shortdep_qa.jsonl"


@lru_cache(maxsize=4)
def _read_jsonl(path: str) -> tuple[dict[str, Any], ...]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}, line {n}: not valid JSON ({exc.msg}); is the file complete?"
                ) from exc
    if not rows:
        raise ValueError(f"{path} holds no documents")
    return tuple(rows)


_OPTION = re.compile(r"^\s*\(([A-D])\)")


def _quality_items(path: Path) -> list[tuple[int, int]]:
    """(document, question) pairs of L-Eval QuALITY whose answer names one option letter."""
    items: list[tuple[int, int]] = []
    for d, row in enumerate(_read_jsonl(str(path))):
        try:
            pairs = list(zip(row["instructions"], row["outputs"], strict=True))
            _ = row["input"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: document {d} lacks 'input'/'instructions'/'outputs' ({exc})") from exc
        items.extend((d, q) for q, (_, out) in enumerate(pairs) if _OPTION.match(out))
    return items


def _paragraph_haystack(name: str, docs: Sequence[str]) -> Haystack:
    """Distractor filler: the paragraphs of ``docs``, joined by blank lines."""
    units = tuple(p.strip() for doc in docs for p in re.split(r"\n\s*\n", doc) if p.strip())
    return Haystack(name, units, "\n\n")


def _build_qa_quality(ctx: _Ctx) -> _Plan:
    """L-Eval QuALITY multiple choice: a whole story at ``depth`` among paragraphs of the other stories.

    The story is never cut: only (story, question) pairs whose story fits in the target are drawn, and
    the rest of the context is distractor paragraphs from the other stories (as RULER's QA tasks pad
    with distractor documents).
    """
    path = _require_data(_QUALITY, "task 'qa_quality'", ctx.data_dir)
    rows = _read_jsonl(str(path))
    preamble = (
        "Read the stories below. A multiple-choice question about one of them follows; "
        "answer with the letter of the right option.\n\n"
    )
    room = ctx.target - _count(ctx.tok, preamble) - 8
    lengths = {d: _count(ctx.tok, rows[d]["input"].strip()) for d in range(len(rows))}
    items = [(d, q) for d, q in _quality_items(path) if lengths[d] <= room]
    if not items:
        raise ValueError(
            f"context_tokens={ctx.target} is too small for task 'qa_quality': its shortest story has "
            f"{min(lengths.values())} tokens; use a longer context"
        )
    d, q = ctx.rng.choice(items)
    depth = _pick_depth(ctx)
    ctx.depth = depth
    story = rows[d]["input"].strip()
    question = rows[d]["instructions"][q].strip()
    match = _OPTION.match(rows[d]["outputs"][q])
    assert match is not None
    ctx.haystack = _paragraph_haystack("quality", [r["input"] for i, r in enumerate(rows) if i != d])

    def finish(context: str, realised: list[float]) -> _Draft:
        meta = {"depth": depth, "needle_depths": realised, "document": d, "question_index": q}
        meta.update(story_tokens=lengths[d], metric="choice")
        return _Draft(context, f"Question: {question}", [match.group(1)], "Answer: (", meta)

    return _prose_plan(ctx, preamble, [story], [depth], finish)


def _loogle_items(path: Path) -> list[tuple[int, dict[str, str]]]:
    """(document, QA pair) of LooGLE short-dependency QA whose evidence sentence occurs in the document."""
    items: list[tuple[int, dict[str, str]]] = []
    for d, row in enumerate(_read_jsonl(str(path))):
        try:
            pairs = ast.literal_eval(row["qa_pairs"])
            doc = row["input"]
        except (KeyError, ValueError, SyntaxError) as exc:
            raise ValueError(f"{path}: document {d} has no readable 'input'/'qa_pairs' ({exc})") from exc
        items.extend((d, qa) for qa in pairs if qa.get("S") and qa.get("A") and qa["S"] in doc)
    return items


def _build_qa_loogle(ctx: _Ctx) -> _Plan:
    """LooGLE short-dependency QA: a window of one Wikipedia article with the evidence sentence at ``depth``.

    The window is cut at word boundaries around the QA pair's evidence sentence (which LooGLE records),
    so the evidence is always in the context; scored by SQuAD token F1 against the reference answer.
    """
    path = _require_data(_LOOGLE, "task 'qa_loogle'", ctx.data_dir)
    rows = _read_jsonl(str(path))
    preamble = "Read the article below and answer the question that follows in one sentence.\n\n"
    items = [(d, qa) for d, qa in _loogle_items(path) if len(rows[d]["input"]) >= 4.5 * ctx.target]
    if not items:
        longest = max(len(r["input"]) for r in rows) // 4
        raise ValueError(
            f"context_tokens={ctx.target} is too long for task 'qa_loogle': its longest article has about "
            f"{longest} tokens; use a shorter context"
        )
    d, qa = ctx.rng.choice(items)
    depth = _pick_depth(ctx)
    ctx.depth = depth
    doc = rows[d]["input"]
    at = doc.index(qa["S"])
    question = f"Question: {qa['Q'].strip()}"

    def build(n: int) -> _Draft:
        n = min(max(n, len(qa["S"])), len(doc))
        start = min(max(0, at - round(depth * (n - len(qa["S"])))), len(doc) - n)
        end = start + n
        while start > 0 and not doc[start - 1].isspace():  # whole words only
            start += 1
        while end < len(doc) and not doc[end].isspace():
            end -= 1
        window = doc[start:end].strip()
        meta = {"depth": depth, "document": d, "title": rows[d].get("title", ""), "evidence": qa["S"]}
        meta.update(needle_depths=[(at - start) / max(1, end - start)], metric="f1")
        return _Draft(preamble + window, question, [qa["A"].strip()], "Answer:", meta)

    return _Plan(build, n0=4 * ctx.target, slope=0.25, n_min=len(qa["S"]))
