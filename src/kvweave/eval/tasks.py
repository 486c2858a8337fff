"""Synthetic long-context tasks for evaluating KV-cache compression.

Independent re-implementation of the RULER task recipes (NIAH variants, variable tracking,
common/frequent words extraction) plus the classic pass-key retrieval task; see
``/work/shared/data/RULER-recipes.md`` for the recipes followed here.

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
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import os
import random
import re
import string
import sysconfig
import tokenize
import uuid
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from pathlib import Path
from typing import Any, Protocol

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
]

DATA_ENV = "KVWEAVE_DATA"
"""Environment variable naming the optional evaluation-data folder."""

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""The classic repeated filler line (RULER ``noise`` haystack, InfiniteBench pass key)."""


# --------------------------------------------------------------------------------------------
# errors, tokenizer protocol, data folder
# --------------------------------------------------------------------------------------------


class TaskDataMissing(FileNotFoundError):
    """An optional data file needed by a task, haystack or corpus is not available."""


class Tokenizer(Protocol):
    """The minimal tokenizer interface used here (Hugging Face tokenizers satisfy it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        ...


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The data folder: ``data_dir`` if given, else ``$KVWEAVE_DATA``, else ``None``."""
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get(DATA_ENV)
    return Path(env) if env else None


def _require_data(relpath: str, what: str, data_dir: str | os.PathLike[str] | None) -> Path:
    """Path of ``relpath`` inside the data folder, or raise :class:`TaskDataMissing`."""
    root = resolve_data_dir(data_dir)
    if root is None:
        raise TaskDataMissing(
            f"{what} needs {relpath!r} from the evaluation-data folder, but none is configured: "
            f"set the {DATA_ENV} environment variable (or pass data_dir=...) to a folder containing it"
        )
    path = root / relpath
    if not path.exists():
        raise TaskDataMissing(
            f"{what} needs {path}, which does not exist; point {DATA_ENV} (or data_dir=...) at a folder "
            f"containing {relpath!r}"
        )
    return path


def _count(tok: Tokenizer, text: str) -> int:
    """Number of tokens of ``text`` (no special tokens)."""
    return len(tok.encode(text, add_special_tokens=False))


def _encode_many(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text; uses a batched ``tok(texts)`` call when the tokenizer offers one."""
    if callable(tok) and texts:
        try:
            ids = tok(list(texts), add_special_tokens=False)["input_ids"]
            if len(ids) == len(texts):
                return [list(x) for x in ids]
        except Exception:  # any failure: fall back to per-text encode
            pass
    return [tok.encode(t, add_special_tokens=False) for t in texts]


# --------------------------------------------------------------------------------------------
# samples and scoring
# --------------------------------------------------------------------------------------------


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


def depths(n: int) -> list[float]:
    """``n`` needle depths spread evenly over 10 %-90 % of the context (``n == 1`` gives 50 %)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return [0.5]
    return [round(0.1 + 0.8 * i / (n - 1), 6) for i in range(n)]


# --------------------------------------------------------------------------------------------
# haystacks and corpora
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Haystack:
    """Filler text as units (sentences or lines) that are joined with ``sep``.

    Needles are inserted between units; on line-based haystacks (code) they get ``line_prefix``.
    """

    name: str
    units: tuple[str, ...]
    sep: str = " "
    line_prefix: str = ""

    @property
    def text(self) -> str:
        """The whole haystack as one string."""
        return self.sep.join(self.units)


HAYSTACKS: dict[str, str] = {
    "pydoc": "CPython documentation prose from pydoc_data.topics (no files needed)",
    "essays": f"Paul Graham essays, ${DATA_ENV}/pg_essays/*.txt (classic NIAH haystack)",
    "repeat": f"the classic repeated filler line: {NOISE!r}",
    "code": "CPython standard-library source (_pydecimal.py), one unit per line",
}
"""Haystacks accepted by :func:`load_haystack` (tasks may also use task-built haystacks)."""

_SENT_SPLIT = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9\"'(])")
_UNDERLINE = re.compile(r"[*=\-~^#]{3,}")
_PARA_END = re.compile(r"[.!?:][\"')\]]*$")


def _sentences(paragraph: str) -> list[str]:
    """Split a whitespace-normalised paragraph into sentences."""
    text = " ".join(paragraph.split())
    return [s.strip() for s in _SENT_SPLIT.split(text) if s.strip()]


def _pydoc_blocks(text: str) -> list[tuple[int, list[str]]]:
    """Blank-line separated blocks of a topic as ``(indent, lines)``, headings removed."""
    blocks: list[tuple[int, list[str]]] = []
    cur: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if _UNDERLINE.fullmatch(line.strip()) or (nxt and _UNDERLINE.fullmatch(nxt)):
            line = ""  # a heading or its underline
        if line.strip():
            cur.append(line)
        elif cur:
            blocks.append((min(len(x) - len(x.lstrip()) for x in cur), cur))
            cur = []
    if cur:
        blocks.append((min(len(x) - len(x.lstrip()) for x in cur), cur))
    return blocks


