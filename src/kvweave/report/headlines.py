"""Headline figures rendered from committed rows, so the README and the findings never quote a number by hand.

A headline is a marked span in a document: ``<!-- fig:NAME -->1.13x<!-- /fig -->``. :data:`HEADLINES` says
where each figure comes from (a rows file under ``docs/data``, the row's method spec and filters, the field and
how to summarise it); :func:`render` rewrites every span from the rows. A figure whose rows were written under
older defaults than the method's current ones (``spec_version``: :func:`kvweave.report.specs.canonical_spec` of
the row differs from the spec read today) is rendered with the configuration it measured, in words, so an old
figure is never read as the current default's.

Rendered by ``python -m kvweave.report.headlines README.md docs/findings.md docs/vllm.md`` (``--check`` only says whether
they are current: what ``tests/unit/test_headlines.py`` asserts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
SPAN = re.compile(r"<!-- fig:(?P<name>[a-z0-9-]+) -->(?P<text>.*?)<!-- /fig -->", re.S)


@dataclasses.dataclass(frozen=True)
class Headline:
    """One figure: ``rows`` (a JSONL file relative to the repository, or several: the runs of one point, each
    in its own file), the rows whose ``method`` is ``method`` and whose fields equal ``where``, their ``field``
    summarised by ``summary`` (``median``, ``min``, ``max``, ``range``, ``mean``) and written with ``fmt``;
    ``scale`` multiplies the value first (bytes -> MiB).

    ``method`` may be several strings: one configuration that spec versions wrote under different strings. Then
    only the rows that, read at their own ``spec_version``, are what the first string means today count (a row
    of those strings that measured another configuration is left out)."""

    rows: str | tuple[str, ...]
    method: str | tuple[str, ...]
    field: str
    fmt: str
    where: tuple[tuple[str, Any], ...] = ()
    summary: str = "median"
    scale: float = 1.0
    kvweave_spec: bool = (
        True  # False: ``method`` is no kvweave spec (vLLM's ``KVWEAVE_VLLM_METHOD``, ``none``)
    )
    named: str | None = None  # the older configuration the text beside the figure names (no tag when it is)

    def select(self, root: Path = ROOT) -> list[dict[str, Any]]:
        """The rows this figure summarises (error when none: a figure with no rows is not a figure)."""
        rows = []
        for name in (self.rows,) if isinstance(self.rows, str) else self.rows:
            path = root / name
            if not path.exists():
                raise FileNotFoundError(f"headline rows {name} are missing")
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        methods = (self.method,) if isinstance(self.method, str) else self.method
        chosen = [r for r in rows if r.get("method") in methods and all(r.get(k) == v for k, v in self.where)]
        if len(methods) > 1:  # one configuration under several strings: the rows that are it today
            chosen = [r for r in chosen if older_configuration(methods[0], [r]) is None]
        if not chosen:
            raise ValueError(f"no rows of {self.method} {dict(self.where)} in {self.rows}")
        return chosen

    def value(self, root: Path = ROOT) -> str:
        """The figure as text, with the older configuration named when its rows predate today's defaults."""
        rows = self.select(root)
        values = [float(r[self.field]) * self.scale for r in rows]
        text = _SUMMARIES[self.summary](values, self.fmt)
        today = self.method if isinstance(self.method, str) else self.method[0]
        older = older_configuration(today, rows) if self.kvweave_spec else None
        if older is not None and older == self.named:  # the text names what the rows measured
            return text
        return f"{text} (rows of `{older}`, an older configuration)" if older else text


def _range(values: list[float], fmt: str) -> str:
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low.rstrip('x')}–{high}"


_SUMMARIES: dict[str, Callable[[list[float], str], str]] = {
    "median": lambda v, f: f.format(statistics.median(v)),
    "mean": lambda v, f: f.format(statistics.fmean(v)),
    "min": lambda v, f: f.format(min(v)),
    "max": lambda v, f: f.format(max(v)),
    "range": _range,
}


def older_configuration(method: str, rows: list[dict[str, Any]]) -> str | None:
    """The spec the rows measured when it is not what ``method`` means today (each row's own method string read at
    its ``spec_version``: a version that predates a default it depends on, or another configuration's string),
    else ``None``."""
    from kvweave.registry import parse_method
    from kvweave.report.specs import canonical_spec

    today = parse_method(method).spec()
    for row in rows:
        version = row.get("spec_version")
        written = str(row.get("method", method))
        then = parse_method(canonical_spec(written, legacy=version is None, version=version)).spec()
        if then != today:
            return then
    return None


RUNS_16K = tuple(f"docs/data/bench/bench-16k-v{n}.jsonl" for n in (4, 5, 6))
"""The three five-round runs of the 16K point at the current defaults (the same command, three sessions)."""

RUNS_16K_NOW = tuple(f"docs/data/bench/bench-16k-v{n}.jsonl" for n in (7, 8))
"""The five-round runs of the 16K point since DK-Cache's blocked INT8 kernel and one-pass softmax (tenth
session): the same command as :data:`RUNS_16K`, the code of today."""

LONGGEN_ROWS: dict[int, str | tuple[str, ...]] = {
    1024: "docs/data/runs/longgen-2k-1k-batch6/rows.jsonl",
    4096: ("docs/data/runs/longgen-2k-4k/rows.jsonl", "docs/data/runs/longgen-2k-4k-v5/rows.jsonl"),
    8192: "docs/data/runs/longgen-2k-8k-v5/rows.jsonl",
}
"""The long-generation table's rows by generated tokens (``scripts/longgen.sh``; `full`'s 4K trials 0-1 are in
the first run of that column)."""

LONGGEN_V9: dict[int, str] = {
    4096: "docs/data/runs/longgen-2k-4k-v9/rows.jsonl",
    8192: "docs/data/runs/longgen-2k-8k-v9/rows.jsonl",
}
"""Today's default's long-generation cells (spec version 9, rows written as ``depthweave``) by generated tokens,
in folders of their own (``LONGGEN_OUT``: the older folders' ``depthweave`` rows are spec version 5's); the same
samples as :data:`LONGGEN_ROWS`. The 1K cell is :data:`CANDIDATE`'s rows there."""


def _runs(folders: str | tuple[str, ...]) -> str | tuple[str, ...]:
    """Run folders' rows files: one folder or several."""
    if isinstance(folders, str):
        return f"docs/data/runs/{folders}/rows.jsonl"
    return tuple(f"docs/data/runs/{folder}/rows.jsonl" for folder in folders)


