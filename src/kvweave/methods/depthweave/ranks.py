"""Rank choice: the probed rank grid, the byte cost of a rank, and picking ``(r_K, r_V)`` from probe errors.

Two modes (``DepthWeave.target_error`` set or not): the cheapest probed pair whose errors meet the target
(:func:`ranks_for_error`), or the pair of least error inside the byte budget of ``compression``, filled one
rank at a time (:func:`ranks_within`). Errors come from a callable, so nothing here touches tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvweave.methods.depthweave.store import COORD_GROUP
from kvweave.ops.quantize import packed_bytes

if TYPE_CHECKING:
    from kvweave.methods.depthweave import DepthWeave

RANK_GRID = (
    1,
    2,
    3,
    4,
    6,
    8,
    12,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
)
SIDES = ("k", "v")
PROBE_SPAN = 8
"""Within a byte budget, a side's probed ranks span the largest affordable one down to 1/PROBE_SPAN of it."""

Cost = Callable[[str, int], int]  # (side, rank) -> bytes
Error = Callable[[str, int], float]  # (side, rank) -> probe error


@dataclasses.dataclass
class Budget:
    """What a row may spend on a new factorization (``compression``): full 16-bit size, fixed costs."""

    full_16bit: int
    recent_bytes: int


def side_bytes(
    method: DepthWeave,
    bucket_sizes: tuple[int, int, int],
    cap: int,
    rank: int,
    layers: int,
    width: int,
    element: int,
) -> int:
    """Bytes of one side (K or V) at base ``rank``: bucket coordinates plus every layer's coefficients."""
    widths = method.bucket_widths(rank, cap)
    total = sum(
        packed_bytes(n, w, method.bits, COORD_GROUP, element)
        for n, w in zip(bucket_sizes, widths, strict=True)
    )
    return total + layers * packed_bytes(widths[0], width, method.coefficient_bits, widths[0], element)


def probe_grid(cap: int) -> list[int]:
    """The ranks worth probing below ``cap`` (the largest rank the basis has), ``cap`` included."""
    return sorted({r for r in RANK_GRID if r < cap} | {cap})


def ranks_for_error(
    caps: dict[str, int], cost: Cost, error: Error, target: float
) -> tuple[dict[str, int], dict[str, dict[int, float]]]:
    """Probe each side up the grid (stopping once an error is 8x under ``target``); the cheapest pair that
    meets ``target``. Returns the ranks and the probed errors."""
    errors: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for side in SIDES:
        for rank in probe_grid(caps[side]):
            errors[side][rank] = error(side, rank)
            if errors[side][rank] <= target / 8:
                break
    return cheapest_meeting(errors, cost, target), errors


def ranks_within(
    caps: dict[str, int], cost: Cost, error: Error, available: float
) -> tuple[dict[str, int], dict[str, dict[int, float]]]:
    """Probe only the affordable grid ranks of each side; the best pair inside ``available`` bytes. Returns
    the ranks and the probed errors."""
    grids = {}
    for side, other in (("k", "v"), ("v", "k")):
        affordable = [r for r in probe_grid(caps[side]) if cost(side, r) + cost(other, 1) <= available]
        # ranks far below what the budget affords never make the best pair (both sides' errors fall with rank,
        # and the pair is filled up to the budget afterwards): probe from an eighth of the affordable top
        floor = affordable[-1] / PROBE_SPAN if affordable else 1
        grids[side] = [r for r in affordable if r >= floor] or [1]
    errors: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for side in SIDES:
        for rank in grids[side]:
            errors[side][rank] = error(side, rank)
    return best_within(errors, cost, available, caps), errors


def other_side(side: str) -> str:
    return "v" if side == "k" else "k"


def cheapest_meeting(errors: dict[str, dict[int, float]], cost: Cost, target: float) -> dict[str, int]:
    """The probed ``(r_K, r_V)`` of fewest bytes whose errors sum to at most ``target`` (else the largest)."""
    best: tuple[int, int, int] | None = None
    for rk, ek in errors["k"].items():
        for rv, ev in errors["v"].items():
            bytes_ = cost("k", rk) + cost("v", rv)
            if ek + ev <= target and (best is None or bytes_ < best[0]):
                best = (bytes_, rk, rv)
    return {"k": best[1], "v": best[2]} if best else {s: max(errors[s]) for s in SIDES}


def best_within(
    errors: dict[str, dict[int, float]],
    cost: Cost,
    available: float,
    caps: dict[str, int],
) -> dict[str, int]:
    """The probed pair of least summed error inside ``available`` bytes, then filled one rank at a time.

    The fill always grows the side whose (interpolated) error is larger, so the budget ends up used to within
    one rank step: ``compression`` lands close to its target.
    """
    best: tuple[float, int, int] | None = None
    for rk, ek in errors["k"].items():
        for rv, ev in errors["v"].items():
            fits = cost("k", rk) + cost("v", rv) <= available or (rk, rv) == (1, 1)
            if fits and (best is None or ek + ev < best[0]):
                best = (ek + ev, rk, rv)
    ranks = {"k": best[1], "v": best[2]} if best else {"k": 1, "v": 1}
    while True:
        grow = [
            s
            for s in SIDES
            if ranks[s] < caps[s]
            and cost(s, ranks[s] + 1) + cost(other_side(s), ranks[other_side(s)]) <= available
        ]
        if not grow:
            return ranks
        side = max(grow, key=lambda s: interpolate(errors[s], ranks[s]))
        ranks[side] += 1


def next_rank(rank: int, step: int) -> int:
    """The grid rank one step above (``step=+1``) or below (``-1``) ``rank``."""
    if step > 0:
        return next((r for r in RANK_GRID if r > rank), rank * 2)
    return max((r for r in RANK_GRID if r < rank), default=1)


def interpolate(errors: dict[int, float], rank: int) -> float:
    """Probe error at ``rank``, log-linear between the probed ranks (held flat beyond them)."""
    known = sorted(errors)
    if rank <= known[0]:
        return errors[known[0]]
    if rank >= known[-1]:
        return errors[known[-1]]
    upper = next(r for r in known if r >= rank)
    lower = max(r for r in known if r <= rank)
    if upper == lower:
        return errors[upper]
    t = (math.log(rank) - math.log(lower)) / (math.log(upper) - math.log(lower))
    return errors[lower] + t * (errors[upper] - errors[lower])
