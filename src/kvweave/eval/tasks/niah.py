"""The RULER needle-in-a-haystack task builders (single, multi-key, multi-value, multi-query, UUID keys).

:class:`_NiahConfig` describes a variant; :func:`_niah_builder` makes the haystack-based builders and
:func:`_build_niah_multikey_uuid` the one whose haystack is made of distractor needles.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvweave.eval.tasks.data import _count
from kvweave.eval.tasks.fitting import _Ctx, _Draft, _draw, _pick_depth, _Plan, _prose_plan, _spread

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
    """One NIAH variant: key/value types, counts of keys (k), values per key (v), queried keys (q); ``draw``: how
    values are drawn when not by their type's name (``hex``: 8 hex digits called codes, ``common``: common
    English words)."""

    key_type: str
    value_type: str
    k: int = 1
    v: int = 1
    q: int = 1
    draw: str = ""


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
    kind = cfg.draw or cfg.value_type
    values = [[_draw(ctx.rng, kind, ctx.words, used) for _ in range(cfg.v)] for _ in keys]
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
