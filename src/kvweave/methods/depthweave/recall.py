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
reads with ``N`` vector comparisons a step (:func:`copy_source`; nothing else is stored for it). A prompt's own
repeats are the prompt's.

With ``quote=M`` (default 3, since spec version 9) a multi-token step over the compressed cache of at most
:data:`QUOTED` tokens (a question fed after its document) does the same for what it quotes: each run of ``M`` or
more of its ids that occurred exactly once in the compressed part rebuilds the passage around that occurrence
(:func:`quote_sources`; at most :data:`QUOTES` passages a row, the longest runs first), and the step itself and
the decode steps after it attend to them, for as long as the answer copies from them (:data:`FRESH` steps after
the question or after the last step whose newest ``M`` ids occur inside a passage held: :func:`copies_from`). A
question names a fact by words of the document (the key of a needle, a function's name); the value the answer
copies follows it, whatever it looks like. Each quoted passage is rebuilt with ``quote_context`` tokens of
context before it (default :data:`CONTEXT`) and reaches ``quote_after`` tokens past the quote (default 16: with
4-bit passages one 32-token block; a passage reaching further, e.g. :data:`AFTER` as before spec version 9, pulls
an answer listing several values toward the passage's own text). With ``quote_over=cache`` a quoted passage is
rebuilt over the compressed cache instead (:meth:`Recall.rebuild_over_cache`): its ids run at their positions
over what every layer holds for the slots before it, materialised once a question (``held_kv``), so it sees its
whole (compressed) context rather than ``quote_context`` tokens of ids from no cache. The state here (the spans held) is never saved:
a loaded cache matches from its saved ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
"""Decode steps a rebuilt span stays after the last step that matched a copy (or, for a question's quotes, after
the question or the last step that copied from them)."""

QUOTES = 4
"""Passages a question's quotes rebuild at most per batch row (``quote``)."""

QUOTED = 512
"""The longest multi-token step whose quotes are matched (``quote``): a question, not a chunk of a document."""

WINDOWS = 1 << 16
"""Earlier windows compared at once by :func:`quote_sources` (bounds its ``[windows, step]`` table)."""


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


def quote_sources(
    ids: torch.Tensor, seen: int, n: int, low: int, high: int, most: int = 1
) -> list[tuple[int, int]]:
    """The quotes of a multi-token step: ``ids: [L]``, the step's ids from slot ``seen`` on. Each run of new
    windows of ``n`` ids that occurred once in slots ``[low, high)`` (a window wholly inside), or up to ``most``
    times (``quote_repeats``: each occurrence a run of its own), as ``(windows in the run, the slot after the last
    one's earlier occurrence)``, longest runs first (the earlier occurrence first among runs of one length)."""
    new = ids[seen:]
    steps, count = new.numel() - n + 1, high - low - n + 1
    if steps <= 0 or count <= 0:
        return []
    hits = torch.zeros(steps, dtype=torch.int64)
    where = torch.zeros(steps, dtype=torch.int64)
    found_at: dict[int, list[int]] = {}  # most > 1: window -> the slots after its earlier occurrences
    for first in range(0, count, WINDOWS):
        width = min(WINDOWS, count - first)
        old = ids[low + first : low + first + width + n - 1]
        match = old[:width, None] == new[None, :steps]
        for j in range(1, n):
            match &= old[j : j + width, None] == new[None, j : j + steps]
        hits += match.sum(0).cpu()
        found = match.any(0).cpu()
        where[found] = low + first + match.int().argmax(0).cpu()[found]
        if most > 1:  # every occurrence of the windows still rare enough
            rare = (found & (hits <= most)).nonzero().view(-1)
            for i, k in match[:, rare.to(match.device)].nonzero().tolist():
                found_at.setdefault(int(rare[k]), []).append(low + first + i + n)
    runs: list[tuple[int, int]] = []
    previous: dict[int, int] = {}  # the slot each run of the previous window reached -> its index in ``runs``
    for j in range(steps):
        if not 1 <= int(hits[j]) <= most:
            previous = {}
            continue
        sources = [int(where[j]) + n] if int(hits[j]) == 1 else sorted(found_at[j])
        reached = {}
        for source in sources:
            k = previous.get(source - 1)
            if k is None:  # a run starts
                runs.append((1, source))
                k = len(runs) - 1
            else:  # the quote goes on where the document did
                runs[k] = (runs[k][0] + 1, source)
            reached[source] = k
        previous = reached
    return sorted(runs, key=lambda run: -run[0])


def inside(spans: list[tuple[int, int]], source: int) -> bool:
    """Whether a copy reading slot ``source`` next goes on inside one of ``spans`` (``[start, stop)``), with
    :data:`BEFORE` tokens of it still ahead."""
    return any(start <= source < stop - BEFORE for start, stop in spans)


def copies_from(ids: torch.Tensor, spans: list[tuple[int, int]], n: int) -> bool:
    """Whether the newest ``n`` of ``ids: [L]`` occur together inside one of ``spans`` (``[start, stop)``
    slots): the answer is copying from a passage held."""
    if n <= 0 or ids.numel() <= n:
        return False
    tail = ids[-n:]
    for start, stop in spans:
        window = ids[start:stop]
        if window.numel() >= n and bool((window.unfold(0, n, 1) == tail).all(1).any()):
            return True
    return False


@dataclass
class RowRecall:
    """One batch row: the spans held (``[start, stop)`` slots, one for a copy, up to :data:`QUOTES` for a
    question's quotes) and the step after which they are dropped."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    until: int = -1

    def holds(self, source: int) -> bool:
        """Whether a copy reading slot ``source`` next goes on inside a span held."""
        return inside(self.spans, source)


class Recall:
    """A DepthWeave cache's recall state: per batch row, its :class:`RowRecall`; the rebuilt keys and values
    live on the layers that attend to them (``DepthWeaveLayer.recall``, counted in their bytes). Its options
    (``recall``, ``quote``, ``quote_context``, ``quote_after``) are read from the layers' method each step."""

    def __init__(self) -> None:
        self.rows: list[RowRecall] = []
        self.rebuilds = 0  # spans rebuilt so far (diagnostics: benchmarks/recall_speed.py)

    def step(self, cache: KVCache, decoder: Any) -> None:
        """Before a forward pass of ``cache``'s model (its ids already observed): on a decode step, match each
        row's newest ids against its earlier ones, rebuild a span where a copy starts or outruns its span, and
        drop spans whose copy has ended; on a short multi-token step (``quote``), rebuild what it quotes."""
        ids = cache.context.prompt_ids
        layers = [layer for layer in cache.layers if hasattr(layer, "recall")]
        if ids is None or not layers:
            return
        method = layers[0].method
        ids = ids.view(1, -1) if ids.dim() == 1 else ids
        seen = cache.get_seq_length()  # slots before this pass
        new = ids.shape[-1] - seen
        if new < 1 or seen == 0:  # a prefill, or ids that do not line up: no recall
            return
        if new > 1:
            if method.quote and new <= QUOTED:
                self.quotes(cache, decoder, layers, ids, seen)
            return
        if method.quote:  # spans held while the answer copies from them
            for b, row in enumerate(self.rows[: ids.shape[0]]):
                if row.spans and copies_from(ids[b], row.spans, method.quote):
                    row.until = seen + FRESH
        if method.recall <= 0:  # quotes only: their spans held until FRESH steps after the last copy
            self.expire(layers, seen)
            return
        while len(self.rows) < ids.shape[0]:
            self.rows.append(RowRecall())
        pads = layers[0].pad_count
        exact_from = seen - layers[0].recent_count()  # the recent buffer: exact already
        for b, row in enumerate(self.rows[: ids.shape[0]]):
            pad = int(pads[b]) if pads is not None and b < pads.numel() else 0
            source = copy_source(ids[b], method.recall)
            if source is not None and pad <= source < exact_from - BEFORE:
                row.until = seen + FRESH
                if not row.holds(source):
                    span = self.span(source, pad, exact_from, layers)
                    if span is not None:
                        self.rebuild(cache, decoder, layers, b, pad, [span])
                        self.rebuilds += 1
                        row.spans = [span]
            elif source is not None and row.spans:
                row.until = seen + FRESH  # the copy goes on inside the span, or into the exact buffer
        self.expire(layers, seen)

    def expire(self, layers: list[Any], seen: int) -> None:
        """Drop the spans of rows whose copy (or question) ended :data:`FRESH` steps before slot ``seen``."""
        for b, row in enumerate(self.rows):
            if row.spans and seen >= row.until:
                row.spans = []
                for layer in layers:
                    layer.recall.pop(b, None)
                    layer.recall_valid.pop(b, None)
                    layer.recall_spans.pop(b, None)

    @staticmethod
    def span(
        source: int, pad: int, exact_from: int, layers: list[Any], after: int = 0, reach: int = AFTER
    ) -> tuple[int, int] | None:
        """The span rebuilt for a copy reading slot ``source`` next: :data:`BEFORE` tokens before it to ``reach``
        (:data:`AFTER`) after, not before ``pad`` or ``after`` nor into the exact buffer, whole blocks of the
        middle tier's layout when held as blocks; ``None`` when nothing is left."""
        stop = min(exact_from, source + reach)
        start = max(pad, after, stop - BEFORE - reach)
        if layers[0].method.recall_bits < 16:  # whole blocks of the middle tier's layout
            stop = start + (stop - start) // MIDDLE_BLOCK * MIDDLE_BLOCK
        return (start, stop) if stop > start else None

    def quotes(self, cache: KVCache, decoder: Any, layers: list[Any], ids: torch.Tensor, seen: int) -> None:
        """A short multi-token step (``quote``): per row, the passages around what its ids quote (runs of
        ``quote`` or more ids that occurred once in the compressed part) rebuilt in place of any spans held."""
        while len(self.rows) < ids.shape[0]:
            self.rows.append(RowRecall())
        method = layers[0].method
        pads = layers[0].pad_count
        exact_from = seen - layers[0].recent_count()
        for b, row in enumerate(self.rows[: ids.shape[0]]):
            pad = int(pads[b]) if pads is not None and b < pads.numel() else 0
            quoted = quote_sources(ids[b], seen, method.quote, pad, exact_from, method.quote_repeats)
            sources = [src for _, src in quoted]
            spans: list[tuple[int, int]] = []
            for source in sources:
                if source >= exact_from - BEFORE or inside(spans, source):
                    continue  # exact already, or inside a passage already chosen
                span = self.span(source, pad, exact_from, layers, reach=method.quote_after)
                if span is None:
                    continue
                overlap = [s for s in spans if s[0] < span[1] and span[0] < s[1]]
                if overlap:  # move it past the passage it overlaps (whole blocks still)
                    after = max(s[1] for s in overlap)
                    span = self.span(source, pad, exact_from, layers, after, method.quote_after)
                    if span is None or any(s[0] < span[1] and span[0] < s[1] for s in spans):
                        continue
                spans.append(span)
                if len(spans) == QUOTES:
                    break
            if not spans:
                continue
            spans.sort()
            if method.quote_over == "cache":
                self.rebuild_over_cache(cache, decoder, layers, b, pad, spans)
            else:
                self.rebuild(cache, decoder, layers, b, pad, spans, method.quote_context)
            self.rebuilds += len(spans)
            row.spans, row.until = spans, ids.shape[-1] + FRESH

    @staticmethod
    def rebuild_over_cache(
        cache: KVCache, decoder: Any, layers: list[Any], row: int, pad: int, spans: list[tuple[int, int]]
    ) -> None:
        """Per span ``[start, stop)``: run ``decoder`` over row ``row``'s ids of the span at their positions, over
        a cache of what the compressed layers hold for the slots before ``start`` (their own keys and values,
        materialised once for all spans in the model's dtype: for a moment, the bytes of a full cache of the row);
        hand each layer its keys and values of the spans."""
        from transformers import DynamicCache

        ids = cache.context.prompt_ids
        assert ids is not None
        ids = ids.view(1, -1) if ids.dim() == 1 else ids
        if len(layers) != len(cache.layers):
            raise ValueError("quote_over=cache needs every layer of the cache to be DepthWeave's")
        dtype = next(decoder.parameters()).dtype
        prior = []
        for layer in layers:
            k, v, slots = layer.held_kv(row)
            order = slots.argsort()
            prior.append((k[:, order].to(dtype), v[:, order].to(dtype), slots[order]))
        held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {layer.layer_idx: [] for layer in layers}
        for start, stop in spans:
            rebuilt = DynamicCache(config=decoder.config)
            for layer, (k, v, slots) in zip(layers, prior, strict=True):
                keep = (slots >= pad) & (slots < start)
                rebuilt.update(k[:, keep][None], v[:, keep][None], layer.layer_idx)
            Recall.run_span(decoder, layers, ids[row : row + 1], start, start, stop, pad, rebuilt, held)
        Recall.hand(layers, row, spans, held)

    @staticmethod
    def rebuild(
        cache: KVCache,
        decoder: Any,
        layers: list[Any],
        row: int,
        pad: int,
        spans: list[tuple[int, int]],
        context: int = CONTEXT,
    ) -> None:
        """Per span ``[start, stop)`` (ascending, apart): run ``decoder`` over row ``row``'s ids of slots
        ``[start - context, stop)`` (not before its padding) from no cache, at their positions; hand each layer
        its keys and values of the spans, one after another, and the spans (what its attention hides)."""
        from transformers import DynamicCache

        ids = cache.context.prompt_ids
        assert ids is not None
        ids = ids.view(1, -1) if ids.dim() == 1 else ids
        held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {layer.layer_idx: [] for layer in layers}
        for start, stop in spans:
            first = max(pad, start - context)
            rebuilt = DynamicCache(config=decoder.config)
            Recall.run_span(decoder, layers, ids[row : row + 1], first, start, stop, pad, rebuilt, held)
        Recall.hand(layers, row, spans, held)

    @staticmethod
    def run_span(
        decoder: Any,
        layers: list[Any],
        ids: torch.Tensor,
        first: int,
        start: int,
        stop: int,
        pad: int,
        rebuilt: Any,
        held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> None:
        """Run ``decoder`` over ``ids``' slots ``[first, stop)`` at their positions (after ``pad`` padding slots),
        over the DynamicCache ``rebuilt``; append each layer's keys and values of slots ``[start, stop)`` to
        ``held``."""
        from kvweave._compat import cache_kwarg

        segment = ids[:, first:stop].to(layers[0].device, torch.int64)
        positions = torch.arange(first - pad, stop - pad, device=segment.device).view(1, -1)
        with torch.no_grad():
            decoder(
                input_ids=segment, position_ids=positions, use_cache=True, **{cache_kwarg(decoder): rebuilt}
            )
        for layer in layers:
            kv = rebuilt.layers[layer.layer_idx]
            held[layer.layer_idx].append(
                (kv.keys[:, :, -(stop - start) :], kv.values[:, :, -(stop - start) :])
            )

    @staticmethod
    def hand(
        layers: list[Any],
        row: int,
        spans: list[tuple[int, int]],
        held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> None:
        """Hand each layer its rebuilt keys and values of ``spans`` (one after another) and the spans."""
        slots = torch.cat([torch.arange(start, stop) for start, stop in spans]).to(layers[0].device)
        for layer in layers:
            parts = held[layer.layer_idx]
            keys = torch.cat([k for k, _ in parts], dim=2)
            values = torch.cat([v for _, v in parts], dim=2)
            bits = layer.method.recall_bits
            if bits < 16:
                layer.recall[row] = (MiddleBlocks.of(keys, values, bits), slots)
            else:
                dtype = layer.method.storage_dtype(keys.dtype)
                layer.recall[row] = (keys[0].to(dtype), values[0].to(dtype), slots)
            layer.recall_valid.pop(row, None)
            layer.recall_spans[row] = list(spans)


def recall_part(
    held: tuple[Any, ...],
    backend: str | None,
    query: torch.Tensor,
    spans: list[tuple[int, int]] | None = None,
) -> Any:
    """A layer's rebuilt passages as a part of ``attend_parts``: a :class:`MiddlePart` over its blocks (read by
    ``backend``, the middle tier's, or the one chosen for the query's device) or a dense part; ``spans`` (more
    than one: a question's quotes) tell the attention which stored slots they stand in for."""
    from kvweave.methods.depthweave.middle import MiddlePart, middle_backend
    from kvweave.methods.depthweave.parts import DensePart

    part: Any
    if isinstance(held[0], MiddleBlocks):
        blocks, slots = held
        part = MiddlePart(blocks, 0, slots, backend or middle_backend("auto", query.device))
    else:
        keys, values, slots = held
        part = DensePart(keys.float(), values.float(), slots)
    part.spans = spans if spans is not None and len(spans) > 1 else None
    return part


def recall_tensors(layer: Any) -> list[torch.Tensor]:
    """The rebuilt keys, values (or their blocks) and slots ``layer`` holds (for its byte count)."""
    tensors: list[torch.Tensor] = []
    for held in getattr(layer, "recall", {}).values():
        for item in held:
            tensors += item.tensors() if isinstance(item, MiddleBlocks) else [item]
    return tensors