def _is_prose(para: str) -> bool:
    """Whether a joined block reads as prose (a few words, ends a sentence, no code markers)."""
    words = para.split()
    if len(words) < 6 or not _PARA_END.search(para) or any(m in para for m in (">>>", "::=", "+--", "|")):
        return False
    return sum(w.strip("\"'(),.;:").isalpha() for w in words) >= 0.6 * len(words)


def _pydoc_paragraphs(text: str) -> list[str]:
    """Plain-prose paragraphs of one pydoc topic: no headings, code, grammar or tables.

    A block indented deeper than a preceding block that ends with ``:`` is taken as code.
    """
    paras: list[str] = []
    code_above: int | None = None  # indent of the block introducing a code example
    for indent, lines in _pydoc_blocks(text):
        if code_above is not None and indent > code_above:
            continue
        code_above = None
        para = " ".join(re.sub(r"^[*+\-] ", "", x.strip()) for x in lines)
        para = " ".join(para.split())
        if para.endswith(":"):
            code_above = indent
        if _is_prose(para):
            paras.append(re.sub(r"\.?:$", ".", para))
    return paras


def _pydoc_units() -> tuple[str, ...]:
    """Sentences of the running Python's pydoc topics, cleaned to plain prose."""
    from pydoc_data.topics import topics

    units: list[str] = []
    for key in sorted(topics):
        for para in _pydoc_paragraphs(topics[key]):
            units.extend(x for x in _sentences(para) if len(x.split()) >= 3)
    return tuple(units)


def _essay_files(data_dir: str | os.PathLike[str] | None) -> list[Path]:
    """The Paul Graham essay files, sorted, or raise :class:`TaskDataMissing`."""
    folder = _require_data("pg_essays", "haystack 'essays'", data_dir)
    files = sorted(p for p in folder.glob("*.txt") if not p.name.upper().startswith(("LICENSE", "README")))
    if not files:
        raise TaskDataMissing(f"haystack 'essays' found no essay *.txt files in {folder} (set {DATA_ENV})")
    return files


def _essay_text(data_dir: str | os.PathLike[str] | None) -> str:
    """All essays joined by blank lines (RULER glues them with no separator)."""
    return "\n\n".join(
        p.read_text(encoding="utf-8", errors="replace").strip() for p in _essay_files(data_dir)
    )


def _code_path() -> Path:
    """Path of the standard-library ``_pydecimal.py`` source."""
    path = Path(sysconfig.get_path("stdlib")) / "_pydecimal.py"
    if not path.exists():
        raise TaskDataMissing(f"haystack 'code' needs {path}, which this Python does not ship")
    return path


@lru_cache(maxsize=8)
def _load_haystack_cached(name: str, data_dir: str | None) -> Haystack:
    if name == "pydoc":
        return Haystack("pydoc", _pydoc_units(), " ")
    if name == "essays":
        return Haystack("essays", tuple(_sentences(_essay_text(data_dir))), " ")
    if name == "repeat":
        return Haystack("repeat", (NOISE,), "\n")
    if name == "code":
        lines = _code_path().read_text(encoding="utf-8").splitlines()
        return Haystack("code", tuple(line.rstrip() for line in lines), "\n", line_prefix="# ")
    raise ValueError(f"unknown haystack {name!r}; choose from {sorted(HAYSTACKS)}")


def load_haystack(name: str = "pydoc", data_dir: str | os.PathLike[str] | None = None) -> Haystack:
    """Load a filler haystack by name (see :data:`HAYSTACKS`).

    ``"essays"`` reads ``<data>/pg_essays/*.txt`` where ``<data>`` is ``data_dir`` or
    ``$KVWEAVE_DATA``; the others need no files.  Results are cached.
    """
    key = None
    if name == "essays":
        key = str(_require_data("pg_essays", "haystack 'essays'", data_dir).parent)
    return _load_haystack_cached(name, key)


CORPORA: dict[str, str] = {
    "wikitext2_valid": f"${DATA_ENV}/corpus/wikitext2_valid.txt (WikiText-2 raw-tokenized validation split)",
    "wikitext2_test": f"${DATA_ENV}/corpus/wikitext2_test.txt",
    "tinyshakespeare": f"${DATA_ENV}/corpus/tinyshakespeare.txt",
    "essays": f"${DATA_ENV}/pg_essays/*.txt joined",
    "pydoc": "CPython documentation prose (no files needed)",
    "code": "CPython _pydecimal.py source (no files needed)",
}
"""Long texts accepted by :func:`load_corpus`."""


def load_corpus(name: str = "wikitext2_valid", data_dir: str | os.PathLike[str] | None = None) -> str:
    """Load a long text for perplexity measurements (see :data:`CORPORA`).

    File-backed corpora are read from ``data_dir`` or ``$KVWEAVE_DATA``; a missing file raises
    :class:`TaskDataMissing` naming the environment variable.
    """
    if name in ("wikitext2_valid", "wikitext2_test", "tinyshakespeare"):
        path = _require_data(f"corpus/{name}.txt", f"corpus {name!r}", data_dir)
        return path.read_text(encoding="utf-8")
    if name == "essays":
        return _essay_text(data_dir)
    if name == "pydoc":
        units = load_haystack("pydoc").units
        return "\n\n".join(" ".join(units[i : i + 8]) for i in range(0, len(units), 8))
    if name == "code":
        return _code_path().read_text(encoding="utf-8")
    raise ValueError(f"unknown corpus {name!r}; choose from {sorted(CORPORA)}")


