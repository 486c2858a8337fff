"""The task registry: :class:`TaskSpec`, the :data:`TASKS` table of every task and :func:`available_tasks`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvweave.eval.tasks.code import _build_code
from kvweave.eval.tasks.data import DATA_ENV, resolve_data_dir
from kvweave.eval.tasks.fitting import _Ctx, _Plan
from kvweave.eval.tasks.niah import _build_niah_multikey_uuid, _niah_builder, _NiahConfig
from kvweave.eval.tasks.passkey import _build_passkey
from kvweave.eval.tasks.qa import _LOOGLE, _QUALITY, _build_qa_loogle, _build_qa_quality
from kvweave.eval.tasks.ruler import _build_cwe, _build_fwe, _build_vt

_PROSE = ("pydoc", "essays", "repeat", "code")
_WORDLISTS = f"${DATA_ENV}/ruler/wordlists (optional; built-in lists otherwise)"


@dataclass(frozen=True)
class TaskSpec:
    """A registered task: how it is built and what it needs."""

    name: str
    description: str
    default_haystack: str
    haystacks: tuple[str, ...]
    builder: Callable[[_Ctx], _Plan] = field(repr=False)
    needs: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    uses_depth: bool = True
    max_new_tokens: int = 128
    metric: str = "string_match_all"
    stop_after_line: bool = (
        False  # the score reads the first code line only: stop generating once it is complete
    )


def _spec(name: str, description: str, builder: Callable[[_Ctx], _Plan], **kw: Any) -> TaskSpec:
    kw.setdefault("default_haystack", "pydoc")
    kw.setdefault("haystacks", _PROSE)
    return TaskSpec(name=name, description=description, builder=builder, **kw)


TASKS: dict[str, TaskSpec] = {
    s.name: s
    for s in (
        _spec(
            "passkey",
            "InfiniteBench pass key: find a 5-digit key in filler",
            _build_passkey,
            default_haystack="repeat",
            max_new_tokens=16,
        ),
        _spec(
            "niah_single",
            "NIAH, one word key, 7-digit number value (RULER niah_single_1/2)",
            _niah_builder(_NiahConfig("words", "numbers")),
            optional=(_WORDLISTS,),
        ),
        _spec(
            "niah_word",
            "NIAH, one word key, adjective-noun word value",
            _niah_builder(_NiahConfig("words", "words")),
            optional=(_WORDLISTS,),
        ),
        _spec(
            "niah_uuid",
            "NIAH, one word key, UUID value (RULER niah_single_3)",
            _niah_builder(_NiahConfig("words", "uuids")),
            optional=(_WORDLISTS,),
        ),
        _spec(
            "niah_multikey",
            "NIAH, the asked needle plus 3 distractor keys, number values (RULER niah_multikey_1)",
            _niah_builder(_NiahConfig("words", "numbers", k=4)),
            optional=(_WORDLISTS,),
        ),
        _spec(
            "niah_multikey_uuid",
            "NIAH, haystack of distractor needles, UUID keys and values (RULER niah_multikey_3)",
            _build_niah_multikey_uuid,
            default_haystack="needles",
            haystacks=("needles",),
        ),
        _spec(
            "niah_multivalue",
            "NIAH, one key with 4 number values, all must be recalled (RULER niah_multivalue)",
            _niah_builder(_NiahConfig("words", "numbers", v=4)),
            optional=(_WORDLISTS,),
        ),
        _spec(
            "niah_multiquery",
            "NIAH, 4 keys asked at once, number values (RULER niah_multiquery)",
            _niah_builder(_NiahConfig("words", "numbers", k=4, q=4)),
            optional=(_WORDLISTS,),
        ),
        *(
            _spec(
                f"niah_{shape}_{kind}",
                f"NIAH, {what}, {values} (kvweave)",
                _niah_builder(_NiahConfig("words", noun, draw=draw, **counts)),  # type: ignore[arg-type]
                optional=(_WORDLISTS,),
            )
            for shape, what, counts in (
                ("multiquery", "4 keys asked at once", {"k": 4, "q": 4}),
                ("multivalue", "one key with 4 values, all must be recalled", {"v": 4}),
            )
            for kind, noun, draw, values in (
                ("word", "words", "", "adjective-noun word values"),
                ("hex", "codes", "hex", "8-hex-digit code values such as 8605b771"),
                ("common", "words", "common", "common English word values"),
            )
        ),
        _spec(
            "vt",
            "variable tracking: 1 chain of 4 hops, name all 5 variables (RULER vt)",
            _build_vt,
            default_haystack="repeat",
            max_new_tokens=30,
        ),
        _spec(
            "cwe",
            "common words extraction: the 10 most common words of a numbered list (RULER cwe)",
            _build_cwe,
            default_haystack="wordlist",
            haystacks=("wordlist",),
            optional=(_WORDLISTS,),
            uses_depth=False,
            max_new_tokens=120,
        ),
        _spec(
            "fwe",
            "frequent words extraction: the 3 most frequent coded words, Zipf alpha 2 (RULER fwe)",
            _build_fwe,
            default_haystack="coded",
            haystacks=("coded",),
            uses_depth=False,
            max_new_tokens=50,
        ),
        _spec(
            "qa_quality",
            "L-Eval QuALITY: multiple-choice question on a whole story among distractor stories",
            _build_qa_quality,
            default_haystack="quality",
            haystacks=("quality",),
            needs=(_QUALITY,),
            max_new_tokens=8,
            metric="choice",
        ),
        _spec(
            "qa_loogle",
            "LooGLE short-dependency QA on a Wikipedia article window holding the evidence (token F1)",
            _build_qa_loogle,
            default_haystack="article",
            haystacks=("article",),
            needs=(_LOOGLE,),
            max_new_tokens=48,
            metric="f1",
        ),
        _spec(
            "code",
            "next-line completion in a CPython stdlib module, the called name defined far above (edit sim.)",
            _build_code,
            default_haystack="source",
            haystacks=("source",),
            uses_depth=False,
            max_new_tokens=48,
            metric="edit_sim",
            stop_after_line=True,
        ),
    )
}
"""All tasks by name."""


def available_tasks(data_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Names of the tasks whose required files (for their default haystack) are available."""
    root = resolve_data_dir(data_dir)
    return [
        name
        for name, spec in TASKS.items()
        if all(root is not None and (root / need).exists() for need in spec.needs)
    ]
