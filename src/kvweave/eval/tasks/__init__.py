"""Synthetic long-context tasks for evaluating KV-cache compression.

Independent re-implementation of the RULER task recipes (NIAH variants, variable tracking,
common/frequent words extraction) plus the classic pass-key retrieval task, following RULER's published
recipes (summarised in ``RULER-recipes.md`` of the project's shared data folder).

Every sample is split into a long ``context`` (the document, preceded by the task
instruction, which never reveals what will be asked) and a ``question`` asked *after* it,
like a follow-up chat turn, so query-agnostic compression of the context can be
evaluated.  The context is sized to a token budget with the caller's tokenizer: any object
with ``encode(text, add_special_tokens=False) -> list[int]`` and ``decode(ids) -> str``.

Generation needs no files: the default haystacks are CPython's own documentation prose
(``pydoc_data.topics``), the classic "The grass is green ..." filler and standard-library
source.  Optional data (Paul Graham essays, wonderwords word lists, WikiText-2) is read
from the folder named by the ``KVWEAVE_DATA`` environment variable or a ``data_dir``
argument; a missing required file raises :class:`TaskDataMissing`.

Layout: :mod:`.data` (data folder, haystacks, corpora, word lists), :mod:`.scoring` (:class:`Sample`,
:func:`score`), :mod:`.fitting` (filler, needle insertion, sizing to a token budget), the task builders
:mod:`.passkey`, :mod:`.niah`, :mod:`.ruler`, :mod:`.qa` and :mod:`.code`, and :mod:`.registry`
(:data:`TASKS`); :func:`make_sample`, the generator entry point, lives here.
"""

from __future__ import annotations

import os
import random

from kvweave.eval.tasks.code import _CALL as _CALL
from kvweave.eval.tasks.code import _CODE_NEAR as _CODE_NEAR
from kvweave.eval.tasks.code import _code_lines as _code_lines
from kvweave.eval.tasks.data import CORPORA as CORPORA
from kvweave.eval.tasks.data import (
    DATA_ENV,
    HAYSTACKS,
    Haystack,
    TaskDataMissing,
    Tokenizer,
    _words,
    load_corpus,
    load_haystack,
    perplexity_windows,
    resolve_data_dir,
    word_lists,
)
from kvweave.eval.tasks.data import NOISE as NOISE
from kvweave.eval.tasks.fitting import _Ctx, _fit, depths
from kvweave.eval.tasks.registry import TASKS, TaskSpec, available_tasks
from kvweave.eval.tasks.scoring import Sample, first_code_line, score
from kvweave.eval.tasks.scoring import first_line_complete as first_line_complete

__all__ = [
    "DATA_ENV",
    "HAYSTACKS",
    "TASKS",
    "Haystack",
    "Sample",
    "TaskDataMissing",
    "TaskSpec",
    "Tokenizer",
    "available_tasks",
    "depths",
    "load_corpus",
    "load_haystack",
    "make_sample",
    "perplexity_windows",
    "resolve_data_dir",
    "first_code_line",
    "score",
    "word_lists",
]


# --------------------------------------------------------------------------------------------
# the generator entry point
# --------------------------------------------------------------------------------------------


def _task_haystack(
    spec: TaskSpec, haystack: str | None, data_dir: str | os.PathLike[str] | None
) -> Haystack | None:
    """The filler haystack for a task (``None`` for tasks that build their own)."""
    name = haystack or spec.default_haystack
    if name not in spec.haystacks:
        raise ValueError(
            f"task {spec.name!r} does not support haystack {name!r}; choose from {spec.haystacks}"
        )
    return load_haystack(name, data_dir) if name in HAYSTACKS else None


def make_sample(
    task: str,
    tokenizer: Tokenizer,
    context_tokens: int,
    depth: float | None = None,
    seed: int = 0,
    haystack: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    tolerance: int | None = None,
) -> Sample:
    """Generate one sample of ``task`` whose context has ``context_tokens`` tokens.

    ``context_tokens`` counts the context alone (instruction + document), not the question
    or any chat template.  Deterministic given all arguments (and the optional data found).
    ``depth`` (0..1, fraction of the filler tokens before it) places the first needle; the
    other needles of multi-needle tasks are spread evenly from it, wrapping around (vt keeps
    its chain in document order over those same positions); ``None`` draws a seeded random
    depth; depth-free tasks (cwe, fwe) ignore it.  ``haystack`` overrides the task's default
    filler (see :data:`TASKS`).  The measured length is within ``tolerance`` tokens of the target (default
    ``max(8, context_tokens // 1000)``), except that tasks built of coarse units (lines of
    needles, list entries) may end up to one unit short.  Raises ``ValueError`` for unknown
    tasks/haystacks or a target too small for the task, :class:`TaskDataMissing` for missing
    required data.
    """
    spec = TASKS.get(task)
    if spec is None:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be positive, got {context_tokens}")
    hay = _task_haystack(spec, haystack, data_dir)
    ctx = _Ctx(
        task=task,
        tok=tokenizer,
        target=context_tokens,
        depth=depth if spec.uses_depth else None,
        seed=seed,
        rng=random.Random(f"kvweave:{task}:{seed}"),
        haystack=hay,
        words=_words(data_dir),
        data_dir=data_dir,
    )
    plan = spec.builder(ctx)
    tol = max(8, context_tokens // 1000) if tolerance is None else tolerance
    draft, measured = _fit(plan, tokenizer, context_tokens, tol)
    meta = {"target_tokens": context_tokens, "tolerance": tol, "wordlist": ctx.words.source, **draft.meta}
    meta.setdefault("haystack", haystack or spec.default_haystack)
    return Sample(
        task=task,
        context=draft.context,
        question=draft.question,
        answers=draft.answers,
        depth=ctx.depth,
        seed=seed,
        context_tokens=measured,
        answer_prefix=draft.answer_prefix,
        meta=meta,
    )
