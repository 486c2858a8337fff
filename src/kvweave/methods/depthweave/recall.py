"""Recall (``depthweave:recall=N``): a passage the text starts copying, re-materialised from its token ids.

A compressed cache keeps what an induction head needs to copy an old passage no better than a window does: on
the soak's copy stretch (docs/findings.md, seventeenth and twenty-sixth sessions) DepthWeave at 8x, and even at
4x, loses it. The token ids of every position are held anyway (the router and ``protect`` read them). So when
the last ``N`` ids of a decode step occurred before, the passage that followed that earlier occurrence is
rebuilt: the model runs once over it (:data:`BEFORE` tokens before the source to :data:`AFTER` after it, with
:data:`CONTEXT` tokens of context before that, at their own positions), and each DepthWeave layer attends to
the rebuilt keys and values in place of what its stores hold for those positions, for as long as the copy goes
on (:data:`FRESH` steps after the last match). A copy that runs past the rebuilt span rebuilds the next one.

What is rebuilt is not the exact KV (the passage sees :data:`CONTEXT` tokens of context, not everything before
it), and it is held beside the compressed stores while it is used, as 4-bit blocks of the middle tier's layout
(``recall_bits=4``, attended from their codes) or at 16 bits (``recall_bits=16``): those bytes count in
``nbytes()`` and are given back when the copy ends; so do the token ids (4 bytes a position), which the match
reads with ``N`` vector comparisons a step (:func:`copy_source`; nothing else is stored for it). Decode steps
only (one new token per row); a prompt's own repeats are the prompt's. The state here (the spans held) is never
saved: a loaded cache matches from its saved ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvweave.methods.depthweave.middle import MIDDLE_BLOCK, MiddleBlocks

if TYPE_CHECKING:
    from kvweave.cache import KVCache

BEFORE = 16
"""Tokens rebuilt before a copy's source (the context the copied tokens' keys were written in)."""

AFTER = 48
"""Tokens rebuilt from a copy's source on: the span a copy can run through before the next rebuild (with
:data:`BEFORE`, two blocks of the middle tier's 32 tokens)."""

CONTEXT = 64
"""Tokens of context the model sees before a rebuilt span (not kept)."""

FRESH = 32
"""Decode steps a rebuilt span stays after the last step that matched a copy."""


def copy_source(ids: torch.Tensor, n: int) -> int | None:
    """The slot after the last earlier occurrence of the newest ``n`` of ``ids: [L]`` (where a copy reads next),
    or ``None``: ``n`` vector comparisons over the ids, nothing stored beside them."""
    newest = ids.numel() - 1
    count = newest - n + 1  # windows of n ids that end before the newest id start at 0 .. count - 1
    if count <= 0:
        return None
    tail = ids[newest - n + 1 :]
    match = ids[:count] == tail[0]
    for j in range(1, n):
        match &= ids[j : j + count] == tail[j]
    hits = match.nonzero()
    return int(hits[-1]) + n if hits.numel() else None


@dataclass
class RowRecall:
    """One batch row: the span held (``[start, stop)`` slots) and the step after which it is dropped."""

    span: tuple[int, int] | None = None
    until: int = -1