def perplexity_windows(tokenizer: Tokenizer, text: str, window: int, n_windows: int) -> list[list[int]]:
    """``n_windows`` token-id windows of length ``window`` spread evenly over ``text``.

    The text is tokenized once (no special tokens).  Windows start at evenly spaced offsets from
    the beginning to the end of the text; they do not overlap when the text has at least
    ``window * n_windows`` tokens.  Raises ``ValueError`` if the text is shorter than one window.
    """
    if window < 1 or n_windows < 1:
        raise ValueError("window and n_windows must be >= 1")
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) < window:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {window}")
    span = len(ids) - window
    if n_windows == 1:
        starts = [0]
    else:
        starts = [round(i * span / (n_windows - 1)) for i in range(n_windows)]
        if len(ids) >= window * n_windows:  # keep windows disjoint despite rounding
            step = span // (n_windows - 1)
            starts = [i * step for i in range(n_windows)]
    return [ids[s : s + window] for s in starts]


# --------------------------------------------------------------------------------------------
# word lists
# --------------------------------------------------------------------------------------------

_BUILTIN_ADJECTIVES = """
able active ancient angry bold brave bright brisk broad busy calm careful cheap cheerful clean clever
cold common cool crisp curious dark deep dense distant dry dusty eager early easy elegant empty even
exact fair famous fancy fast fierce fine firm flat fresh friendly funny gentle giant glad golden grand
great green happy hard heavy hidden hollow honest huge humble icy ideal jolly keen kind large late lazy
light little lively local long loud lucky mellow mild modern narrow neat noble odd old open pale patient
plain polite proud purple quick quiet rapid rare ready red rich rough round royal rural rusty sacred safe
sharp shiny short silent silver simple slow small smart smooth soft solid sour spare steady steep sticky
strange strict strong sunny sweet swift tall tame tender thick thin tidy tiny tough upper urban vast vivid
warm weak wet white wide wild wise young yellow zany
"""

_BUILTIN_NOUNS = """
acorn anchor apple arrow atlas badge bakery ball banjo barn basket beach beacon bell bench bicycle blanket
boat book bottle bridge bucket butter cabin cactus camera candle canyon carpet castle cellar chair cherry
chimney circle cliff clock cloud coast coffee comet copper cottage crayon crystal cup desert diamond dolphin
door dragon drum eagle engine falcon feather fence field forest fountain garden garlic ginger glacier globe
guitar hammer harbor helmet honey horizon island jacket jungle kettle kitten ladder lagoon lantern lemon
library lighthouse lizard magnet maple marble meadow mirror monkey mountain needle nest notebook ocean olive
orchard otter oyster paddle palace panda parrot pebble pencil pepper piano pillow planet pocket pond puzzle
quilt rabbit radio rainbow river rocket saddle sailor salmon sandal satchel scarf shadow shell shovel signal
spider spoon squirrel statue stone sugar summit teapot temple thunder ticket tiger tomato tower trumpet tulip
tunnel turtle umbrella valley violin volcano wagon walnut whistle window wizard yacht zebra
"""


@dataclass(frozen=True)
class _Words:
    """Adjective, noun and verb lists and where they came from."""

    adjectives: tuple[str, ...]
    nouns: tuple[str, ...]
    verbs: tuple[str, ...]
    source: str

    def all_words(self) -> list[str]:
        """Sorted unique union of all lists (RULER's CWE vocabulary)."""
        return sorted(set(self.adjectives) | set(self.nouns) | set(self.verbs))


def _read_wordlist(path: Path) -> tuple[str, ...]:
    """Single alphabetic words of a one-word-per-line list, in file order, deduplicated."""
    words = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return tuple(dict.fromkeys(w for w in words if w.isalpha()))


@lru_cache(maxsize=4)
def _load_words(data_dir: str | None) -> _Words:
    if data_dir:
        folder = Path(data_dir) / "ruler" / "wordlists"
        files = [folder / f"wonderwords_{kind}list.txt" for kind in ("adjective", "noun", "verb")]
        if all(f.exists() for f in files):
            adjs, nouns, verbs = (_read_wordlist(f) for f in files)
            return _Words(adjs, nouns, verbs, "wonderwords")
    return _Words(tuple(_BUILTIN_ADJECTIVES.split()), tuple(_BUILTIN_NOUNS.split()), (), "builtin")


def _words(data_dir: str | os.PathLike[str] | None) -> _Words:
    """Wonderwords lists from ``<data>/ruler/wordlists`` if present, else the built-in lists."""
    root = resolve_data_dir(data_dir)
    return _load_words(str(root) if root else None)


