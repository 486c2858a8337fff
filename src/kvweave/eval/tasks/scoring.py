"""Samples and their scoring: the :class:`Sample` record and :func:`score` with its metric helpers.

The metrics are RULER's ``string_match_all``, multiple-choice letter matching, SQuAD token F1 and the
edit similarity of the first predicted code line (:func:`first_code_line`, :func:`first_line_complete`).
:func:`score` picks the metric from the task registry.
"""

from __future__ import annotations

import difflib
import re
import string
from dataclasses import dataclass, field
from typing import Any

from kvweave.eval.tasks.registry import TASKS


@dataclass
class Sample:
    """One generated evaluation sample.

    ``context`` is the long document (task instruction first), ``question`` is asked after it,
    and the assistant's reply should begin with ``answer_prefix``.  Full credit requires every
    string of ``answers`` to appear in the prediction (see :func:`score`).
    """

    task: str
    context: str
    question: str
    answers: list[str]
    depth: float | None
    seed: int
    context_tokens: int
    answer_prefix: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """Context and question as one single-turn user message."""
        return f"{self.context}\n{self.question}"


_CONTROL = re.compile(r"[\x00-\x1f]")


def score(sample: Sample, prediction: str) -> float:
    """Score of ``prediction`` by the task's metric (``TASKS[sample.task].metric``), in [0, 1].

    * ``string_match_all`` (RULER): fraction of ``sample.answers`` found in ``prediction``,
      case-insensitive, after RULER's post-processing (strip, control characters to newlines, strip).
    * ``choice``: 1 when the first option letter (A-D) of the prediction is the answer letter.
    * ``f1``: SQuAD token F1 against the best-matching answer.
    * ``edit_sim``: similarity (``difflib`` ratio) of the first code line of the prediction with the answer line.

    Returns 0.0 when the sample has no answers.
    """
    spec = TASKS.get(sample.task)
    metric = spec.metric if spec is not None else "string_match_all"
    if metric == "choice":
        return _score_choice(sample.answers, prediction)
    if metric == "f1":
        return max((_token_f1(a, prediction) for a in sample.answers), default=0.0)
    if metric == "edit_sim":
        return _edit_sim(sample.answers, prediction)
    answers = [a.strip().lower() for a in sample.answers if a.strip()]
    if not answers:
        return 0.0
    pred = _CONTROL.sub("\n", prediction.strip()).strip().lower()
    return sum(a in pred for a in answers) / len(answers)


_LETTER = re.compile(r"(?<![A-Za-z])([A-D])(?![A-Za-z])")


def _score_choice(answers: list[str], prediction: str) -> float:
    match = _LETTER.search(prediction)
    return float(bool(answers) and match is not None and match.group(1) == answers[0].strip().upper())


def _normalize_words(text: str) -> list[str]:
    """SQuAD answer normalisation: lower case, no punctuation or articles, split on whitespace."""
    text = "".join(" " if ch in string.punctuation else ch for ch in text.lower())
    return [w for w in text.split() if w not in ("a", "an", "the")]


def _token_f1(answer: str, prediction: str) -> float:
    gold, pred = _normalize_words(answer), _normalize_words(prediction)
    if not gold or not pred:
        return 0.0
    common = sum(min(gold.count(w), pred.count(w)) for w in set(gold) & set(pred))
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def first_code_line(prediction: str) -> str:
    """The first non-blank line of ``prediction`` that is not a Markdown code fence, stripped."""
    for line in prediction.splitlines():
        line = line.strip()
        if line and not line.startswith("```"):
            return line
    return ""


def first_line_complete(prediction: str) -> bool:
    """Whether the line :func:`first_code_line` takes from ``prediction`` is finished (a line break follows it),
    so no further token can change it."""
    for line in prediction.splitlines(keepends=True):
        text = line.strip()
        if text and not text.startswith("```"):
            return line.endswith(("\n", "\r"))
    return False


def _edit_sim(answers: list[str], prediction: str) -> float:
    if not answers:
        return 0.0
    line = first_code_line(prediction)
    return difflib.SequenceMatcher(None, line, answers[0].strip(), autojunk=False).ratio()