def _cell(
    rows: str | tuple[str, ...],
    method: str | tuple[str, ...],
    field: str,
    where: tuple[tuple[str, Any], ...],
    named: str | None = None,
) -> Headline:
    """A table cell's figure: ``score`` as the mean in percent, ``compression`` as the range (``named``: see
    :class:`Headline`)."""
    if field == "score":
        return Headline(rows, method, field, "{:.0f} %", where, summary="mean", scale=100, named=named)
    return Headline(rows, method, field, "{:.1f}x", where, summary="range", named=named)


CANDIDATE = "depthweave:quote=3,quote_after=16"
"""The default since spec version 9 as its rows of version 8 are written (thirty-third session): ``quote`` with
passages reaching 16 tokens past the quote."""

CANDIDATE_16 = "depthweave:compression=16.0,quote=3,quote_after=16"
""":data:`CANDIDATE` at ~16x, as its rows are written."""

TODAY = ("depthweave", CANDIDATE)
"""Today's default under both strings it has been written as (:class:`Headline` counts only the rows of either
that are today's configuration)."""

TODAY_16 = ("depthweave:compression=16.0", CANDIDATE_16)
""":data:`TODAY` at ~16x."""

DEFAULT_V8 = "depthweave:quote=0,quote_after=48"
"""Spec version 8's default as read today: the figures of its rows that the text names as such carry no note."""

DEFAULT_V8_16 = "depthweave:compression=16.0,quote=0,quote_after=48"
""":data:`DEFAULT_V8` at ~16x."""

_CODE_8K = ("rec-8k-code", "rec-8k-code-seed1")
_VALUES_4K = (("dw-pagechoice-4k", "now-values-4k-s1"), ("now-values-4k", "now-values-4k-s1"))
"""The 4K held-out values' folders (`full`'s, the default's): seed 0's samples and seed 1's (thirty-fifth session)."""
_PYDOC_4K = ("now-pydoc-4k", "now-pydoc-4k-s1")
NOW_ROWS: tuple[tuple[str, str, int, str | tuple[str, ...], str | tuple[str, ...]], ...] = (
    ("mq-4k", "niah_multiquery", 4096, "dw20-mq-4k", "recall-mq-4k"),
    ("mk-4k", "niah_multikey", 4096, "dw20-mk-4k", "recall-mk-4k"),
    ("code-4k", "code", 4096, "dw-code-4k-v4", "recall-code-4k"),
    ("common-4k", "niah_multiquery_common", 4096, _VALUES_4K[0], _VALUES_4K[1]),
    ("hex-4k", "niah_multivalue_hex", 4096, _VALUES_4K[0], _VALUES_4K[1]),
    (
        "qa-4k",
        "niah_multiquery_common",
        4096,
        ("dw-pin-qa-4k", "now-qa-4k-s1"),
        ("now-qa-4k", "now-qa-4k-s1"),
    ),
    ("pydoc-4k", "niah_multiquery_common", 4096, ("dw-pin-pydoc-4k", "now-pydoc-4k-s1"), _PYDOC_4K),
    ("mq-8k", "niah_multiquery", 8192, "recall-8k-mq", "recall-8k-mq"),
    (
        "common-8k",
        "niah_multiquery_common",
        8192,
        ("records-8k-values", "now-values-8k-s1"),
        ("recall-8k-values", "now-values-8k-s1"),
    ),
    (
        "hex-8k",
        "niah_multivalue_hex",
        8192,
        ("recall2-8k-hex", "now-values-8k-s1"),
        ("recall2-8k-hex", "now-values-8k-s1"),
    ),
    ("qa-8k", "niah_multiquery_common", 8192, "recall-8k-qa", "recall-8k-qa"),
    (
        "pydoc-8k",
        "niah_multiquery_common",
        8192,
        ("recall-8k-pydoc", "now-pydoc-8k-s1"),
        ("recall-8k-pydoc", "now-pydoc-8k-s1"),
    ),
    ("code-8k", "code", 8192, _CODE_8K, _CODE_8K),
)
"""The README's table of DepthWeave's default (rows written as ``depthweave`` since spec version 9 or as
:data:`CANDIDATE` by version 8, the same configuration; the 4K held-out rows are the thirty-fifth session's; the
``qa-8k`` row, whose question is prefilled with its document so ``quote`` cannot act, has the rows of spec version
8's default, ``depthweave:recall=8``): (name, task, context, `full`'s run folders, the default's); each row's two
methods ran on the same samples."""

QUOTE_REPEATS = "depthweave:quote_repeats=4"
"""``quote`` on runs the document said up to four times (a multi-value needle's key), an option (thirty-fifth
session)."""

H4_ROWS: tuple[tuple[str, str, str, str, str], ...] = (
    ("common", "niah_multiquery_common", "dw-pagechoice-4k", "now-values-4k", "now-values-4k-s1"),
    ("hex", "niah_multivalue_hex", "dw-pagechoice-4k", "now-values-4k", "now-values-4k-s1"),
    ("qa", "niah_multiquery_common", "dw-pin-qa-4k", "now-qa-4k", "now-qa-4k-s1"),
    ("pydoc", "niah_multiquery_common", "dw-pin-pydoc-4k", "now-pydoc-4k", "now-pydoc-4k-s1"),
)
"""The 4K held-out values: (name, task, `full`'s folder for seed 0's samples, the default's, seed 1's folder with
both and ``depthweave:quote=0``)."""

SINKS = "depthweave:sinks=64"
"""Today's default with the prompt's first 64 tokens exact (the system prompt and the task's instruction), an
option (thirty-sixth session)."""

SINK_FOLDERS: dict[str, str | tuple[str, ...]] = {
    "common-4k": ("sk-values-4k", "sk-values-4k-s1"),
    "hex-4k": ("sk-values-4k", "sk-values-4k-s1"),
    "qa-4k": ("sk-qa-4k", "sk-qa-4k-s1"),
    "pydoc-4k": ("sk-pydoc-4k", "sk-pydoc-4k-s1"),
    "mq-4k": "sk-mq-4k",
    "mk-4k": "sk-mk-4k",
    "code-4k": "sk-code-4k",
    "common-8k": ("sk-values-8k", "now-values-8k-s1"),
    "hex-8k": ("sk-values-8k", "now-values-8k-s1"),
    "qa-8k": "sk-qa-8k",
    "pydoc-8k": ("sk-pydoc-8k", "now-pydoc-8k-s1"),
}
"""The folders of :data:`SINKS`'s rows on the samples of the README's default table (:data:`NOW_ROWS`), by its
row names (thirty-sixth session)."""

OVER = "depthweave:quote_over=cache"
"""Today's default with each quoted passage rebuilt over the compressed cache instead of 64 tokens of its ids, an
option (thirty-eighth session)."""

