"""Evaluation data: the data folder, tokenizer protocol, filler haystacks, corpora and word lists.

Holds :data:`DATA_ENV` and the ``data_dir``/``$KVWEAVE_DATA`` resolution (:class:`TaskDataMissing` for a
missing required file), the :class:`Tokenizer` protocol and token-counting helpers, the built-in and
file-backed haystacks (pydoc prose, Paul Graham essays, the repeated noise line, stdlib code), the
perplexity corpora with :func:`perplexity_windows`, and the RULER word lists (wonderwords or built-in).
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

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


def word_lists(data_dir: str | os.PathLike[str] | None = None) -> str:
    """Which word lists the samples draw from (``"wonderwords"`` from ``<data>/ruler/wordlists``, else
    ``"builtin"``): the same seed gives other word, key and value draws with each, so rows record it."""
    return _words(data_dir).source


def _words(data_dir: str | os.PathLike[str] | None) -> _Words:
    """Wonderwords lists from ``<data>/ruler/wordlists`` if present, else the built-in lists."""
    root = resolve_data_dir(data_dir)
    return _load_words(str(root) if root else None)
