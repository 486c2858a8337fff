"""Fitting samples to a token budget, and the inputs shared by the task builders.

Holds :func:`depths`, the filler machinery (per-unit token counts cached per tokenizer and haystack,
taking filler worth a token budget, inserting needles at depths), the :class:`_Draft`/:class:`_Plan`
pair with the secant search :func:`_fit` that sizes a plan to the target length, and the builders'
common ground: the :class:`_Ctx` inputs, random needle items and the haystack-based :func:`_prose_plan`.
"""

from __future__ import annotations

import os
import random
import uuid
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from kvweave.eval.tasks.data import Haystack, Tokenizer, _count, _encode_many, _Words


def depths(n: int) -> list[float]:
    """``n`` needle depths spread evenly over 10 %-90 % of the context (``n == 1`` gives 50 %)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return [0.5]
    return [round(0.1 + 0.8 * i / (n - 1), 6) for i in range(n)]


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
# builder inputs, random needle items, haystack-based plans
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


def _rand_hex(rng: random.Random) -> str:
    """8 lowercase hex digits with at least two letters and two digits (``8605b771``): a value a tokenizer
    splits into digit and letter pieces, so no token of it alone looks like a number."""
    while True:
        code = f"{rng.getrandbits(32):08x}"
        letters = sum(c.isalpha() for c in code)
        if 2 <= letters <= 6:
            return code


COMMON_WORDS = (
    "apple", "basket", "bottle", "bridge", "button", "candle", "carpet", "castle", "chair", "cloud", "coffee",
    "corner", "cotton", "garden", "guitar", "hammer", "harbor", "island", "jacket", "kettle", "ladder", "lemon",
    "letter", "market", "meadow", "mirror", "monkey", "mountain", "needle", "orange", "paper", "pencil",
    "pepper", "pillow", "planet", "pocket", "rabbit", "ribbon", "river", "saddle", "silver", "spider", "spoon",
    "stone", "summer", "table", "teacher", "ticket", "tiger", "tomato", "tower", "train", "valley", "wagon",
    "window", "winter", "yellow", "forest", "engine", "circle",
)  # fmt: skip
"""Common English words as needle values: nothing in their form says they are a value to keep."""


def _draw(rng: random.Random, kind: str, words: _Words, avoid: set[str]) -> str:
    """A fresh random item of ``kind`` (numbers, words, uuids, hex, common) not in ``avoid``."""
    make = {
        "numbers": _rand_number,
        "uuids": _rand_uuid,
        "words": lambda r: _rand_word(r, words),
        "hex": _rand_hex,
        "common": lambda r: r.choice(COMMON_WORDS),
    }[kind]
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