# --------------------------------------------------------------------------------------------
# filler assembly: per-unit token counts cached per (tokenizer, haystack)
# --------------------------------------------------------------------------------------------

_PREFIX_CACHE: dict[tuple[int, Haystack], tuple[Any, list[int]]] = {}


def _prefix_counts(tok: Tokenizer, hay: Haystack) -> list[int]:
    """Prefix sums of the token counts of ``hay.units`` (computed once per tokenizer)."""
    key = (id(tok), hay)
    hit = _PREFIX_CACHE.get(key)
    if hit is not None:
        held = hit[0]
        if (held() if isinstance(held, weakref.ref) else held) is tok:
            return hit[1]
    counts = [len(ids) for ids in _encode_many(tok, hay.units)]
    prefix = [0, *accumulate(counts)]
    ref: Any
    try:
        ref = weakref.ref(tok)
    except TypeError:  # not weak-referenceable: keep it alive so its id is not reused
        ref = tok
    if len(_PREFIX_CACHE) >= 8:
        _PREFIX_CACHE.pop(next(iter(_PREFIX_CACHE)))
    _PREFIX_CACHE[key] = (ref, prefix)
    return prefix


def _take_filler(tok: Tokenizer, hay: Haystack, start: int, budget: int) -> tuple[list[str], list[int]]:
    """Units from ``start`` on (wrapping around) worth about ``budget`` tokens.

    Whole units are taken while they fit; the remainder is filled with a token-level prefix
    of the next unit.  Returns the pieces and their token counts.
    """
    prefix = _prefix_counts(tok, hay)
    m = len(hay.units)
    pieces: list[str] = []
    counts: list[int] = []
    pos, remaining = start % m, max(0, budget)
    while True:
        avail = prefix[m] - prefix[pos]
        if avail <= remaining and prefix[m] > 0:
            pieces.extend(hay.units[pos:])
            counts.extend(prefix[i + 1] - prefix[i] for i in range(pos, m))
            remaining -= avail
            pos = 0
            continue
        j = bisect_right(prefix, prefix[pos] + remaining, lo=pos) - 1
        pieces.extend(hay.units[pos:j])
        counts.extend(prefix[i + 1] - prefix[i] for i in range(pos, j))
        remaining -= prefix[j] - prefix[pos]
        break
    if remaining >= 2:
        ids = tok.encode(hay.units[j], add_special_tokens=False)[:remaining]
        part = tok.decode(ids).replace("\ufffd", "").strip()
        if part:
            pieces.append(part)
            counts.append(len(ids))
    return pieces, counts


def _spread(depth: float, k: int) -> list[float]:
    """``k`` depths spread evenly around the document, the first at ``depth`` (wrapping)."""
    return [depth if i == 0 else (depth + i / k) % 1.0 for i in range(k)]


def _insert(
    pieces: list[str], counts: list[int], items: Sequence[tuple[float, str]]
) -> tuple[list[str], list[float]]:
    """Insert ``(depth, text)`` items at the unit boundaries nearest each depth (by tokens).

    Returns the new unit list and each item's realised depth (filler tokens before it / all).
    """
    cum = [0, *accumulate(counts)]
    total = cum[-1] or 1
    slots: list[tuple[int, int, str]] = []
    realised: list[float] = []
    for order, (d, text) in enumerate(items):
        goal = d * cum[-1]
        i = bisect_left(cum, goal)
        if i >= len(cum) or (i > 0 and goal - cum[i - 1] <= cum[i] - goal):
            i -= 1
        slots.append((i, order, text))
        realised.append(cum[i] / total)
    out: list[str] = []
    slots.sort()
    s = 0
    for i in range(len(pieces) + 1):
        while s < len(slots) and slots[s][0] == i:
            out.append(slots[s][2])
            s += 1
        if i < len(pieces):
            out.append(pieces[i])
    return out, realised


# --------------------------------------------------------------------------------------------
# length fitting
# --------------------------------------------------------------------------------------------


@dataclass
class _Draft:
    """A built candidate: everything of a :class:`Sample` except measured length."""

    context: str
    question: str
    answers: list[str]
    answer_prefix: str
    meta: dict[str, Any]


@dataclass
class _Plan:
    """How to build a sample of size ``n`` (filler tokens, lines, words ...)."""

    build: Callable[[int], _Draft]
    n0: int
    slope: float
    n_min: int = 0