class Recall:
    """A DepthWeave cache's recall state: per batch row, its :class:`RowRecall`; the rebuilt keys and values
    live on the layers that attend to them (``DepthWeaveLayer.recall``, counted in their bytes)."""

    def __init__(self, ngram: int) -> None:
        self.ngram = ngram
        self.rows: list[RowRecall] = []
        self.rebuilds = 0  # spans rebuilt so far (diagnostics: benchmarks/recall_speed.py)

    def step(self, cache: KVCache, decoder: Any) -> None:
        """Before a forward pass of ``cache``'s model (its ids already observed): on a decode step, match each
        row's newest ids against its earlier ones, rebuild a span where a copy starts or outruns its span, and
        drop spans whose copy has ended."""
        ids = cache.context.prompt_ids
        layers = [layer for layer in cache.layers if hasattr(layer, "recall")]
        if ids is None or not layers:
            return
        ids = ids.view(1, -1) if ids.dim() == 1 else ids
        seen = cache.get_seq_length()  # slots before this pass
        if ids.shape[-1] != seen + 1:  # a prefill, a multi-token step, or ids that do not line up: no recall
            return
        while len(self.rows) < ids.shape[0]:
            self.rows.append(RowRecall())
        pads = layers[0].pad_count
        exact_from = seen - layers[0].recent_count()  # the recent buffer: exact already
        for b, row in enumerate(self.rows[: ids.shape[0]]):
            pad = int(pads[b]) if pads is not None and b < pads.numel() else 0
            source = copy_source(ids[b], self.ngram)
            if source is not None and pad <= source < exact_from - BEFORE:
                row.until = seen + FRESH
                if row.span is None or not row.span[0] <= source < row.span[1] - BEFORE:
                    stop = min(exact_from, source + AFTER)  # source < stop - BEFORE
                    start = max(pad, stop - BEFORE - AFTER)
                    if layers[0].method.recall_bits < 16:  # whole blocks of the middle tier's layout
                        stop = start + (stop - start) // MIDDLE_BLOCK * MIDDLE_BLOCK
                    if stop > start:
                        self.rebuild(cache, decoder, layers, b, pad, start, stop)
                        self.rebuilds += 1
                        row.span = (start, stop)
            elif source is not None and row.span is not None:
                row.until = seen + FRESH  # the copy goes on inside the span, or into the exact buffer
            if row.span is not None and seen >= row.until:
                row.span = None
                for layer in layers:
                    layer.recall.pop(b, None)
                    layer.recall_valid.pop(b, None)

    @staticmethod
    def rebuild(
        cache: KVCache, decoder: Any, layers: list[Any], row: int, pad: int, start: int, stop: int
    ) -> None:
        """Run ``decoder`` over row ``row``'s ids of slots ``[start - CONTEXT, stop)`` (not before its padding)
        from no cache, at their positions, and hand each layer its keys and values of ``[start, stop)``."""
        from transformers import DynamicCache

        from kvweave._compat import cache_kwarg

        first = max(pad, start - CONTEXT)
        ids = cache.context.prompt_ids
        assert ids is not None
        ids = ids.view(1, -1) if ids.dim() == 1 else ids
        segment = ids[row : row + 1, first:stop].to(layers[0].device, torch.int64)
        positions = torch.arange(first - pad, stop - pad, device=segment.device).view(1, -1)
        rebuilt = DynamicCache(config=decoder.config)
        with torch.no_grad():
            decoder(
                input_ids=segment, position_ids=positions, use_cache=True, **{cache_kwarg(decoder): rebuilt}
            )
        slots = torch.arange(start, stop, device=segment.device)
        for layer in layers:
            held = rebuilt.layers[layer.layer_idx]
            keys, values = held.keys[:, :, start - first :], held.values[:, :, start - first :]
            bits = layer.method.recall_bits
            if bits < 16:
                layer.recall[row] = (MiddleBlocks.of(keys, values, bits), slots)
            else:
                dtype = layer.method.storage_dtype(held.keys.dtype)
                layer.recall[row] = (keys[0].to(dtype), values[0].to(dtype), slots)


def recall_part(held: tuple[Any, ...], backend: str | None, query: torch.Tensor) -> Any:
    """A layer's rebuilt passage as a part of ``attend_parts``: a :class:`MiddlePart` over its blocks (read by
    ``backend``, the middle tier's, or the one chosen for the query's device) or a dense part."""
    from kvweave.methods.depthweave.middle import MiddlePart, middle_backend
    from kvweave.methods.depthweave.parts import DensePart

    if isinstance(held[0], MiddleBlocks):
        blocks, slots = held
        return MiddlePart(blocks, 0, slots, backend or middle_backend("auto", query.device))
    keys, values, slots = held
    return DensePart(keys.float(), values.float(), slots)


def recall_tensors(layer: Any) -> list[torch.Tensor]:
    """The rebuilt keys, values (or their blocks) and slots ``layer`` holds (for its byte count)."""
    tensors: list[torch.Tensor] = []
    for held in getattr(layer, "recall", {}).values():
        for item in held:
            tensors += item.tensors() if isinstance(item, MiddleBlocks) else [item]
    return tensors
