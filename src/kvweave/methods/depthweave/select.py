"""Selective decode: each step, attend to the compressed tokens whose keys could score highest, rebuilding only
those keys (ShadowKV / Quest / Loki all avoid rebuilding every key every step; this is the Quest flavour).

Each segment keeps, per layer, INT8 page summaries (:class:`kvweave.ops.pages.PageBounds`) of its post-RoPE
keys as they are stored (reconstructed from the quantized coordinates, so a bound bounds what attention sees).
A decode step (one new query per row) scores every page's upper bound of ``q·k`` (max over the query heads of a
KV head), takes the top ``decode_tokens / page`` pages per KV head, gathers only those tokens' coordinates,
rebuilds and rotates their keys and attends exactly over them, the exact rows and the recent buffer; values stay
``(P·C_v)·R_v``. Tokens of pages not chosen get no weight this step. When the store has no more pages than the
budget, the step attends over everything exactly (:meth:`RowStore.attention_parts`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from kvweave.kernels.registry import Kernel, choose
from kvweave.methods.depthweave.parts import DensePart
from kvweave.ops.pages import PageBounds, page_extremes

if TYPE_CHECKING:
    from kvweave.methods.depthweave.store import RowStore, Segment
    from kvweave.ops.quantize import Packed
    from kvweave.ops.rope import RopeTable, Rotary


class SelectedPart:
    """Chosen tokens of one segment, per KV head: ``keys: [H, T, D]`` rebuilt post-RoPE, ``coords_v: [H, T, w]``,
    ``r_v: [w, H, D]``, ``slots: [H, T]`` and ``valid: [H, T]`` (False: padding of a head that chose fewer)."""

    def __init__(
        self,
        keys: torch.Tensor,
        coords_v: torch.Tensor,
        r_v: torch.Tensor,
        slots: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        self.keys, self.coords_v, self.r_v, self.slots, self.valid = keys, coords_v, r_v, slots, valid

    def logits(self, query: torch.Tensor) -> torch.Tensor:
        """``query: [H, M, D]`` -> ``[H, M, T]``."""
        return query @ self.keys.transpose(-1, -2)

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs: [H, M, T]`` -> ``[H, M, D]``: ``(P·C_v)·R_v`` per head."""
        weights = probs @ self.coords_v  # [H, M, w]
        return weights @ self.r_v.permute(1, 0, 2)  # [H, w, D]


SELECTIVE = Kernel(
    "depthweave selective decode", cpp="kvweave.kernels.cpu_factor", triton="kvweave.kernels.triton_factor"
)
"""Rebuild + score the chosen tokens and weight their value coordinates from the packed coordinates: the fused
C++ kernel on the CPU, the Triton kernels on CUDA (:mod:`kvweave.kernels.registry` decides)."""


class FusedSelectedPart:
    """The chosen rows of one segment, scored and weighted by a fused kernel (``module``: the C++ kernel,
    :mod:`kvweave.kernels.cpu_factor`, or the Triton one, :mod:`kvweave.kernels.triton_factor`) straight from the
    packed coordinates: nothing per token is materialised. Same interface (and, to float rounding, the same
    results) as :class:`SelectedPart`."""

    def __init__(
        self,
        module: Any,
        segment: Segment,
        r_k: torch.Tensor,
        r_v: torch.Tensor,
        rows: torch.Tensor,
        valid: torch.Tensor,
        table: RopeTable | None,
    ) -> None:
        self.module, self.segment, self.r_k, self.r_v, self.rows, self.valid = (
            module,
            segment,
            r_k,
            r_v,
            rows,
            valid,
        )
        self.table = table
        self.slots = segment.slots[rows].long()

    def logits(self, query: torch.Tensor) -> torch.Tensor:
        cos = sin = None
        if self.segment.positions is not None and self.table is not None:
            cos, sin = self.table.tables[query.device]
        positions = self.segment.positions if cos is not None else None
        return self.module.factor_logits(
            query, self.segment.coords_k, self.r_k, self.rows, positions, cos, sin
        )

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        weights = self.module.factor_weighted(probs, self.segment.coords_v, self.rows)  # [H, M, w_v]
        return weights[..., : self.r_v.shape[0]] @ self.r_v.permute(1, 0, 2)