def _fit(plan: _Plan, tok: Tokenizer, target: int, tol: int, max_iter: int = 12) -> tuple[_Draft, int]:
    """Search the size ``n`` whose built context has ``target`` ± ``tol`` tokens.

    Safeguarded secant search: one full tokenization per step.  If the target cannot be hit
    within ``tol`` (coarse units) the largest candidate below the target is returned.
    """
    tried: dict[int, tuple[int, _Draft]] = {}
    n, slope = max(plan.n_min, plan.n0), max(plan.slope, 1e-6)
    lo: int | None = None  # largest n that is too short
    hi: int | None = None  # smallest n that is too long
    for _ in range(max_iter):
        draft = plan.build(n)
        t = _count(tok, draft.context)
        tried[n] = (t, draft)
        diff = target - t
        if abs(diff) <= tol:
            return draft, t
        if diff > 0:
            lo = n if lo is None else max(lo, n)
        else:
            hi = n if hi is None else min(hi, n)
        if hi is not None and hi <= plan.n_min:
            break
        others = [(m, tm) for m, (tm, _) in tried.items() if m != n and tm != t]
        if others:
            m, tm = min(others, key=lambda x: abs(x[0] - n))
            if (t - tm) / (n - m) > 0:
                slope = (t - tm) / (n - m)
        nxt = n + (round(diff / slope) or (1 if diff > 0 else -1))
        if lo is not None:
            nxt = max(nxt, lo + 1)
        if hi is not None:
            nxt = min(nxt, hi - 1)
        nxt = max(nxt, plan.n_min)
        if nxt in tried or (lo is not None and hi is not None and hi - lo <= 1):
            break
        n = nxt
    under = [(m, t) for m, (t, _) in tried.items() if t <= target + tol]
    if not under:
        smallest = min(t for t, _ in tried.values())
        raise ValueError(
            f"context_tokens={target} is too small for this task (needs at least ~{smallest} tokens)"
        )
    best = max(under, key=lambda x: x[1])[0]
    t, draft = tried[best]
    return draft, t


# --------------------------------------------------------------------------------------------
# task builders
# --------------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    """Inputs shared by the task builders."""

    task: str
    tok: Tokenizer
    target: int
    depth: float | None
    seed: int
    rng: random.Random
    haystack: Haystack | None
    words: _Words
    data_dir: str | os.PathLike[str] | None = None


def _rand_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _rand_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _rand_word(rng: random.Random, words: _Words) -> str:
    return f"{rng.choice(words.adjectives)}-{rng.choice(words.nouns)}"


def _draw(rng: random.Random, kind: str, words: _Words, avoid: set[str]) -> str:
    """A fresh random item of ``kind`` (numbers, words, uuids) not in ``avoid``."""
    make = {"numbers": _rand_number, "uuids": _rand_uuid, "words": lambda r: _rand_word(r, words)}[kind]
    while True:
        item = make(rng)
        if item not in avoid:
            avoid.add(item)
            return item


def _prose_plan(
    ctx: _Ctx,
    preamble: str,
    needles: list[str],
    needle_depths: list[float],
    finish: Callable[[str, list[float]], _Draft],
) -> _Plan:
    """Plan for a haystack-based task: needles inserted into filler sized in tokens."""
    hay = ctx.haystack
    assert hay is not None
    start = ctx.rng.randrange(len(hay.units))
    if hay.line_prefix:
        needles = [hay.line_prefix + nd for nd in needles]
    fixed = _count(ctx.tok, preamble) + sum(_count(ctx.tok, nd) for nd in needles)

    def build(n: int) -> _Draft:
        pieces, counts = _take_filler(ctx.tok, hay, start, n)
        units, realised = _insert(pieces, counts, list(zip(needle_depths, needles, strict=True)))
        draft = finish(preamble + hay.sep.join(units), realised)
        draft.meta.update(haystack=hay.name, haystack_start=start, filler_tokens=sum(counts))
        return draft

    return _Plan(build, n0=ctx.target - fixed - 2, slope=1.0, n_min=0)


def _pick_depth(ctx: _Ctx) -> float:
    """The requested depth, or a seeded random one."""
    return ctx.rng.random() if ctx.depth is None else ctx.depth


def _build_passkey(ctx: _Ctx) -> _Plan:
    """InfiniteBench pass key: a 5-digit key inside filler."""
    depth = _pick_depth(ctx)
    key = _rand_number(ctx.rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    preamble = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.\n\n"
    )

    def finish(context: str, realised: list[float]) -> _Draft:
        meta = {"depth": depth, "needle_depths": realised, "needles": [needle]}
        return _Draft(context, "What is the pass key?", [key], "The pass key is", meta)

    ctx.depth = depth
    return _prose_plan(ctx, preamble, [needle], [depth], finish)


_NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n"
)
_NIAH_QUESTION = "What are all the special magic {type_v} for {query} mentioned in the provided text?"
_NIAH_PREFIX = "The special magic {type_v} for {query} mentioned in the provided text are"


