"""The cache layer: attention over the group's row stores plus this layer's recent buffer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvweave._compat import mask_to_bool
from kvweave.cache import CompressedLayer, tensors_nbytes
from kvweave.methods.depthweave.middle import middle_backend
from kvweave.methods.depthweave.parts import attend_parts, in_set
from kvweave.methods.depthweave.recall import recall_part, recall_tensors
from kvweave.methods.depthweave.router import pooled_attention, window_attention
from kvweave.methods.depthweave.select import Pins, pin_pages, selected_parts
from kvweave.ops.masking import prompt_padding

if TYPE_CHECKING:
    from kvweave.cache import KVCache
    from kvweave.methods.depthweave import DepthWeave
    from kvweave.methods.depthweave.group import RecentBuffer, WeaveGroup


class DepthWeaveLayer(CompressedLayer):
    """One full-attention layer: an exact recent buffer; older tokens live in its group's row stores.

    The buffer and the stores belong to the layer's :class:`WeaveGroup` (``group``, set once all layers are
    built, by ``DepthWeave.bind_layers``), which saves them; the layer saves only the common bookkeeping.
    """

    state_fields = CompressedLayer.state_fields
    group: WeaveGroup

    def __init__(self, cache: KVCache, layer_idx: int, method: DepthWeave) -> None:
        super().__init__(cache, layer_idx)
        self.method = method
        # batch row -> pinned pages (``pin_tokens``): set by a multi-token step over the compressed cache, read by
        # the decode steps after it; derived from attention, so not saved (a loaded cache pins at its next one)
        self.pins: dict[int, Pins] = {}
        # ``[B, H, n]`` attention of the prompt's last queries during a prefill: pins the pages once the group's
        # stores exist, then dropped (:meth:`pin_from_prompt`; never held between forward passes)
        self.prompt_mass: torch.Tensor | None = None
        # what attended over the middle tier at the last decode step with one (``cpp`` or ``torch``)
        self.middle_kernel: str | None = None
        # batch row -> a copied passage rebuilt (``recall``): ``(keys [H, n, D], values, slots [n])`` at 16 bits or
        # ``(MiddleBlocks, slots)``; set before a decode step by the cache's
        # :class:`~kvweave.methods.depthweave.recall.Recall`, never saved
        self.recall: dict[int, tuple[Any, ...]] = {}
        # batch row -> ``(exact slots, span slots, valid flags)``: which rebuilt entries the store's exact rows
        # replace, kept while neither tensor changes (exact rows are added as new tensors)
        self.recall_valid: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # batch row -> the ``[start, stop)`` spans its rebuilt slots are, in order (several: a question's quotes)
        self.recall_spans: dict[int, list[tuple[int, int]]] = {}

    @property
    def recent(self) -> RecentBuffer:
        """This layer's exact newest tokens (held by its group, which folds them)."""
        return self.group.recent[self.layer_idx]

    def reset(self) -> None:
        """Forget every token: this layer's bookkeeping and recent buffer, and its group's row stores (the group
        binding stays: ``cache.reset()`` resets every member, so the whole group starts fresh)."""
        self.__init__(self.cache, self.layer_idx, self.method)  # type: ignore[misc]
        self.group.reset_member(self.layer_idx)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.pins = {
            new: self.pins[int(old)] for new, old in enumerate(rows.tolist()) if int(old) in self.pins
        }
        self.recent.select_rows(rows)
        if self.layer_idx == self.group.members[-1]:
            self.group.select_rows(rows)
        self.recall, self.recall_valid, self.recall_spans = {}, {}, {}  # rebuilt at the next copy
        self.cache.context.decode_state = (
            None  # recall's spans, of the rows before: matched again from the ids
        )

    # -- attention step
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``query: [B, Hq, q, D]``, ``key, value: [B, H, q, D]`` (post-RoPE) -> ``[B, q, Hq, D]``."""
        first, q_len = self.seen, key.shape[2]
        scaling = float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(first, first + q_len, device=key.device).view(1, -1)
        self.push_recent(key, value, positions.expand(self.rows, -1))
        self.seen += q_len
        group, recent = self.group, self.recent
        if first == 0:  # prefill: exact attention, like every method; compression happens as the KV is stored
            self.pad_count = prompt_padding(attention_mask, self.rows, q_len, key.device)
            out = self.prompt_attention(module, query, key, value, attention_mask, **kwargs)
            scores = self.method.router or self.method.weighting > 0
            pins = self.method.pinning
            window = self.method.window
            span = self.method.pin_window or window  # the queries whose attention pins pages
            probs = None
            if scores:  # the last prompt queries' attention, once for both readers when their windows agree
                probs = window_attention(query, key, self.pad_count, window, scaling)
                recent.score = pooled_attention(probs)
            if pins:
                if probs is None or span != window:
                    probs = window_attention(query, key, self.pad_count, span, scaling)
                self.pins, self.prompt_mass = {}, probs.sum(2)  # [B, H, n]
        else:
            out = self.compressed_attention(query, attention_mask, first, scaling)
        count = group.fold_count(self.layer_idx, first, self.seen)
        if count > 0 and (self.method.probes or first == 0):  # prefill probes also measure fixed ranks
            keep = min(self.method.probe, q_len)
            slots = torch.arange(first + q_len - keep, first + q_len, device=key.device)
            recent.keep_queries(query[:, :, -keep:].clone(), slots, scaling)
        if count > 0 and self.layer_idx == group.members[-1]:  # every member has stored this step
            group.fold(self, count, first)
        if first > 0 and self.layer_idx == group.members[-1]:
            group.settle(self.seen)
        if first == 0 and self.layer_idx == group.members[-1]:
            self.pin_from_prompt(group)
        return out  # type: ignore[no-any-return]

    def push_recent(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """Append new exact tokens ``[B, H, q, D]`` to the recent buffer (in the storage dtype)."""
        positions = positions.to(torch.int32)
        dtype = self.method.storage_dtype(key.dtype)
        key, value = key.to(dtype), value.to(dtype)
        if dtype != self.dtype and not (torch.isfinite(key).all() and torch.isfinite(value).all()):
            raise ValueError(
                f"{self.method.name}: keys/values overflow storage dtype {dtype} in layer "
                f"{self.layer_idx}; use storage=bfloat16 or storage=model"
            )
        self.recent.append(key, value, positions)

    def recent_count(self) -> int:
        return self.recent.count()

    def compressed_attention(
        self, query: torch.Tensor, attention_mask: torch.Tensor | None, first: int, scaling: float
    ) -> torch.Tensor:
        """Attention of the new queries over the group's stores + the recent buffer, row by row."""
        mask = mask_to_bool(attention_mask)
        recent = self.recent
        m = recent.count()
        recent_slots = torch.arange(self.seen - m, self.seen, device=query.device)
        stores = self.group.rows
        pre_rope = self.method.keys == "pre_rope"
        rotary = self.cache.rotary_for(self.layer_idx) if pre_rope else None
        selective = self.method.decode_tokens > 0 and query.shape[2] == 1  # one new token per row: decoding
        table = self.cache.context.rope_table(self.layer_idx) if selective and pre_rope else None
        if table is not None:
            table.ensure(self.seen + 1, query.device)
        outs = []
        heads = self.recent.keys.shape[1]  # type: ignore[union-attr]
        backend = "torch"
        if recent.middle is not None:
            backend = self.middle_kernel = middle_backend(self.method.kernel, query.device)
        for b in range(query.shape[0]):
            store = stores[b] if b < len(stores) else None
            parts = None
            if store is not None and selective:
                packed = query[b].float().reshape(heads, -1, query.shape[-1])  # [H, g, D]
                pins = self.pins.get(b)
                parts = selected_parts(store, self.layer_idx, packed, table, scaling=scaling, pins=pins)
            pin = (
                parts is None
                and not selective
                and self.method.pinning
                and store is not None
                and bool(store.segments)
            )
            if parts is None:
                parts = store.attention_parts(self.layer_idx, rotary) if store is not None else []
            buffer = recent.parts(b, recent_slots, backend)
            parts.extend(buffer)
            # decode steps, and with ``quote`` the multi-token steps too (a question attends what it quotes)
            rebuilt = self.recall.get(b) if query.shape[2] == 1 or self.method.quote > 0 else None
            if rebuilt is not None:
                spans = self.recall_spans.get(b)
                part = recall_part(rebuilt, backend if recent.middle is not None else None, query, spans)
                exact = store.exact_slots if store is not None else None
                if exact is not None and exact.numel():  # exact rows, written with their whole context, stay
                    known = self.recall_valid.get(b)
                    if known is None or known[0] is not exact or known[1] is not part.slots:
                        known = (exact, part.slots, ~in_set(part.slots, exact).expand(heads, -1))
                        self.recall_valid[b] = known
                    part.valid = known[2]
                parts.insert(0, part)
            row_mask = None if mask is None else mask[b : b + 1]
            masses: list[torch.Tensor] | None = [] if pin else None
            out, recent_attention = attend_parts(
                query[b].float(),
                parts,
                row_mask,
                first,
                scaling,
                masses,
                recent_parts=len(buffer),
                recall_parts=int(rebuilt is not None),
            )
            if masses:  # a multi-token step over everything: pin the pages it attended most
                assert store is not None
                self.pins[b] = pin_pages(store, masses[int(rebuilt is not None)])
            score = recent.score[b]  # type: ignore[index]
            recent.score[b] = torch.maximum(score, recent_attention)  # type: ignore[index]
            outs.append(out)
        return torch.stack(outs).to(query.dtype)

    @staticmethod
    def pin_from_prompt(group: WeaveGroup) -> None:
        """After a whole prompt's prefill (the group's stores just built): pin each member layer's pages from the
        attention its last prompt queries paid (``prompt_mass``, by position), then drop that mass. A prompt
        with the question inside pins what the question attended, as a question fed after the document does."""
        for layer in group.layers:
            mass, layer.prompt_mass = layer.prompt_mass, None
            if mass is None:
                continue
            for b, store in enumerate(group.rows):
                if store is None or not store.segments or b >= mass.shape[0]:
                    continue
                slots = torch.cat([s.slots for s in store.segments.values()]).long()
                inside = slots < mass.shape[2]
                per_token = torch.where(inside, mass[b][:, slots.clamp(max=mass.shape[2] - 1)], 0.0)
                layer.pins[b] = pin_pages(store, per_token)

    def held_kv(self, row: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``keys, values: [H, N, D]`` float32 post-RoPE and ``slots: [N]``: all that row ``row`` attends to.

        Materialises the whole layer (diagnostics and tests; attention itself never reconstructs values).
        """
        stores = self.group.rows
        store = stores[row] if row < len(stores) else None
        rotary = self.cache.rotary_for(self.layer_idx) if self.method.keys == "pre_rope" else None
        keys, values, slots = [], [], []
        for part in store.attention_parts(self.layer_idx, rotary) if store is not None else []:
            k, v = part.dense()
            keys.append(k)
            values.append(v)
            slots.append(part.slots)
        recent = self.recent
        m = recent.count()
        recent_keys, recent_values = recent.row(row)
        keys.append(recent_keys)
        values.append(recent_values)
        slots.append(torch.arange(self.seen - m, self.seen, device=self.device))
        return torch.cat(keys, dim=1), torch.cat(values, dim=1), torch.cat(slots)

    # -- accounting
    def nbytes(self) -> int:
        recent = self.recent
        tensors = recent.tensors() + ([self.pad_count] if self.pad_count is not None else [])
        tensors += recent.query_tensors()
        tensors += [flags for pins in self.pins.values() for flags in pins.values()]  # pinned pages
        # a copied passage (``recall``; the ids it reads count in ``KVCache.nbytes``)
        tensors += recall_tensors(self)
        group = self.group
        for store in group.rows:
            if store is not None:
                tensors += store.layer_tensors(self.layer_idx)
                if self.layer_idx == group.members[-1]:
                    tensors += store.shared_tensors()
        return tensors_nbytes(tensors)

    def read_bytes(self) -> int:
        """Bytes one decode step of this layer reads: its recent buffer, coefficients, exact rows and page
        summaries, and the coordinates of the tokens it attends (the chosen pages with selective decode; every
        token's otherwise: the group's coordinates are read by each member layer)."""
        tensors = self.recent.tensors()
        total = 0
        method = self.method
        for store in self.group.rows:
            if store is None:
                continue
            tensors = tensors + store.layer_tensors(self.layer_idx)
            for segment in store.segments.values():
                bounds = segment.bounds.get(self.layer_idx)
                coords = segment.coords_k.nbytes() + segment.coords_v.nbytes()
                rows = segment.slots.numel()
                if bounds is not None:
                    total += sum(t.numel() * t.element_size() for t in bounds.tensors())
                    chosen = (
                        min(rows, store.heads * method.decode_tokens) if method.decode_tokens > 0 else rows
                    )
                    coords = coords * chosen // max(rows, 1)
                total += coords + segment.slots.numel() * segment.slots.element_size()
        return total + tensors_nbytes(tensors)

    def entries(self) -> int:
        """Tokens held (row 0): recent + exact rows + factorized tokens."""
        stores = self.group.rows
        held = stores[0].tokens() if stores and stores[0] is not None else 0
        return self.recent_count() + held

    def layer_stats(self) -> dict[str, Any]:
        group = self.group
        stats = {
            "entries": self.entries(),
            "recent": self.recent_count(),
            "middle_tokens": self.recent.middle_count(),  # of ``recent``: in the 4-bit middle tier
            "middle_kernel": self.middle_kernel,
            "group": group.index,
            "group_layers": list(group.members),
            "group_owner": self.layer_idx == group.members[-1],
        }
        stats.update(group.summary())
        return stats