def fused_kernel(method: Any, segment: Segment) -> Any | None:
    """The kernel module that reads this segment's selected rows (``kernel`` option through the registry), or
    ``None`` for the torch path (``kernel=torch``, no fast backend here, or coordinates a kernel cannot read
    under ``kernel=auto``; an explicit ``cpp`` / ``triton`` that cannot read them is refused)."""
    backend = choose(SELECTIVE, method.kernel, segment.coords_k.data.device)
    if backend == "torch":
        return None
    module: Any = SELECTIVE.module(backend)
    if module.supports(segment.coords_k) and module.supports(segment.coords_v):
        return module
    if method.kernel == "auto":
        return None
    raise RuntimeError(
        f"depthweave: kernel={method.kernel}, but the fused {backend} kernel cannot read this store "
        "(coordinates not INT4/INT8 with row-group scales); use kernel=auto"
    )


def rebuilt_keys(
    store: RowStore,
    segment: Segment,
    layer: int,
    rows: torch.Tensor,
    rotate: Any,
    coords: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[H, T, D]`` post-RoPE keys of ``layer`` for segment rows ``rows: [H, T]`` (or ``[T]``: every head);
    ``coords``: those rows' key coordinates when already read."""
    heads, dim = store.heads, store.dim
    if coords is None:
        coords = segment.coords_k.gather_rows(rows)  # [..., T, w]
    width = coords.shape[-1]
    r_k = store.basis["k"][layer].dequantize()[:width].view(width, heads, dim).permute(1, 0, 2)  # [H, w, D]
    if rows.dim() == 1:
        keys = torch.einsum("tw,hwd->htd", coords, r_k)
    else:
        keys = coords @ r_k
    if segment.positions is None:  # post-RoPE factorization: the rebuilt keys are the keys
        return keys
    positions = segment.positions[rows].long()
    return rotate(keys.unsqueeze(0), positions.view(1, -1, positions.shape[-1]))[0]


def read_pages(packed: Packed, pages: torch.Tensor, page: int, rows: torch.Tensor) -> torch.Tensor:
    """Coordinates of the chosen pages (``rows``: their row indices): whole quantization groups when a page is
    one group, else row by row."""
    if packed.bits != 16 and packed.group == page:
        return packed.gather_groups(pages)
    return packed.gather_rows(rows)


def summarize(store: RowStore, rotary: Rotary | None, first_rows: dict[tuple[int, int], int]) -> None:
    """(Re)compute the page summaries of every segment from row ``first_rows[key]`` on (0: all)."""
    page = store.method.page
    for key, segment in store.segments.items():
        start = first_rows.get(key, 0) // page * page
        rows = torch.arange(start, segment.slots.numel(), device=segment.slots.device)
        if rows.numel() == 0:
            continue
        for layer in store.members:
            rotate = rotary.rotate if rotary is not None else None
            keys = rebuilt_keys(store, segment, layer, rows, rotate)  # [H, n, D]
            low, high = page_extremes(keys, page)
            held = segment.bounds.get(layer)
            if held is None or start == 0:
                segment.bounds[layer] = PageBounds.of(low, high)
            else:
                segment.bounds[layer] = held.replace_from(start // page, low, high)


def bounds_bytes(method: Any, tokens: int, layers: int, heads: int, dim: int) -> int:
    """Bytes the page summaries of ``tokens`` factorized tokens take in ``layers`` layers (0 without them)."""
    if method.decode_tokens <= 0:
        return 0
    return layers * heads * math.ceil(tokens / method.page) * (2 * dim + 4)


MASS_SHARE = 0.9
"""``page_choice=mass``: the share of a query row's attention, estimated from the page bounds, its pages cover."""
MASS_WIDEST = 2
"""``page_choice=mass``: at most this many times the budget's pages per KV head (a flat step's cost is bounded)."""


def choose_pages(bounds: torch.Tensor, chosen: int, rule: str, scaling: float | None = None) -> torch.Tensor:
    """``[H, k]`` pages per KV head from their upper bounds ``[H, M, P]`` (``M``: the head's query rows).

    ``max``: the ``k`` pages of highest bound over the query rows. ``fair``: every query row's best page, then
    every row's second best, and so on, rank by rank (rows in order within a rank; a page named again is
    already in) until ``k`` are taken, so a query head whose pages score lower than another head's still gets
    its best ones (several needles, each wanted by other heads). ``mass``: :func:`mass_pages` (``-1`` marks
    no page; ``scaling``: the attention's logit scale)."""
    if rule == "mass":
        return mass_pages(bounds, chosen, bounds.shape[-1] ** -0.5 if scaling is None else scaling)
    if rule == "max" or bounds.shape[1] == 1:
        return bounds.amax(1).topk(chosen, dim=1).indices
    heads, rows, pages = bounds.shape
    order = bounds.argsort(dim=2, descending=True)  # [H, M, P]: each row's pages, best first
    turns = order.transpose(1, 2).reshape(heads, rows * pages)  # round-robin over the rows, rank by rank
    first = torch.full((heads, pages), rows * pages, dtype=torch.long, device=bounds.device)
    steps = torch.arange(rows * pages, device=bounds.device).expand(heads, -1)
    first.scatter_reduce_(1, turns, steps, reduce="amin")  # each page's first turn
    return first.topk(chosen, dim=1, largest=False).indices


def mass_pages(
    bounds: torch.Tensor,
    chosen: int,
    scaling: float,
    share: float = MASS_SHARE,
    widest: int = MASS_WIDEST,
) -> torch.Tensor:
    """``[H, k']`` pages per KV head that follow attention mass, ``-1`` where a head takes fewer than ``k'``.

    Each query row's share of attention per page is estimated by a softmax over its pages' scaled bounds; the
    row needs its best pages until they cover ``share``. The pages any row needs are taken rank by rank as
    :func:`choose_pages`'s ``fair`` does, at least ``chosen`` (the highest bounds fill up a peaked step) and
    at most ``widest · chosen`` (a flat step, several needles, takes more pages, within a bound)."""
    heads, rows, pages = bounds.shape
    cap = min(pages, widest * chosen)
    order = bounds.argsort(dim=2, descending=True)  # [H, M, P]
    shares = (bounds * scaling).softmax(-1).gather(2, order)  # each row's page shares, best first
    needed = (shares.cumsum(-1) - shares) < share  # the pages before which the row is still short of `share`
    last = rows * pages
    turns = order.transpose(1, 2).reshape(heads, last)
    steps = torch.arange(last, device=bounds.device).expand(heads, -1)
    steps = torch.where(needed.transpose(1, 2).reshape(heads, last), steps, last)
    first = torch.full((heads, pages), last, dtype=torch.long, device=bounds.device)
    first.scatter_reduce_(1, turns, steps, reduce="amin")  # each needed page's first turn
    by_bound = bounds.amax(1).argsort(dim=1, descending=True).argsort(dim=1)  # a page's rank by its bound
    key = torch.where(first < last, first, last + by_bound)  # needed pages first, then by bound
    count = (first < last).sum(1).clamp(min=min(chosen, pages), max=cap)  # [H]
    width = int(count.max())
    top = key.topk(width, dim=1, largest=False).indices
    return torch.where(torch.arange(width, device=bounds.device) < count.view(-1, 1), top, -1)


Pins = dict[tuple[int, int], torch.Tensor]
"""Pinned pages of one row store and layer: segment key -> ``[H, P_s]`` bool (the segment's pages when pinned)."""


def pin_pages(store: RowStore, mass: torch.Tensor) -> Pins:
    """The pages to pin (``pin_tokens`` of them per KV head, in pages): those whose tokens got the most attention
    ``mass: [H, N]`` (summed over the query rows of a multi-token step; ``N``: the store's factorized tokens in
    segment order, as :meth:`RowStore.attention_parts` lays them out)."""
    method = store.method
    page = method.page
    heads = mass.shape[0]
    per_page, sizes, start = [], [], 0
    for segment in store.segments.values():
        n = segment.slots.numel()
        count = math.ceil(n / page)
        part = torch.nn.functional.pad(mass[:, start : start + n], (0, count * page - n))
        per_page.append(part.view(heads, count, page).sum(-1))
        sizes.append(count)
        start += n
    pins: Pins = {}
    if not per_page:
        return pins
    masses = torch.cat(per_page, dim=1)  # [H, P]
    keep = min(math.ceil(method.pin_tokens / page), math.ceil(method.decode_tokens / page), masses.shape[1])
    flags = torch.zeros_like(masses, dtype=torch.bool)
    flags.scatter_(1, masses.topk(keep, dim=1).indices, True)
    for key, part in zip(store.segments, flags.split(sizes, dim=1), strict=True):
        pins[key] = part
    return pins


def pinned_flags(store: RowStore, layer: int, pins: Pins) -> torch.Tensor:
    """``[H, P]`` bool over the store's pages now (segment order): pinned pages (a segment's pages added since
    it was pinned are not)."""
    flags = []
    for key, segment in store.segments.items():
        count = segment.bounds[layer].pages
        held = pins.get(key)
        part = torch.zeros(store.heads, count, dtype=torch.bool, device=segment.slots.device)
        if held is not None:
            width = min(count, held.shape[1])
            part[:, :width] = held[:, :width]
        flags.append(part)
    return torch.cat(flags, dim=1)


def selected_parts(
    store: RowStore,
    layer: int,
    query: torch.Tensor,
    table: RopeTable | None,
    pages: int | None = None,
    scaling: float | None = None,
    pins: Pins | None = None,
) -> list[Any] | None:
    """The parts a decode step of ``layer`` attends over (chosen pages + exact rows), or ``None`` when every page
    fits the budget (then the caller attends over everything). ``query: [H, M, D]`` float32, packed per KV head.
    ``pages``: choose this many pages per head instead of ``decode_tokens / page`` (tests: all of them);
    ``scaling``: the attention's logit scale (``page_choice=mass`` estimates attention shares with it);
    ``pins``: pages chosen first, whatever their bounds (:func:`pin_pages`), the rest of the budget by bound."""
    method = store.method
    segments = list(store.segments.values())
    held = sum(s.bounds[layer].pages for s in segments) if segments else 0
    chosen = pages if pages is not None else math.ceil(method.decode_tokens / method.page)
    if held == 0 or (pages is None and held <= chosen):
        return None
    chosen = min(chosen, held)
    bounds = torch.cat([s.bounds[layer].upper_bounds(query) for s in segments], dim=2)  # [H, M, P]
    if pins:
        pinned = pinned_flags(store, layer, pins).unsqueeze(1)  # [H, 1, P]
        # above every bound, finite (mass turns bounds into shares): pinned pages first, in any rule
        bounds = torch.where(pinned, bounds.amax() + bounds.abs().amax() + 1.0, bounds)
    top = choose_pages(bounds, chosen, method.page_choice, scaling)  # [H, k], -1: no page (mass)
    heads, dim = store.heads, store.dim
    r_v = store.basis["v"][layer].dequantize().view(-1, heads, dim)  # [r, H, D]
    rotate = table.rotate if table is not None else None
    parts: list[Any] = []
    offset = 0
    offsets = torch.arange(method.page, device=query.device)
    for segment in segments:
        count = segment.bounds[layer].pages
        inside = (top >= offset) & (top < offset + count)
        if bool(inside.any()):
            local = torch.where(inside, top - offset, -1).sort(dim=1, descending=True).values
            local = local[:, : int(inside.sum(1).max())]  # [H, c], -1 = nothing
            rows = (local.clamp(min=0).unsqueeze(-1) * method.page + offsets).flatten(1)  # [H, c·page]
            valid = (local >= 0).repeat_interleave(method.page, dim=1) & (rows < segment.slots.numel())
            rows = torch.where(valid, rows, 0)
            module = fused_kernel(method, segment)
            if module is not None:
                width_k = segment.coords_k.width
                r_k = store.basis["k"][layer].dequantize()[:width_k].view(width_k, heads, dim)
                r_v_part = r_v[: segment.coords_v.width]
                parts.append(FusedSelectedPart(module, segment, r_k, r_v_part, rows, valid, table))
                offset += count
                continue
            page_index = local.clamp(min=0)
            coords_k = read_pages(segment.coords_k, page_index, method.page, rows)  # [H, T, w_k]
            keys = rebuilt_keys(store, segment, layer, rows, rotate, coords_k)
            coords_v = read_pages(segment.coords_v, page_index, method.page, rows)  # [H, T, w_v]
            parts.append(
                SelectedPart(keys, coords_v, r_v[: coords_v.shape[-1]], segment.slots[rows].long(), valid)
            )
        offset += count
    if store.exact_slots is not None and store.exact_slots.numel():
        parts.append(
            DensePart(
                store.exact_keys[layer].dequantize(),
                store.exact_values[layer].dequantize(),
                store.exact_slots.long(),
                exact_rows=True,
            )
        )
    return parts