def _singular(template: str) -> str:
    """RULER's rewrite of the NIAH template when exactly one value is asked for."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(old, new)
    return template


@dataclass(frozen=True)
class _NiahConfig:
    """One NIAH variant: key/value types, counts of keys (k), values per key (v), queried keys (q)."""

    key_type: str
    value_type: str
    k: int = 1
    v: int = 1
    q: int = 1


def _niah_texts(cfg: _NiahConfig, queries: list[str]) -> tuple[str, str, str]:
    """Preamble, question and answer prefix of a NIAH sample."""
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    parts = [_NIAH_TEMPLATE, _NIAH_QUESTION, _NIAH_PREFIX]
    type_v = cfg.value_type
    if cfg.q * cfg.v == 1:
        parts = [_singular(p) for p in parts]
        type_v = type_v[:-1]
    preamble, question, prefix = (p.format(type_v=type_v, query=query) for p in parts)
    return preamble, question, prefix


def _needle(cfg: _NiahConfig, key: str, value: str) -> str:
    return f"One of the special magic {cfg.value_type} for {key} is: {value}."


def _niah_draws(ctx: _Ctx, cfg: _NiahConfig) -> tuple[list[str], list[list[str]]]:
    """Distinct keys and, per key, distinct values."""
    used: set[str] = set()
    keys = [_draw(ctx.rng, cfg.key_type, ctx.words, used) for _ in range(max(cfg.k, cfg.q))]
    values = [[_draw(ctx.rng, cfg.value_type, ctx.words, used) for _ in range(cfg.v)] for _ in keys]
    return keys, values


def _niah_builder(cfg: _NiahConfig) -> Callable[[_Ctx], _Plan]:
    """Builder of a haystack-based NIAH task; the first needle (a queried one) sits at ``depth``."""

    def builder(ctx: _Ctx) -> _Plan:
        depth = _pick_depth(ctx)
        ctx.depth = depth
        keys, values = _niah_draws(ctx, cfg)
        queries = keys[: cfg.q]
        answers = [v for vals in values[: cfg.q] for v in vals]
        needles = [_needle(cfg, key, val) for key, vals in zip(keys, values, strict=True) for val in vals]
        preamble, question, prefix = _niah_texts(cfg, queries)

        def finish(context: str, realised: list[float]) -> _Draft:
            meta = {
                "depth": depth,
                "needle_depths": realised,
                "needles": needles,
                "keys": keys,
                "queries": queries,
            }
            return _Draft(context, question, answers, prefix, meta)

        return _prose_plan(ctx, preamble, needles, _spread(depth, len(needles)), finish)

    return builder


def _build_niah_multikey_uuid(ctx: _Ctx) -> _Plan:
    """RULER niah_multikey_3: the haystack is made of distractor needles with UUID keys and values."""
    cfg = _NiahConfig("uuids", "uuids")
    depth = _pick_depth(ctx)
    ctx.depth = depth
    keys, values = _niah_draws(ctx, cfg)
    needle = _needle(cfg, keys[0], values[0][0])
    preamble, question, prefix = _niah_texts(cfg, keys[:1])
    line_seed = ctx.rng.getrandbits(64)

    def build(n: int) -> _Draft:
        rng = random.Random(line_seed)
        used = {keys[0], values[0][0]}
        lines = [
            _needle(cfg, _draw(rng, "uuids", ctx.words, used), _draw(rng, "uuids", ctx.words, used))
            for _ in range(n)
        ]
        pos = round(depth * n)
        lines.insert(pos, needle)
        meta = {"depth": depth, "needle_depths": [pos / max(n, 1)], "needles": [needle], "keys": keys[:1]}
        meta.update(haystack="needles", distractors=n)
        return _Draft(preamble + "\n".join(lines), question, [values[0][0]], prefix, meta)

    per_line = _count(ctx.tok, needle) + 1
    fixed = _count(ctx.tok, preamble) + per_line
    return _Plan(build, n0=max(0, (ctx.target - fixed) // per_line), slope=per_line, n_min=0)


def _vt_chain(rng: random.Random, hops: int, name_len: int, value: int) -> tuple[list[str], list[str]]:
    """Variable names and assignment statements of one chain (RULER variable tracking)."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if name not in names:
            names.append(name)
    stmts = [f"VAR {names[0]} = {value}"] + [
        f"VAR {names[i]} = VAR {names[i - 1]}" for i in range(1, hops + 1)
    ]
    return names, stmts


_VT_TEMPLATE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
_VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are:"
)
_VT_HOPS = 4
_VT_ICL_MIN_TOKENS = 1024


def _vt_icl(rng: random.Random) -> str:
    """The one-shot worked example RULER prepends (noise haystack, 3-letter names)."""
    value = rng.randint(10000, 99999)
    names, stmts = _vt_chain(rng, _VT_HOPS, 3, value)
    lines = [NOISE] * 8
    for j, p in enumerate(sorted(rng.sample(range(len(lines)), len(stmts)))):
        lines.insert(p + j, stmts[j])
    query = dict(query=value, num_v=_VT_HOPS + 1)
    return (
        _VT_TEMPLATE
        + "\n".join(lines)
        + "\n"
        + _VT_QUESTION.format(**query)
        + " "
        + _VT_PREFIX.format(**query)
        + " "
        + " ".join(names)
        + "\n\n"
    )


