"""The InfiniteBench pass-key retrieval task builder: a 5-digit key hidden in filler."""

from __future__ import annotations

from kvweave.eval.tasks.fitting import _Ctx, _Draft, _pick_depth, _Plan, _prose_plan, _rand_number


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