OVER_ROWS: tuple[tuple[str, str, int, tuple[tuple[int, str, str | tuple[str, ...]], ...]], ...] = (
    (
        "common-4k",
        "niah_multiquery_common",
        4096,
        ((0, "ov-values-4k", "now-values-4k"), (1, "ov-values-4k-s1", "now-values-4k-s1")),
    ),
    (
        "hex-4k",
        "niah_multivalue_hex",
        4096,
        ((0, "ov-values-4k", "now-values-4k"), (1, "ov-values-4k-s1", "now-values-4k-s1")),
    ),
    (
        "pydoc-4k",
        "niah_multiquery_common",
        4096,
        ((0, "ov-pydoc-4k", "now-pydoc-4k"), (1, "ov-pydoc-4k-s1", "now-pydoc-4k-s1")),
    ),
    ("common-8k", "niah_multiquery_common", 8192, ((1, "ov-values-8k-s1", "now-values-8k-s1"),)),
    ("hex-8k", "niah_multivalue_hex", 8192, ((1, "ov-values-8k-s1", "now-values-8k-s1"),)),
    ("pydoc-8k", "niah_multiquery_common", 8192, ((1, "ov-pydoc-8k-s1", "now-pydoc-8k-s1"),)),
)
""":data:`OVER` beside `full` and the default on the samples of the README's held-out rows: (name, task, context,
per seed (seed, the folder of `full`'s and :data:`OVER`'s rows, the default's folder))."""

ROUTER = "depthweave:router=True"
"""Today's default with the token router on (exact rows and rank buckets by attention received, novelty and
content; off by default since the WikiText ablation in docs/findings.md, "Ablation: what each part buys"), thirty-ninth
session."""

ROUTER_ROWS: tuple[tuple[str, str, int, str, str], ...] = (
    ("common-8k", "niah_multiquery_common", 8192, "rt-values-8k-s1", "now-values-8k-s1"),
    ("hex-8k", "niah_multivalue_hex", 8192, "rt-values-8k-s1", "now-values-8k-s1"),
    ("common-4k", "niah_multiquery_common", 4096, "rt-values-4k-s1", "now-values-4k-s1"),
    ("hex-4k", "niah_multivalue_hex", 4096, "rt-values-4k-s1", "now-values-4k-s1"),
)
""":data:`ROUTER` beside `full` and the default on seed 1's held-out samples: (name, task, context, the folder of
`full`'s rows (copied from the default's folder: the same samples) and :data:`ROUTER`'s, the default's folder)."""

X8_ROWS: tuple[tuple[str, str, str, str, str], ...] = (
    ("mk", "niah_multikey", "dw-8k-v4", "rec-8k-mk", CANDIDATE),
    ("mq", "niah_multiquery", "dw-8k-v4", "v8-8k", CANDIDATE),
    ("word", "niah_word", "dw-8k-v4-b", "v8-8k", CANDIDATE),
    ("uuid", "niah_uuid", "dw-8k-v4-b", "v8-8k", CANDIDATE),
    ("code", "code", "dw-8k-v4-b", "rec-8k-code", CANDIDATE),
)
"""The README's xKV table at 8K (pydoc haystack, code): (name, task, the folder of `full` and `xkv`, the folder
of DepthWeave's default on the same samples (its rows written as :data:`CANDIDATE`), its spec; DepthWeave at 16x
is :data:`CANDIDATE_16` in ``v8-8k``, the same samples)."""

QUOTE_ROWS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...] = (
    (
        "word",
        "niah_word",
        "v8-8k",
        (
            ("full", "full"),
            ("dw", "depthweave"),
            ("q", "depthweave:quote=3"),
            ("dw16", "depthweave:compression=16.0"),
            ("q16", "depthweave:compression=16.0,quote=3"),
        ),
    ),
    (
        "word-s1",
        "niah_word",
        "v8-8k-word-s1",
        (("full", "full"), ("dw", "depthweave"), ("q", "depthweave:quote=3")),
    ),
    ("mq", "niah_multiquery", "v8-8k", (("full", "full"), ("dw", "depthweave"), ("q", "depthweave:quote=3"))),
    (
        "pydoc",
        "niah_multiquery_common",
        "recall-8k-pydoc",
        (("full", "full"), ("dw", "depthweave:recall=8"), ("q", "depthweave:quote=3")),
    ),
)
"""``depthweave:quote=3`` beside `full` and today's default on the same samples (thirty-first session): (name,
task, run folder at 8K, (short, method) pairs)."""


def _seed0(folders: str | tuple[str, ...]) -> str:
    """The first of a row's run folders (seed 0's samples): the tables of the thirty-second and thirty-third
    sessions ran there only, before :data:`NOW_ROWS` gained seed 1's 8K folders."""
    return folders if isinstance(folders, str) else folders[0]


Q9_ROWS: tuple[tuple[str, str, int, str | tuple[str, ...], str | tuple[str, ...], str], ...] = (
    *(
        (name, task, context, _seed0(full), _seed0(dw), "depthweave:recall=8")
        for name, task, context, full, dw in NOW_ROWS
        if name in ("mq-8k", "common-8k", "hex-8k", "pydoc-8k")
    ),
    ("mk-8k", "niah_multikey", 8192, "dw-8k-v4", "rec-8k-mk", "depthweave:recall=8"),
    ("mq-8k-pydoc", "niah_multiquery", 8192, "v8-8k", "v8-8k", "depthweave"),
    ("word-8k", "niah_word", 8192, "v8-8k", "v8-8k", "depthweave"),
    ("word-8k-s1", "niah_word", 8192, "v8-8k-word-s1", "v8-8k-word-s1", "depthweave"),
    ("uuid-8k", "niah_uuid", 8192, "v8-8k", "v8-8k", "depthweave"),
)
"""``depthweave:quote=3`` on the 8K samples of the tables of today's default (thirty-second session): (name,
task, context, `full`'s run folders, the folders of the default's rows and of ``quote=3``'s (the same samples),
the default as its rows are written)."""

QUOTE_VARIANTS: tuple[tuple[str, str, str, str], ...] = (
    ("mq-ctx", "niah_multiquery", "recall-8k-mq", "depthweave:quote=3,quote_context=512"),
    ("mq-b16", "niah_multiquery", "recall-8k-mq", "depthweave:quote=3,recall_bits=16"),
    ("word-ctx", "niah_word", "v8-8k", "depthweave:quote=3,quote_context=512"),
    ("mq-after", "niah_multiquery", "recall-8k-mq", "depthweave:quote=3,quote_after=16"),
    ("word-after", "niah_word", "v8-8k", "depthweave:quote=3,quote_after=16"),
    ("common-after", "niah_multiquery_common", "recall-8k-values", "depthweave:quote=3,quote_after=16"),
    ("mqp-after", "niah_multiquery", "v8-8k", "depthweave:quote=3,quote_after=16"),
    ("uuid-after", "niah_uuid", "v8-8k", "depthweave:quote=3,quote_after=16"),
)
"""``quote=3`` with 512 tokens of context per passage, its passages at 16 bits, or reaching 16 tokens past the
quote (thirty-second session): (name, task, run folder at 8K, spec)."""