def _build_vt(ctx: _Ctx) -> _Plan:
    """Variable tracking: one chain of 4 hops hidden in filler, spread around ``depth`` in order."""
    depth = _pick_depth(ctx)
    ctx.depth = depth
    icl = _vt_icl(ctx.rng) if ctx.target >= _VT_ICL_MIN_TOKENS else ""
    value = ctx.rng.randint(10000, 99999)
    names, stmts = _vt_chain(ctx.rng, _VT_HOPS, 5, value)
    assert ctx.haystack is not None
    if ctx.haystack.sep == " ":
        stmts = [s + "." for s in stmts]
    spread = _spread(depth, len(stmts))
    placed = sorted(spread)  # statements appear in chain order through the document
    query = dict(query=value, num_v=_VT_HOPS + 1)
    question, prefix = _VT_QUESTION.format(**query), _VT_PREFIX.format(**query)

    def finish(context: str, realised: list[float]) -> _Draft:
        meta = {"depth": depth, "needle_depths": realised, "needles": stmts, "icl": bool(icl)}
        return _Draft(context, question, list(names), prefix, meta)

    return _prose_plan(ctx, icl + _VT_TEMPLATE, stmts, placed, finish)


_CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
_CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
_CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
_CWE_COMMON = 10
_CWE_SHOT_MIN_TOKENS = 1024  # below this the one-shot example is left out


def _cwe_vocab(ctx: _Ctx, n: int, base: list[str]) -> list[str]:
    """``n`` distinct words: the shuffled vocabulary, extended by adjective-noun pairs if too short."""
    if n <= len(base):
        return base
    rng = random.Random(f"{ctx.seed}:cwe-extend")
    out, seen = list(base), set(base)
    while len(out) < n:
        w = _rand_word(rng, ctx.words)
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _cwe_example(ctx: _Ctx, base: list[str], n: int, rc: int, ru: int, salt: str) -> tuple[str, list[str]]:
    """A numbered word list whose 10 common words occur ``rc`` times and the rest ``ru`` times."""
    vocab = _cwe_vocab(ctx, n, base)
    picked = random.Random(f"{ctx.seed}:{salt}:{n}").sample(vocab, n)
    common = picked[:_CWE_COMMON]
    lst = common * rc + picked[_CWE_COMMON:] * ru
    random.Random(ctx.seed).shuffle(lst)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst)), common


def _cwe_shot(ctx: _Ctx, base: list[str], short: bool) -> str:
    """The worked one-shot example RULER prepends (left out below 1K-token targets)."""
    if ctx.target < _CWE_SHOT_MIN_TOKENS:
        return ""
    shot_ctx, shot_ans = _cwe_example(ctx, base, *((20, 3, 1) if short else (40, 10, 3)), salt="shot")
    answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_ans))
    return f"{_CWE_TEMPLATE}{shot_ctx}\n{_CWE_QUESTION} {_CWE_PREFIX} {answer}\n\n"


def _build_cwe(ctx: _Ctx) -> _Plan:
    """Common words extraction with a one-shot example (RULER settings: 30/3 repeats, 6/1 below 4K)."""
    base = ctx.words.all_words()
    random.Random(ctx.seed).shuffle(base)
    short = ctx.target < 4096
    rc, ru = (6, 1) if short else (30, 3)
    shot = _cwe_shot(ctx, base, short)

    def build(n: int) -> _Draft:
        body, common = _cwe_example(ctx, base, n, rc, ru, salt="main")
        meta = {"distinct_words": n, "repeats_common": rc, "repeats_other": ru, "wordlist": ctx.words.source}
        return _Draft(shot + _CWE_TEMPLATE + body, _CWE_QUESTION, common, _CWE_PREFIX, meta)

    per_word = _count(ctx.tok, " ".join(f"{i + 101}. {w}" for i, w in enumerate(base[:50]))) / 50
    fixed = _count(ctx.tok, shot + _CWE_TEMPLATE) + _CWE_COMMON * rc * per_word
    n0 = _CWE_COMMON + max(1, int((ctx.target - fixed) / (ru * per_word)))
    return _Plan(build, n0=n0, slope=ru * per_word, n_min=_CWE_COMMON + 1)


_FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
_FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
_FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
_FWE_ALPHA = 2.0
_ZETA_2 = math.pi**2 / 6  # zeta(alpha) for alpha = 2


