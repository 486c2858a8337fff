"""The other RULER synthetic task builders: variable tracking (vt), common and frequent words (cwe, fwe).

Each follows RULER's recipe, one-shot examples included (left out below 1K-token targets).
"""

from __future__ import annotations

import math
import random
import string

from kvweave.eval.tasks.data import NOISE, _count
from kvweave.eval.tasks.fitting import _Ctx, _Draft, _pick_depth, _Plan, _prose_plan, _rand_word, _spread


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