C9_ROWS: tuple[tuple[str, str, int, str | tuple[str, ...], str | tuple[str, ...], str], ...] = (
    *Q9_ROWS,
    *(
        (name, task, context, full, dw, "depthweave:recall=8")
        for name, task, context, full, dw in NOW_ROWS
        if name in ("mq-4k", "mk-4k", "code-4k", "code-8k")
    ),
)
""":data:`CANDIDATE` on the samples of every table of today's default without a question fed first (thirty-third
session): (name, task, context, `full`'s run folders, the folders of the default's rows and of the candidate's,
the default as its rows are written)."""

LONGGEN_BASELINES: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("quant", "quant", (1024, 4096, 8192)),
    ("dkcache", "dkcache", (1024, 4096, 8192)),
    ("xkv", "xkv", (1024, 4096, 8192)),
    ("snapkv", "snapkv", (1024, 4096, 8192)),
    ("h2o", "h2o", (1024, 4096, 8192)),
)
"""The baselines' long-generation cells (every baseline at every N since the thirty-fifth session)."""


HEADLINES: dict[str, Headline] = {
    **{
        f"{short}-16k-speed": Headline(
            RUNS_16K, method, "speedup", "{:.2f}x", (("context", 16384),), summary="range"
        )
        for short, method in (("dw", "depthweave"), ("dk", "dkcache"), ("q4", "quant:bits=4"))
    },
    **{
        f"{short}-16k-speed-now": Headline(
            RUNS_16K_NOW, method, "speedup", "{:.2f}x", (("context", 16384),), summary="range"
        )
        for short, method in (("dw", "depthweave"), ("dk", "dkcache"), ("q4", "quant:bits=4"))
    },
    "dk-16k-of-bound-now": Headline(
        RUNS_16K_NOW, "dkcache", "of_bound", "{:.0%}", (("context", 16384),), summary="range"
    ),
    **{
        f"{short}-16k-{what}-v6": Headline(
            "docs/data/bench/bench-16k-v9.jsonl", method, field, "{:.2f}x", (("context", 16384),)
        )
        for short, method in (("dw", "depthweave"), ("dk", "dkcache"), ("q4", "quant:bits=4"))
        for what, field in (("speed", "speedup"), ("bound", "bound"))
    },
    **{
        f"{short}-16k-{what}-v7": Headline(
            "docs/data/bench/bench-16k-v10.jsonl", method, field, "{:.2f}x", (("context", 16384),)
        )
        for short, method in (("dw", "depthweave"), ("dwr", "depthweave:recall=8"))
        for what, field in (("speed", "speedup"), ("bound", "bound"))
        if (short, what) != ("dwr", "bound")  # the same bound as the default's
    },
    **{
        f"{short}-16k-{what}-v8": Headline(
            "docs/data/bench/bench-16k-v11.jsonl",
            method,
            field,
            "{:.2f}x",
            (("context", 16384),),
            named=named,  # spec version 8's rows: the bench asks no question, so quote never acts
        )
        for short, method, named in (
            ("dw", "depthweave", DEFAULT_V8),
            ("dw0", "depthweave:recall=0", "depthweave:recall=0,quote=0,quote_after=48"),
        )
        for what, field in (("speed", "speedup"), ("bound", "bound"))
        if (short, what) != ("dw0", "bound")  # the same bound as the default's
    },
    **{
        f"{short}-repeat-16k-{what}": Headline(
            "docs/data/bench/recall-speed-16k-v2.jsonl",
            method,
            field,
            fmt,
            (("kind", "summary"), ("phase", "next")),
        )
        for short, method in (("full", "full"), ("dw", "depthweave"), ("dwr", "depthweave:recall=8"))
        for what, field, fmt in (("loss", "loss", "{:.2f}"), ("speed", "speedup", "{:.2f}x"))
        if (short, what) != ("full", "speed")  # the reference: 1.00x
    },
    **{  # a question's passages held (recall_speed.py's quote phase, thirty-fourth session)
        f"qs-{short}-16k-{phase}-{what}": Headline(
            "docs/data/bench/quote-speed-16k.jsonl",
            method,
            field,
            fmt,
            (("kind", "summary"), ("phase", phase)),
            scale=scale,
        )
        for short, method in (("full", "full"), ("dw", "depthweave"), ("dw0", "depthweave:quote=0"))
        for phase in ("next", "copy", "other", "quote")
        for what, field, fmt, scale in (
            ("speed", "speedup", "{:.2f}x", 1.0),
            ("loss", "loss", "{:.2f}", 1.0),
            ("question", "ms_question", "{:.1f} s", 0.001),
        )
        if (short, what) != ("full", "speed") and (what != "question" or phase == "quote")
    },
    "dw-16k-bound": Headline(
        "docs/data/bench/bench-16k-v4.jsonl", "depthweave", "bound", "{:.2f}x", (("context", 16384),)
    ),
    "dk-16k-mib": Headline(
        "docs/data/bench/bench-16k-v4.jsonl",
        "dkcache",
        "kv_bytes",
        "{:.0f} MiB",
        (("context", 16384),),
        scale=2**-20,
    ),
    "dk-16k-compression": Headline(
        "docs/data/bench/bench-16k-v4.jsonl", "dkcache", "compression", "{:.2f}x", (("context", 16384),)
    ),
    **{
        f"{short}-{point}-speed": Headline(
            "docs/data/bench/bench-scale-v4.jsonl",
            method,
            "speedup",
            "{:.2f}x",
            (("context", context), ("batch", batch)),
        )
        for short, method in (("dw", "depthweave"), ("dk", "dkcache"), ("q4", "quant:bits=4"))
        for point, context, batch in (("32k", 32768, 1), ("16kb4", 16384, 4))
    },
    **{  # the llama-3.1-8b shape (4 layers, random weights) at 32K x 4, prefilled in chunks (fourteenth session)
        f"{short}-llama32kb4-{what}": Headline(
            "docs/data/bench/bench-llama-32k-b4.jsonl",
            method,
            field,
            fmt,
            (("context", 32768), ("batch", 4)),
        )
        for short, method in (("dw", "depthweave"), ("dk", "dkcache"), ("q4", "quant:bits=4"))
        for what, field, fmt in (("speed", "speedup", "{:.2f}x"), ("bound", "bound", "{:.2f}x"))
    },
    **{
        f"{short}-{task_short}-4k-{what}": Headline(
            "docs/data/runs/xkv-4k/rows.jsonl",
            method,
            field,
            fmt,
            (("task", task), ("context", 4096)),
            summary=summary,
            scale=scale,
        )
        for short, method in (("xkv", "xkv"), ("dwx", "depthweave"), ("fullx", "full"))
        for task_short, task in (("mq", "niah_multiquery"), ("mk", "niah_multikey"))
        for what, field, fmt, summary, scale in (
            ("score", "score", "{:.0f} %", "mean", 100),
            ("compression", "compression", "{:.1f}x", "range", 1.0),
        )
        if (short, what) != ("fullx", "compression")  # full's 0.5x is no headline
    },
    "dk16-16k-speed": Headline(
        "docs/data/bench/bench-16k.jsonl", "dkcache:bits=16", "speedup", "{:.2f}x", (("context", 16384),)
    ),
    "dw-mq-4k-score": Headline(
        "docs/data/runs/dw-records-mq-4k/rows.jsonl",
        "depthweave:protect_names=2,protect_records=6",
        "score",
        "{:.0f} %",
        (("task", "niah_multiquery"), ("context", 4096)),
        summary="mean",
        scale=100,
    ),
    "dw-mq-4k-compression": Headline(
        "docs/data/runs/dw-records-mq-4k/rows.jsonl",
        "depthweave:protect_names=2,protect_records=6",
        "compression",
        "{:.1f}x",
        (("task", "niah_multiquery"), ("context", 4096)),
        summary="range",
    ),
    **{
        f"{short}-mq-4k-score": Headline(
            f"docs/data/runs/{folder}/rows.jsonl",
            method,
            "score",
            "{:.0f} %",
            (("task", "niah_multiquery"), ("context", 4096)),
            summary="mean",
            scale=100,
        )
        for short, folder, method in (
            ("full", "dw20-mq-4k", "full"),
            ("dw6", "dw-names-mq-4k", "depthweave:protect_names=2"),
        )
    },
    "dw-mk-4k-score": Headline(
        "docs/data/runs/dw-v7-mk-4k/rows.jsonl",
        "depthweave",
        "score",
        "{:.0f} %",
        (("task", "niah_multikey"), ("context", 4096)),
        summary="mean",
        scale=100,
    ),
    "dw-mk-4k-compression": Headline(
        "docs/data/runs/dw-v7-mk-4k/rows.jsonl",
        "depthweave",
        "compression",
        "{:.1f}x",
        (("task", "niah_multikey"), ("context", 4096)),
        summary="range",
    ),
    "dw-mk-4k-v1-compression": Headline(
        "docs/data/runs/niah-4k/rows.jsonl",
        "depthweave",
        "compression",
        "{:.1f}x",
        (("task", "niah_multikey"), ("context", 4096)),
        summary="range",
    ),
    **{
        f"vllm-{name}-tpot-c1": Headline(
            "docs/data/vllm/load-1k-kernel/rows.jsonl",
            method,
            "tpot_median_s",
            "{:.3f}",
            (("concurrency", 1), ("kernel", kernel)),
            kvweave_spec=False,
        )
        for name, method, kernel in (
            ("none", "none", None),
            ("q4", "quant:bits=4", "auto"),
            ("q4torch", "quant:bits=4", "torch"),
        )
    },
    **{
        f"vllm-{short}-c32-{field_short}": Headline(
            "docs/data/vllm/load-2k/rows.jsonl",
            method,
            field,
            fmt,
            (("concurrency", 32), ("kernel", kernel)),
            kvweave_spec=False,
        )
        for short, method, kernel in (
            ("none", "none", None),
            ("q4", "quant:bits=4", "auto"),
            ("q2", "quant:bits=2", "auto"),
            ("dw", "depthweave", "auto"),
        )
        for field_short, field, fmt in (
            ("tok-s", "output_tokens_per_s", "{:.2f}"),
            ("running", "max_running", "{:.0f}"),
            ("tpot", "tpot_median_s", "{:.1f}"),
        )
        if field_short != "running" or short in ("none", "q4")
    },
    **{
        f"vllm-{short}-{point}-tok-s": Headline(
            f"docs/data/vllm/{folder}/rows.jsonl",
            method,
            "output_tokens_per_s",
            "{:.2f}",
            (("concurrency", 32), ("kernel", kernel)),
            kvweave_spec=False,
        )
        for short, method, kernel in (("none", "none", None), ("q4", "quant:bits=4", "auto"))
        for point, folder in (
            ("c32v4", "load-2k-v4"),
            ("c32t256", "load-2k-256"),
            ("c32t256v6", "load-2k-256-v6"),
            ("c32t256v6b", "load-2k-256-v6-rerun"),
            ("c32k4t1024", "load-4k-1024-v8"),  # 4K prompts, 1,024 tokens: ~8 full-cache requests fit
        )
    },
    **{  # 16 requests of 4K at once in a KV space that holds ~8 of vLLM's own, 256 tokens each: depthweave's
        # selective decode beside vLLM's own cache and quant:bits=4 (eighteenth session)
        f"vllm-{short}-c16k4t256-{field_short}": Headline(
            "docs/data/vllm/load-4k-256-dw/rows.jsonl",
            method,
            field,
            fmt,
            (("concurrency", 16), ("kernel", kernel)),
            kvweave_spec=False,
        )
        for short, method, kernel in (
            ("none", "none", None),
            ("q4", "quant:bits=4", "auto"),
            ("dw512", "depthweave:decode_tokens=512", "auto"),
        )
        for field_short, field, fmt in (
            ("tok-s", "output_tokens_per_s", "{:.2f}"),
            ("running", "max_running", "{:.0f}"),
            ("wall", "wall_s", "{:,.0f}"),
            ("ttft", "ttft_median_s", "{:.0f}"),
            ("tpot", "tpot_median_s", "{:.2f}"),
        )
    },
    **{  # make vllm-bench's grid: the KV tokens vLLM reported for each method (nineteenth session)
        f"vllm-grid-{short}-kv": Headline(
            "docs/data/vllm/load-grid-2k/rows.jsonl",
            method,
            "kv_tokens",
            "{:,.0f}",
            (("concurrency", 32),),
            kvweave_spec=False,
        )
        for short, method in (
            ("none", "none"),
            ("q4", "quant:bits=4"),
            ("q2", "quant:bits=2"),
            ("dw", "depthweave"),
        )
    },
    **{  # depthweave's fused decode kernel beside its torch paths and vLLM's own (thirteenth session), and
        # again after the store of a step's decode rows was batched (fourteenth session, v2)
        f"{prefix}-{short}-{tokens // 1024}k-r{rows}": Headline(
            f"docs/data/vllm/{rows_file}.jsonl",
            method,
            "ms_per_step",
            "{:.2f}" if rows == 1 else "{:.1f}",
            (("path", path), ("tokens", tokens), ("rows", rows)),
            kvweave_spec=False,
        )
        for prefix, rows_file in (
            ("vllm-stepw", "decode-step-weave"),
            ("vllm-stepw2", "decode-step-weave-v2"),
            ("vllm-stepw3", "decode-step-weave-v3"),  # the key rebuild in registers (sixteenth session)
        )
        for short, method, path in (
            ("none", "none", "vllm"),
            ("dw", "depthweave", "fused"),
            ("dwtorch", "depthweave", "factored"),
        )
        for tokens in (2048, 4096)
        for rows in (1, 32)
    },
    **{  # depthweave's selective decode (decode_tokens) beside reading every block (eighteenth session): v4
        # rows with the store and block choice in torch, v5 rows with both in C++
        f"vllm-stepw{version}-{short}-{tokens // 1024}k-r{rows}{suffix}": Headline(
            f"docs/data/vllm/decode-step-weave-v{version}.jsonl",
            method,
            field,
            fmt,
            (("path", path), ("tokens", tokens), ("rows", rows)),
            kvweave_spec=False,
        )
        for short, method, path in (
            ("none", "none", "vllm"),
            ("dw", "depthweave", "fused"),
            ("dw512", "depthweave:decode_tokens=512", "fused"),
            ("dw1024", "depthweave:decode_tokens=1024", "fused"),
        )
        for version in (4, 5)
        for tokens in (2048, 4096, 8192)
        for rows in (1, 32)
        for suffix, field, fmt in (
            ("", "ms_per_step", "{:.2f}" if rows == 1 else "{:.1f}"),
            ("-vs", "vs_vllm", "{:.2f}x"),
        )
        if suffix == "" or short not in ("none", "dw")
    },
    **{
        f"vllm-step-{short}-{tokens // 1024}k-r{rows}": Headline(
            f"docs/data/vllm/{rows_file}.jsonl",
            method,
            "ms_per_step",
            "{:.2f}" if rows == 1 else "{:.1f}",
            (("path", path), ("tokens", tokens), ("rows", rows)),
            kvweave_spec=False,
        )
        for short, method, path, rows_file in (
            ("none", "none", "vllm", "decode-step-quant"),  # 9 rounds of 20 steps: vLLM's own and quant
            ("q4", "quant:bits=4", "fused", "decode-step-quant"),
            ("q2", "quant:bits=2", "fused", "decode-step-quant"),
            ("dwnone", "none", "vllm", "decode-step"),  # 5 rounds of 10, with depthweave in the same run
            ("dw", "depthweave", "factored", "decode-step"),
        )
        for tokens in (2048, 4096)
        for rows in (1, 32)
        if rows == 32 or not short.startswith("dw")
    },
    **{  # v6: the AVX2 tile and the step's bookkeeping on Python ints (twelfth session); v8: the write hook in one
        # C++ call, int lists straight to the kernel, per-thread scratch (thirteenth session)
        f"vllm-step{version}-{short}-{tokens // 1024}k-r{rows}{suffix}": Headline(
            f"docs/data/vllm/decode-step-quant-v{version}.jsonl",
            method,
            field,
            fmt,
            (("path", path), ("tokens", tokens), ("rows", rows)),
            kvweave_spec=False,
        )
        for version in (6, 8)
        for short, method, path in (
            ("none", "none", "vllm"),
            ("q4", "quant:bits=4", "fused"),
            ("q2", "quant:bits=2", "fused"),
        )
        for tokens in (2048, 4096)
        for rows in (1, 32)
        for suffix, field, fmt in (
            ("", "ms_per_step", "{:.2f}" if rows == 1 else "{:.1f}"),
            ("-vs", "vs_vllm", "{:.2f}x"),
        )
        if suffix == "" or short != "none"
    },
    **{
        f"vllm-{short}-kv-tokens": Headline(
            "docs/data/vllm/depthweave-4k/rows.jsonl",
            method,
            "kv_tokens",
            "{:,.0f}",
            (("task", "niah_multikey"),),
            kvweave_spec=False,
        )
        for short, method in (("none", "none"), ("dw", "depthweave"), ("q2", "quant:bits=2"))
    },
    **{
        f"vllm-{short}-{task_short}-4k-score": Headline(
            "docs/data/vllm/depthweave-4k/rows.jsonl",
            method,
            "score",
            "{:.0f} %",
            (("task", task),),
            scale=100,
            kvweave_spec=False,
        )
        for short, method in (
            ("none", "none"),
            ("dw", "depthweave"),
            ("q2", "quant:bits=2"),
            ("dw512", "depthweave:decode_tokens=512"),
            ("dw1024", "depthweave:decode_tokens=1024"),
        )
        for task_short, task in (("pk", "passkey"), ("mk", "niah_multikey"), ("mq", "niah_multiquery"))
        if (short, task_short) not in (("none", "pk"), ("dw1024", "pk"))  # not run on passkey
    },
    **{
        f"dw-prefill-{context // 1024}k{suffix}": Headline(
            f"docs/data/bench/bench-prefill-{version}.jsonl",
            "depthweave",
            "prefill_vs_full",
            "{:.2f}x",
            (("context", context),),
        )
        for suffix, version in (("", "v5"), ("-v6", "v6"))
        for context in (8192, 16384)
    },
    **{
        f"longgen-{short}-{n // 1024}k-{field}": _cell(
            LONGGEN_ROWS[n], method, field, (("task", "niah_multikey"), ("generated", n))
        )
        for n in LONGGEN_ROWS
        for short, method in (
            ("full", "full"),
            ("dw", "depthweave:protect_records=6"),
            ("dw8", "depthweave:recall=8"),  # the default since spec version 8
        )
        for field in ("score", "compression")
        if (short, field) != ("full", "compression")
    },
    # the default since spec version 8 (recall) on the tables the spec-version-7 figures above come from
    **{
        f"dw8-{task_short}-4k-{field}": _cell(
            _runs(folder), "depthweave:recall=8", field, (("task", task), ("context", 4096))
        )
        for task_short, task, folder in (
            ("mq", "niah_multiquery", "recall-mq-4k"),
            ("mk", "niah_multikey", "recall-mk-4k"),
        )
        for field in ("score", "compression")
    },
    **{  # 8K multi-key and code (12 samples), the default since spec version 8 beside `full`
        f"{short}-{task_short}-8k-score": Headline(
            rows, method, "score", fmt, (("task", task), ("context", 8192)), summary="mean", scale=100
        )
        for task_short, task, rows, fmt in (
            ("mk", "niah_multikey", "docs/data/runs/rec-8k-mk/rows.jsonl", "{:.0f} %"),
            (
                "code",
                "code",
                ("docs/data/runs/rec-8k-code/rows.jsonl", "docs/data/runs/rec-8k-code-seed1/rows.jsonl"),
                "{:.1f} %",
            ),
        )
        for short, method in (("full", "full"), ("dw8", "depthweave:recall=8"))
    },
    **{
        f"rec8k-dw8-{task_short}": Headline(
            f"docs/data/runs/{folder}/rows.jsonl",
            "depthweave:recall=8",
            "score",
            "{:.0f} %",
            (("task", task), ("context", 8192)),
            summary="mean",
            scale=100,
        )
        for task_short, task, folder in (
            ("common", "niah_multiquery_common", "recall-8k-values"),
            ("hex", "niah_multivalue_hex", "recall2-8k-hex"),
            ("qa", "niah_multiquery_common", "recall-8k-qa"),
        )
    },
    **{
        f"rec8k-{short}-{task_short}": Headline(
            f"docs/data/runs/records-8k-{folder}/rows.jsonl",
            method,
            "score",
            "{:.0f} %",
            (("task", task), ("context", 8192)),
            summary="mean",
            scale=100,
        )
        for short, method in (
            ("full", "full"),
            ("dw", "depthweave:protect_records=6"),
            ("v6", "depthweave"),
        )
        for task_short, task, folder in (
            ("common", "niah_multiquery_common", "values"),
            ("hex", "niah_multivalue_hex", "values"),
            ("qa", "niah_multiquery_common", "qa"),
        )
    },
    **{
        f"code4k-{short}": Headline(
            "docs/data/runs/dw-code-4k-v4/rows.jsonl",
            method,
            "score",
            "{:.0f} %",
            (("task", "code"), ("context", 4096)),
            summary="mean",
            scale=100,
        )
        for short, method in (
            ("full", "full"),
            ("dw", "depthweave"),
            ("dw16", "depthweave:compression=16.0"),
            ("xkv", "xkv"),
        )
    },
    # the README's table of today's default beside `full` (each row's two methods on the same samples)
    **{
        f"now-{name}-{short}": _cell(
            _runs(runs),
            method,
            field,
            (("task", task), ("context", context)),
            named=DEFAULT_V8 if name == "qa-8k" else None,  # the README says whose rows these are
        )
        for name, task, context, full_runs, default_runs in NOW_ROWS
        for short, runs, method, field in (
            ("full", full_runs, "full", "score"),
            ("dw", default_runs, TODAY if name != "qa-8k" else "depthweave:recall=8", "score"),
            ("dwx", default_runs, TODAY if name != "qa-8k" else "depthweave:recall=8", "compression"),
        )
    },
    # the prompt's head exact (thirty-sixth session): SINKS on the default table's samples
    **{
        f"now-{name}-{short}": _cell(
            _runs(SINK_FOLDERS[name]), SINKS, field, (("task", task), ("context", context))
        )
        for name, task, context, _, _ in NOW_ROWS
        if name in SINK_FOLDERS
        for short, field in (("sk", "score"), ("skx", "compression"))
    },
    # quoted passages rebuilt over the compressed cache (thirty-eighth session), per seed and over both
    **{
        f"ov-{name}-s{seed}-{short}": _cell(
            _runs(runs), method, field, (("task", task), ("context", context))
        )
        for name, task, context, seeds in OVER_ROWS
        for seed, folder, default in seeds
        if seed == 1  # the findings' table of seed 1's samples (seed 0's count in the 12-trial figures)
        for short, runs, method, field in (
            ("full", folder, "full", "score"),
            ("dw", default, TODAY, "score"),
            ("ov", folder, OVER, "score"),
        )
    },
    **{
        f"ov-{name}-{short}": _cell(
            _runs(tuple(str(entry[column]) for entry in seeds)),
            method,
            field,
            (("task", task), ("context", context)),
        )
        for name, task, context, seeds in OVER_ROWS
        if len(seeds) > 1
        for short, column, method, field in (
            ("full", 1, "full", "score"),
            ("dw", 2, TODAY, "score"),
            ("ov", 1, OVER, "score"),
            ("ovx", 1, OVER, "compression"),
        )
    },
    # the token router on, seed 1's held-out samples (thirty-ninth session)
    **{
        f"rt-{name}-s1-{short}": _cell(_runs(runs), method, field, (("task", task), ("context", context)))
        for name, task, context, folder, default in ROUTER_ROWS
        for short, runs, method, field in (
            ("full", folder, "full", "score"),
            ("dw", default, TODAY, "score"),
            ("rt", folder, ROUTER, "score"),
            ("rtx", folder, ROUTER, "compression"),
        )
    },
    # the README's xKV table: the 8K tables' samples, xKV at 8x, DepthWeave at 8x and at 16x
    **{
        f"x8-{name}-{short}": _cell(_runs(runs), method, "score", (("task", task), ("context", 8192)))
        for name, task, folder, dw_folder, dw_method in X8_ROWS
        for short, runs, method in (
            ("full", folder, "full"),
            ("dw", dw_folder, dw_method),
            ("xkv", folder, "xkv"),
            ("dw16", "v8-8k", CANDIDATE_16),
        )
    },
    **{  # the xKV table's code row over 12 trials: its samples and seed 1's (thirty-fourth session)
        f"x8c12-{short}": _cell(_runs(folders), method, "score", (("task", "code"), ("context", 8192)))
        for short, method, folders in (
            ("full", "full", ("dw-8k-v4-b", "rec-8k-code-seed1")),
            ("dw", CANDIDATE, ("rec-8k-code", "rec-8k-code-seed1")),
            ("xkv", "xkv", ("dw-8k-v4-b", "x8-code-seed1")),
            ("dw16", TODAY_16, ("v8-8k", "x8-code-seed1")),
        )
    },
    "x8c12-dw16x": _cell(
        _runs(("v8-8k", "x8-code-seed1")), TODAY_16, "compression", (("task", "code"), ("context", 8192))
    ),
    **{  # the 4K held-out values by sample set (findings, thirty-fifth session)
        f"h4-{name}-{short}": _cell(_runs(folder), method, "score", (("task", task), ("context", 4096)))
        for name, task, full0, dw0, seed1 in H4_ROWS
        for short, folder, method in (
            ("s0-full", full0, "full"),
            ("s0-dw", dw0, TODAY),
            ("s1-full", seed1, "full"),
            ("s1-dw", seed1, TODAY),
            *((("s1-q0", seed1, "depthweave:quote=0"),) if name != "qa" else ()),
            *((("s0-qr", dw0, QUOTE_REPEATS),) if name == "hex" else ()),
            *((("s1-qr", seed1, QUOTE_REPEATS),) if name in ("hex", "common") else ()),
            ("s0-sk", SINK_FOLDERS[f"{name}-4k"][0], SINKS),
            ("s1-sk", SINK_FOLDERS[f"{name}-4k"][1], SINKS),
        )
    },
    **{
        f"h4-{name}-qr12": _cell(_runs(("now-values-4k", "now-values-4k-s1")), QUOTE_REPEATS, field, where)
        for name, field, where in (
            ("hex", "score", (("task", "niah_multivalue_hex"), ("context", 4096))),
            ("hexx", "compression", (("task", "niah_multivalue_hex"), ("context", 4096))),
        )
    },
    **{  # a 4-bit quantizer on the pydoc haystack's 4K samples, both seeds (thirty-sixth session)
        f"h4-pydoc-q4{short}": _cell(
            _runs(("q4-pydoc-4k", "q4-pydoc-4k-s1")),
            "quant",  # bits=4 is quant's default, written as "quant"
            field,
            (("task", "niah_multiquery_common"), ("context", 4096)),
        )
        for short, field in (("", "score"), ("x", "compression"))
    },
    **{  # the xKV table's compression, over its tasks
        f"x8-{short}-compression": Headline(
            _runs(folders), method, "compression", "{:.1f}x", (("context", 8192),), summary="range"
        )
        for short, method, folders in (
            ("xkv", "xkv", ("dw-8k-v4", "dw-8k-v4-b")),
            ("dw16", CANDIDATE_16, "v8-8k"),
            ("dw8", CANDIDATE, ("rec-8k-mk", "rec-8k-code")),
            ("dw", CANDIDATE, "v8-8k"),
        )
    },
    # quote beside the default (findings, thirty-first session)
    **{
        f"q-{name}-{short}{suffix}": _cell(_runs(folder), method, field, (("task", task), ("context", 8192)))
        for name, task, folder, methods in QUOTE_ROWS
        for short, method in methods
        for suffix, field in (("", "score"), ("x", "compression"))
        if short != "full" or field == "score"
    },
    # quote=3 beside version 8's default on all its tables' samples (findings, thirty-second session)
    **{
        f"q9-{name}-{short}": _cell(_runs(runs), method, field, (("task", task), ("context", context)))
        for name, task, context, full_runs, dw_runs, v8 in Q9_ROWS
        for short, runs, method, field in (
            ("full", full_runs, "full", "score"),
            ("v8", dw_runs, v8, "score"),
            ("q", dw_runs, "depthweave:quote=3", "score"),
            ("qx", dw_runs, "depthweave:quote=3", "compression"),
        )
    },
    **{
        f"qv-{name}{suffix}": _cell(_runs(folder), method, field, (("task", task), ("context", 8192)))
        for name, task, folder, method in QUOTE_VARIANTS
        for suffix, field in (("", "score"), ("x", "compression"))
    },
    # the candidate default beside version 8's default on all its tables' samples (findings, thirty-third session)
    **{
        f"c9-{name}-{short}": _cell(
            _runs(runs), method, field, (("task", task), ("context", context)), named=DEFAULT_V8
        )
        for name, task, context, full_runs, dw_runs, v8 in C9_ROWS
        for short, runs, method, field in (
            ("full", full_runs, "full", "score"),
            ("v8", dw_runs, v8, "score"),
            ("a", dw_runs, CANDIDATE, "score"),
            ("ax", dw_runs, CANDIDATE, "compression"),
        )
    },
    # the candidate default at ~16x beside version 8's default at ~16x, the same samples (findings, thirty-third)
    **{
        f"c16-{name}-{short}": _cell(
            _runs("v8-8k"), method, field, (("task", task), ("context", 8192)), named=DEFAULT_V8_16
        )
        for name, task, *_ in X8_ROWS  # the xKV table's tasks, whose 16x column these rows share
        for short, method, field in (
            ("full", "full", "score"),
            ("v8", "depthweave:compression=16.0", "score"),
            ("v8x", "depthweave:compression=16.0", "compression"),
            ("a", CANDIDATE_16, "score"),
            ("ax", CANDIDATE_16, "compression"),
        )
    },
    # the candidate default's long-generation cells that have rows (findings, thirty-third session)
    **{
        f"longgen-dwq-{n // 1024}k-{field}": _cell(
            LONGGEN_ROWS[n], CANDIDATE, field, (("task", "niah_multikey"), ("generated", n))
        )
        for n in (1024,)
        for field in ("score", "compression")
    },
    **{  # today's default's cells run after the promotion (thirty-fourth session)
        f"longgen-dw9-{n // 1024}k-{field}": _cell(
            rows, "depthweave", field, (("task", "niah_multikey"), ("generated", n))
        )
        for n, rows in LONGGEN_V9.items()
        for field in ("score", "compression")
    },
    **{  # spec version 8's default's cells, named so where the findings set them beside today's
        f"longgen-v8-{n // 1024}k-{field}": _cell(
            LONGGEN_ROWS[n],
            "depthweave:recall=8",
            field,
            (("task", "niah_multikey"), ("generated", n)),
            named=DEFAULT_V8,
        )
        for n in (4096, 8192)
        for field in ("score", "compression")
    },
    # the README's long-generation table: every baseline's cells that have rows
    **{
        f"lg-{short}-{n // 1024}k-{field}": _cell(
            LONGGEN_ROWS[n], method, field, (("task", "niah_multikey"), ("generated", n))
        )
        for short, method, lengths in LONGGEN_BASELINES
        for n in lengths
        for field in ("score", "compression")
    },
}
"""Every headline figure of the README and the findings, by the name its span carries."""


def render(text: str, root: Path = ROOT, headlines: dict[str, Headline] | None = None) -> str:
    """``text`` with every ``<!-- fig:NAME -->`` span rewritten from its rows (unknown names are an error)."""
    table = HEADLINES if headlines is None else headlines

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in table:
            raise KeyError(f"fig:{name} has no entry in kvweave.report.headlines.HEADLINES")
        return f"<!-- fig:{name} -->{table[name].value(root)}<!-- /fig -->"

    return SPAN.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` only check) the headline spans of the given documents."""
    parser = argparse.ArgumentParser(description="Render the headline figures of documents from their rows.")
    parser.add_argument("documents", nargs="+", type=Path, help="markdown files with <!-- fig:NAME --> spans")
    parser.add_argument("--check", action="store_true", help="only say which documents are stale (exit 1)")
    args = parser.parse_args(argv)
    stale = []
    for path in args.documents:
        text = path.read_text()
        rendered = render(text)
        if rendered != text:
            stale.append(str(path))
            if not args.check:
                path.write_text(rendered)
    if args.check and stale:
        print(
            f"stale headline figures in {', '.join(stale)}: run python -m kvweave.report.headlines",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