def _build_fwe(ctx: _Ctx) -> _Plan:
    """Frequent words extraction: Zipf(2)-distributed coded words, rank 1 is the noise token '...'."""
    size = max(20, ctx.target // 50)
    coded: set[str] = set()
    while len(coded) < size:
        coded.add("".join(ctx.rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(coded)
    random.Random(ctx.seed).shuffle(vocab)
    vocab[0] = "..."
    answers = vocab[1:4]

    def build(n: int) -> _Draft:
        words: list[str] = []
        for k, w in enumerate(vocab, start=1):
            words.extend([w] * int(n * k**-_FWE_ALPHA / _ZETA_2))
        random.Random(ctx.seed).shuffle(words)
        meta = {"total_words": n, "vocab_size": len(vocab)}
        return _Draft(_FWE_TEMPLATE + " ".join(words), _FWE_QUESTION, list(answers), _FWE_PREFIX, meta)

    per_word = _count(ctx.tok, " ".join(vocab[1:51])) / 50 * 0.9  # ~10 % are the cheap '...' token
    n0 = max(100, int((ctx.target - _count(ctx.tok, _FWE_TEMPLATE)) / per_word))
    return _Plan(build, n0=n0, slope=per_word, n_min=100)


# -- long-document QA and code continuation ---------------------------------------------------------

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
                raise ValueError(f"{path}, line {n}: not valid JSON ({exc.msg}); is the file complete?") from exc
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


_CODE_FILES = (
    "_pydecimal.py", "typing.py", "argparse.py", "inspect.py", "tarfile.py", "subprocess.py",
    "dataclasses.py", "enum.py", "configparser.py", "pickle.py", "logging/__init__.py", "zipfile/__init__.py",
    "zipfile.py", "difflib.py", "smtplib.py", "imaplib.py", "ftplib.py", "pydoc.py", "shutil.py",
)  # fmt: skip
"""Long pure-Python standard-library modules the code task draws from (those this Python ships)."""

_CALL = re.compile(r"(?:(?<![\w.])|(?<=\bself\.))([A-Za-z_]\w*)\s*\(")
"""A call of a bare name or a method of ``self`` (calls on other objects name what the file may not define)."""
_DEF = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+([A-Za-z_]\w*)")
_CODE_NEAR = 40
"""The identifier a target line calls must be defined more than this many lines above it."""


@lru_cache(maxsize=32)
def _code_lines(path: str) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """Lines of a source file and its target candidates ``(line index, defining line index)``.

    A candidate is a code line (16-100 characters, not a comment, decorator or string line) calling a
    function or class defined in the same file more than :data:`_CODE_NEAR` lines above it: completing
    it needs context from far back.
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = tuple(text.splitlines())
    in_string: set[int] = set()
    with open(path, encoding="utf-8") as fh:
        for tk in tokenize.generate_tokens(fh.readline):
            if tk.type == tokenize.STRING and tk.end[0] > tk.start[0]:
                in_string.update(range(tk.start[0] - 1, tk.end[0]))
    defined: dict[str, int] = {}
    out = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if (
            i not in in_string
            and 16 <= len(stripped) <= 100
            and not stripped.startswith(("#", "@", "def ", "class ", "async def"))
        ):
            far = [defined[name] for name in _CALL.findall(stripped) if i - defined.get(name, i) > _CODE_NEAR]
            if far:
                out.append((i, max(far)))
        m = _DEF.match(line)
        if m and i not in in_string:
            defined.setdefault(m.group(1), i)
    return lines, tuple(out)


def _code_files() -> list[Path]:
    root = Path(sysconfig.get_path("stdlib"))
    return [root / name for name in _CODE_FILES if (root / name).is_file()]


def _build_code(ctx: _Ctx) -> _Plan:
    """Code continuation: the lines of a CPython stdlib module before a target line; predict that line.

    The target line calls a function or class defined far above it (see :func:`_code_lines`); the context
    is as many preceding lines as fit. Scored by edit similarity of the first predicted line (as LCC and
    RepoBench score next-line completion); ``meta["definition_in_context"]`` says whether the definition
    made it into the window.
    """
    files = _code_files()
    if not files:
        raise TaskDataMissing("task 'code' needs the standard-library sources, which this Python does not ship")
    rng = ctx.rng
    path = rng.choice(files)
    lines, candidates = _code_lines(str(path))
    chars_per_token = 3.0
    budget = ctx.target * chars_per_token
    # Targets with enough file above them for the window, preferring definitions likely inside it.
    above = list(accumulate(len(line) + 1 for line in lines))
    fits = [(i, d) for i, d in candidates if above[i - 1] >= budget] if candidates else []
    inside = [(i, d) for i, d in fits if above[i - 1] - above[d] < 0.8 * budget]
    pool = inside or fits
    if not pool:
        raise ValueError(
            f"context_tokens={ctx.target} is too long for task 'code': {path.name} has no target line with "
            f"that much code above it; use a shorter context"
        )
    target_line, def_line = rng.choice(pool)
    name = path.relative_to(path.parents[1] if path.name == "__init__.py" else path.parent)
    preamble = f"Below is Python source code from the standard-library module {name}.\n\n"
    question = "Question: What is the next line of the code above? Reply with that one line only."
    gold = lines[target_line].strip()

    def build(n: int) -> _Draft:
        first = max(0, target_line - n)
        body = "\n".join(lines[first:target_line])
        meta = {"file": str(name), "line": target_line + 1, "first_line": first + 1, "metric": "edit_sim"}
        meta.update(definition_line=def_line + 1, definition_in_context=first <= def_line)
        return _Draft(preamble + body + "\n", question, [gold], "The next line is:\n```python\n", meta)

    per_line = above[target_line - 1] / max(1, target_line) / chars_per_token
    return _Plan(build, n0=int(ctx.target / per_line), slope=per_line, n_min=1)


# --------------------------------------------------------------------------------------------
# task registry and the generator entry point
# --------------------------------------------------------------------------------------------

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
    stop_after_line: bool = False  # the score reads the first code line only: stop generating once it is complete


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
