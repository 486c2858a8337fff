"""A group of layers sharing one token-side base: their recent buffers, the row stores, and the folding.

Data flow of one step: every member layer appends its new tokens to its own :class:`RecentBuffer` (held here,
in ``WeaveGroup.recent``) and attends over the group's row stores plus that buffer; once the last member has
stored the step, :meth:`WeaveGroup.fold` moves the oldest tokens of every member's buffer into the stores and
drops them from the buffers. Layers never touch each other's buffers.
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any

import torch

from kvweave.cache import tensors_nbytes
from kvweave.methods.depthweave.chunk import Chunk
from kvweave.methods.depthweave.factorize import add_chunk
from kvweave.methods.depthweave.middle import MIDDLE_BLOCK, MiddleBlocks, MiddlePart
from kvweave.methods.depthweave.middle import token_bytes as middle_token_bytes
from kvweave.methods.depthweave.parts import DensePart
from kvweave.methods.depthweave.probes import Probe
from kvweave.methods.depthweave.ranks import Budget
from kvweave.methods.depthweave.router import content_scores, retrievable_scores
from kvweave.methods.depthweave.store import RowStore
from kvweave.state import Stateful

if TYPE_CHECKING:
    from kvweave.methods.depthweave.layer import DepthWeaveLayer


_WARNED: set[tuple[float, int]] = set()
"""(target, prompt length // 256) already warned about (one warning each per process)."""


class RecentBuffer(Stateful):
    """One member layer's newest tokens and the probe queries it gave for this step's fold.

    The newest tokens are exact and post-RoPE (``keys, values``); with ``middle_bits`` the older ones, once the
    budget keeps more than ``recent`` unfolded, wait in integer blocks (``middle``, :mod:`.middle`) before their
    fold. ``positions`` and ``score`` cover the whole buffer, middle first. The layer appends to it and attends
    over it; its group moves tokens to the middle (:meth:`settle`) and folds the oldest away (:meth:`drop`).
    """

    state_name = "depthweave.RecentBuffer"

    state_fields = ("keys", "values", "middle", "positions", "score", "queries", "query_slots", "scaling")
    state_defaults = {"middle": None}  # caches saved before the middle tier have none

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [B, H, m_e, D] post-RoPE, exact (the newest)
        self.values: torch.Tensor | None = None  # [B, H, m_e, D]
        self.middle: MiddleBlocks | None = None  # the older unfolded tokens, integer blocks
        self.positions: torch.Tensor | None = None  # [B, m] int32 RoPE positions (middle, then exact)
        self.score: torch.Tensor | None = None  # [B, m] float32 attention received (router signal)
        self.queries: torch.Tensor | None = None  # [B, Hq, p, D] probe queries, held until the group folds
        self.query_slots: torch.Tensor | None = None  # [p] their token indices
        self.scaling = 1.0  # the attention scale of those queries

    def count(self) -> int:
        return self.middle_count() + (0 if self.keys is None else int(self.keys.shape[2]))

    def middle_count(self) -> int:
        return 0 if self.middle is None else self.middle.count()

    def append(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """Add new tokens ``[B, H, q, D]`` (storage dtype) with their ``[B, q]`` int32 positions."""
        score = torch.zeros(key.shape[0], key.shape[2], dtype=torch.float32, device=key.device)
        if self.keys is None:
            self.keys, self.values = key, value
            self.positions, self.score = positions.contiguous(), score
            return
        self.keys = torch.cat([self.keys, key], dim=2)
        self.values = torch.cat([self.values, value], dim=2)  # type: ignore[list-item]
        self.positions = torch.cat([self.positions, positions], 1)  # type: ignore[list-item]
        self.score = torch.cat([self.score, score], dim=1)  # type: ignore[list-item]

    def row(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``b``'s whole buffer, oldest first: ``keys, values: [H, m, D]`` float32."""
        keys, values = self.keys[b].float(), self.values[b].float()  # type: ignore[index]
        if self.middle is None:
            return keys, values
        old_keys, old_values = self.middle.dense(b)
        return torch.cat([old_keys, keys], dim=1), torch.cat([old_values, values], dim=1)

    def parts(self, b: int, slots: torch.Tensor, backend: str) -> list[MiddlePart | DensePart]:
        """Row ``b``'s buffer as attention parts over token indices ``slots: [m]``: the middle tier read from its
        codes (``backend``, :func:`~kvweave.methods.depthweave.middle.middle_backend`), then the exact tokens."""
        keys, values = self.keys[b].float(), self.values[b].float()  # type: ignore[index]
        if self.middle is None:
            return [DensePart(keys, values, slots)]
        middle = self.middle_count()
        return [MiddlePart(self.middle, b, slots[:middle], backend), DensePart(keys, values, slots[middle:])]

    def oldest(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The oldest ``count`` tokens ``[B, H, count, D]`` in the storage dtype (middle ones dequantized)."""
        keys, values = self.keys[:, :, :count], self.values[:, :, :count]  # type: ignore[index]
        if self.middle is None:
            return keys, values
        old_keys, old_values = self.middle.dense()
        old_keys, old_values = old_keys[:, :, :count].to(keys.dtype), old_values[:, :, :count].to(keys.dtype)
        rest = count - old_keys.shape[2]
        return torch.cat([old_keys, keys[:, :, :rest]], 2), torch.cat([old_values, values[:, :, :rest]], 2)

    def settle(self, recent: int, bits: int) -> None:
        """Move whole blocks of exact tokens older than the newest ``recent`` into the middle tier."""
        assert self.keys is not None and self.values is not None
        blocks = max(int(self.keys.shape[2]) - recent, 0) // MIDDLE_BLOCK
        if blocks == 0:
            return
        cut = blocks * MIDDLE_BLOCK
        moved = MiddleBlocks.of(self.keys[:, :, :cut], self.values[:, :, :cut], bits)
        self.middle = moved if self.middle is None else self.middle.append(moved)
        self.keys, self.values = self.keys[:, :, cut:].clone(), self.values[:, :, cut:].clone()

    def keep_queries(self, queries: torch.Tensor, slots: torch.Tensor, scaling: float) -> None:
        """Hold this step's probe queries ``[B, Hq, p, D]`` (token indices ``slots: [p]``) for the fold."""
        self.queries, self.query_slots, self.scaling = queries, slots, scaling

    def drop(self, count: int) -> None:
        """Forget the oldest ``count`` tokens (they now live in the group's row stores) and the probe queries.

        Middle blocks go whole; the rest of a block cut through returns to the exact tokens as dequantized."""
        middle = self.middle_count()
        if middle:
            assert self.middle is not None
            whole, part = divmod(min(count, middle), MIDDLE_BLOCK)
            if part:  # the cut block's later tokens stay, no longer as integers
                keys, values = self.middle.dense()
                start, stop = whole * MIDDLE_BLOCK + part, (whole + 1) * MIDDLE_BLOCK
                dtype = self.keys.dtype  # type: ignore[union-attr]
                self.keys = torch.cat([keys[:, :, start:stop].to(dtype), self.keys], 2)  # type: ignore[list-item]
                self.values = torch.cat([values[:, :, start:stop].to(dtype), self.values], 2)  # type: ignore[list-item]
                whole += 1
            self.middle = self.middle.drop_blocks(whole)
        exact = max(count - middle, 0)
        self.keys = self.keys[:, :, exact:].clone()  # type: ignore[index]
        self.values = self.values[:, :, exact:].clone()  # type: ignore[index]
        self.positions = self.positions[:, count:].clone()  # type: ignore[index]
        self.score = self.score[:, count:].clone()  # type: ignore[index]
        self.queries = self.query_slots = None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` of the tokens (probe queries live only within a step)."""
        for name in ("keys", "values", "positions", "score"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, rows.to(value.device)))
        if self.middle is not None:
            self.middle = self.middle.select_rows(rows)

    def tensors(self) -> list[torch.Tensor]:
        """The tokens' tensors (for byte accounting)."""
        tensors = [t for t in (self.keys, self.values, self.positions, self.score) if t is not None]
        return tensors + (self.middle.tensors() if self.middle is not None else [])

    def query_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.queries, self.query_slots) if t is not None]


class WeaveGroup(Stateful):
    """The layers sharing one token-side base: their recent buffers and one :class:`RowStore` per batch row
    (ranks are per row).

    Formed once by ``DepthWeave.bind_layers`` (into ``cache.context.groups``); every member holds a reference to
    it. Saved: the members (as references to the cache's layers), the buffers and the stores; a loaded group
    points its members at itself again (:meth:`after_load`).
    """

    state_name = "depthweave.WeaveGroup"

    state_fields = ("layers", "index", "recent", "rows")

    def __init__(self, layers: list[DepthWeaveLayer], index: int) -> None:
        self.layers = list(layers)
        self.index = index
        self.recent = {layer.layer_idx: RecentBuffer() for layer in self.layers}  # by member layer index
        self.rows: list[RowStore | None] = []
        self._bind()

    fold_generation = 0  # folds so far in this process (with the tokens seen, ``recent_target``'s cache key)
    _window: tuple[tuple[int, int], int] | None = None

    def after_load(self) -> None:
        self._bind()

    def _bind(self) -> None:
        """What follows from the members: their indices, the method and cache; each member points here."""
        self.members = [layer.layer_idx for layer in self.layers]
        self.method = self.layers[0].method
        self.cache = self.layers[0].cache
        for layer in self.layers:
            layer.group = self

    def reset_member(self, layer_idx: int) -> None:
        """Member ``layer_idx`` was reset: its recent buffer starts empty, and so do the row stores."""
        self.recent[layer_idx] = RecentBuffer()
        self.rows = []

    def fold_count(self, layer_idx: int, first: int, seen: int) -> int:
        """Tokens to fold this step: at prefill all but ``recent``, later whole multiples of ``block`` beyond
        :meth:`recent_target`."""
        if first == 0:
            return max(self.recent[layer_idx].count() - self.method.recent, 0)
        extra = self.recent[layer_idx].count() - self.recent_target(seen)
        return extra if extra >= self.method.block else 0

    def recent_target(self, seen: int) -> int:
        """Exact newest tokens kept while decoding after ``seen`` tokens: ``recent``, or up to ``recent_share`` of
        the byte budget once that is more (a long generation's next-token loss rests on its newest tokens), but
        never more than the budget has spare beside what the row stores hold. Computed once per step from the
        tokens seen and the stores (which change only at folds), so every member folds the same tokens; derived
        from saved state only, so a loaded cache folds where the saved one would have."""
        method = self.method
        if method.recent_share <= 0 or method.compression is None or not self.rows:
            return method.recent
        key = (self.fold_generation, seen)
        if self._window is not None and self._window[0] == key:
            return self._window[1]
        token_16bit = self.token_bytes()[0]
        spare = min(
            seen * token_16bit / method.compression
            - sum(held for held, _ in store.part_bytes(self.members).values())
            for store in self.rows
            if store is not None
        )
        # the buffer refills by ``block`` before a fold: budget for its mean fill, as the folds do
        window = min(self.wanted_window(seen), self.window_tokens(spare) - method.block // 2)
        tp = getattr(self.cache, "tp", None)
        if (
            tp is not None
        ):  # every rank folds the same tokens (the fold all-reduces over them): the least window
            window = -int(tp.all_reduce(torch.tensor([-window], dtype=torch.int64), "max").item())
        self._window = (key, max(method.recent, window))
        return self._window[1]

    def wanted_window(self, seen: int) -> int:
        """``recent_share`` of the byte budget the tokens after the prompt brought (``seen`` tokens now), in exact
        newest tokens; decode folds leave this much of the budget to the recent buffer. The prompt's budget is
        the prompt's, so a short answer (fewer than ``recent x compression / recent_share`` tokens) folds as
        with ``recent`` alone."""
        method = self.method
        if method.recent_share <= 0 or method.compression is None:
            return 0
        stores = [store for store in self.rows if store is not None]
        prompt = max((int(store.log.get("prompt_seen", 0)) for store in stores), default=0)
        budget = method.recent_share * max(seen - prompt, 0) * self.token_bytes()[0] / method.compression
        return self.window_tokens(budget)

    def token_bytes(self) -> tuple[int, int]:
        """Bytes of one token over the group: in a 16-bit full cache, and in the recent buffer (its keys and
        values in the storage dtype, a position and a score)."""
        buffer = self.recent[self.members[-1]]
        assert buffer.keys is not None
        heads, dim, element = buffer.keys.shape[1], buffer.keys.shape[3], buffer.keys.element_size()
        return len(self.members) * 2 * heads * dim * 2, len(self.members) * (2 * heads * dim * element + 8)

    def middle_bytes(self) -> float:
        """Bytes of one token over the group in the middle tier (``middle_bits``; with its position and score),
        or as an exact token when there is none."""
        bits = self.method.middle_bits
        if bits == 0:
            return float(self.token_bytes()[1])
        keys = self.recent[self.members[-1]].keys
        assert keys is not None
        return len(self.members) * (middle_token_bytes(int(keys.shape[1]), int(keys.shape[3]), bits) + 8)

    def exact_head(self) -> int:
        """Newest tokens of a buffer with a middle tier priced as exact: ``recent``, and half a block on average
        (tokens move to the middle in whole blocks, so the exact part holds ``recent`` to ``recent + block - 1``)."""
        return self.method.recent + MIDDLE_BLOCK // 2

    def window_tokens(self, spent: float) -> int:
        """Newest tokens the recent buffer holds for ``spent`` bytes: the first :meth:`exact_head` exact, the rest
        at the middle tier's price (:meth:`window_bytes` inverted)."""
        exact = self.token_bytes()[1]
        head = self.exact_head() * exact
        if spent <= head or self.method.middle_bits == 0:
            return int(spent // exact)
        return self.exact_head() + int((spent - head) // self.middle_bytes())

    def window_bytes(self, tokens: int) -> float:
        """Bytes of a recent buffer of ``tokens`` newest tokens (see :meth:`window_tokens`)."""
        exact = self.token_bytes()[1]
        if self.method.middle_bits == 0:
            return tokens * exact
        head = min(tokens, self.exact_head())
        return head * exact + (tokens - head) * self.middle_bytes()

    def middle_active(self, seen: int) -> bool:
        """Whether the buffer holds a middle tier after ``seen`` tokens: ``middle_bits`` and a window past
        ``recent`` (the window is priced as exact up to :meth:`exact_head`, so it passes ``recent`` at the same
        step with the tier as without it)."""
        method = self.method
        return method.middle_bits > 0 and bool(self.rows) and self.recent_target(seen) > method.recent

    def settle(self, seen: int) -> None:
        """After a decode step (every member has stored it): with ``middle_bits``, once the budget keeps more than
        ``recent`` tokens unfolded, each member's exact tokens beyond the newest ``recent`` move to the middle
        tier in whole blocks. Below that (short answers) the buffer stays as exact as without the tier."""
        if not self.middle_active(seen):
            return
        method = self.method
        for layer_idx in self.members:
            self.recent[layer_idx].settle(method.recent, method.middle_bits)

    def fold(self, owner: DepthWeaveLayer, count: int, first: int) -> None:
        """Move the oldest ``count`` tokens of every member's buffer into the row stores.

        Called by ``owner``, the last member, once it has stored this step (so has every member): its tokens
        seen, batch rows and padding are the group's.
        """
        buffers = [self.recent[i] for i in self.members]
        newest = buffers[-1]
        rows = owner.rows
        if not self.rows:
            self.rows = [None] * rows
        start = owner.seen - newest.count()
        slots = torch.arange(start, start + count, device=owner.device)
        positions = newest.positions[:, :count].long()  # type: ignore[index]
        oldest = [buffer.oldest(count) for buffer in buffers]
        keys, values = [k for k, _ in oldest], [v for _, v in oldest]
        rotary = self.cache.rotary_for(self.members[0]) if self.method.keys == "pre_rope" else None
        factor_keys = [rotary.unrotate(k.float(), positions) if rotary else k.float() for k in keys]
        scores = [buffer.score[:, :count] for buffer in buffers]  # type: ignore[index]
        attention = torch.stack(scores).mean(0)
        tp = getattr(self.cache, "tp", None)
        # all-reduced under tensor parallelism: each rank's mean over its heads -> the mean over all heads
        if tp is not None:
            attention = tp.all_reduce(attention, "mean")
        context = self.cache.context
        content = content_scores(context.prompt_ids, context.tokenizer, slots, rows) if first == 0 else None
        retrievable = None
        if first == 0 and self.method.protect > 0:
            retrievable = retrievable_scores(
                context.prompt_ids,
                context.tokenizer,
                slots,
                rows,
                self.method.protect_names,
                self.method.protect_records,
            )
        pad_count: torch.Tensor = owner.pad_count  # type: ignore[assignment]
        padding = slots.view(1, -1) < pad_count.view(-1, 1)
        heads, dim = keys[0].shape[1], keys[0].shape[3]
        per_token_16bit = len(buffers) * 2 * heads * dim * 2  # a 16-bit full cache of this group, per token
        # the recent buffer after this fold; while decoding it refills to ``recent + block`` before the next one,
        # so decode folds budget for its mean fill (the held bytes then average ``compression`` over a fold)
        kept_recent = newest.count() - count
        if first > 0:  # and the share of the budget the buffer may grow into (``recent_share``)
            kept_recent = max(kept_recent, self.wanted_window(owner.seen)) + self.method.block // 2
        if first > 0 and self.middle_active(owner.seen):
            recent_bytes = int(self.window_bytes(kept_recent))
        else:  # an all-exact buffer (its tokens move to the middle only once the window passes ``recent``)
            recent_bytes = kept_recent * self.token_bytes()[1]
        for b in range(rows):
            real = (~padding[b]).nonzero().squeeze(1)
            if real.numel() == 0:
                continue
            chunk = Chunk(
                slots=slots[real],
                positions=positions[b, real],
                x_k=torch.cat([k[b][:, real].transpose(0, 1).flatten(1) for k in factor_keys], dim=1),
                x_v=torch.cat([v[b][:, real].transpose(0, 1).flatten(1).float() for v in values], dim=1),
                keys=[k[b][:, real] for k in keys],
                values=[v[b][:, real] for v in values],
                attention=attention[b, real],
                content=None if content is None else content[b, real],
                sink=(slots[real] - pad_count[b]) < self.method.sinks if first == 0 else None,
                retrievable=None if retrievable is None else retrievable[b, real],
                tp=tp,
            )
            probe = None
            if all(buffer.queries is not None for buffer in buffers):
                probe = Probe(
                    [buffer.queries[b].float() for buffer in buffers],  # type: ignore[index]
                    buffers[0].query_slots,  # type: ignore[arg-type]
                    chunk,
                    [buffer.scaling for buffer in buffers],
                )
            store = self.rows[b]
            if store is None:
                dtype = self.method.storage_dtype(owner.dtype)
                store = self.rows[b] = RowStore(self.method, self.members, heads, dim, dtype)
            # the budget counts the row's own tokens, so a padded row compresses as it would alone
            real_tokens = owner.seen - int(pad_count[b])
            budget = Budget(per_token_16bit * real_tokens, recent_bytes)
            add_chunk(store, chunk, probe, rotary, budget)
            if first == 0:  # where the prompt ended (``wanted_window``: the generated tokens' budget)
                store.log["prompt_seen"] = owner.seen
        for buffer in buffers:
            buffer.drop(count)
        self.fold_generation += 1
        if first == 0 and self.index == 0:
            self.warn_if_short_of_target(owner.seen)

    def warn_if_short_of_target(self, tokens: int) -> None:
        """Say so when the prompt is too short for ``compression`` (its recent buffer, sinks and page summaries
        are held whatever the budget): once per target and prompt length (to 256 tokens), for group 0."""
        target = self.method.compression
        if self.method.target_error is not None or not target or not self.method.probes:
            return  # an error target, or a fixed rank (probes off): no byte target to fall short of
        reached = self.summary().get("group_compression")
        key = (target, tokens // 256)
        if reached is None or reached >= 0.9 * target or key in _WARNED:
            return
        _WARNED.add(key)
        warnings.warn(
            f"depthweave: compression={target:g} reached {reached:.2f}x on this {tokens}-token prompt (layer "
            f"group 0): the {self.method.recent} newest tokens, {self.method.sinks} sinks and the page summaries "
            "are held whatever the budget; longer prompts come closer, or lower recent= / decode_tokens=",
            stacklevel=2,
        )

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the row stores of batch rows ``rows`` (each member selects its own buffer's rows)."""
        if not self.rows:
            return
        picked, seen = [], set()
        for index in rows.tolist():
            store = self.rows[index]
            picked.append(copy.deepcopy(store) if index in seen else store)
            seen.add(index)
        self.rows = picked

    def summary(self) -> dict[str, Any]:
        """Ranks, probe errors, token kinds and bytes by part, summed over rows (ranks/errors: mean)."""
        stores = [s for s in self.rows if s is not None]
        if not stores:
            return {"compressed": False}
        parts = {
            "coordinates": 0,
            "coefficients": 0,
            "exact_rows": 0,
            "indices": 0,
            "page_bounds": 0,
            "recent": 0,
        }
        parts_16bit = dict(parts)
        for store in stores:
            for key, (held, unquantized) in store.part_bytes(self.members).items():
                parts[key] += held
                parts_16bit[key] += unquantized
        for buffer in self.recent.values():
            recent = tensors_nbytes(buffer.tensors())
            parts["recent"] += recent
            parts_16bit["recent"] += recent
        owner = self.layers[-1]
        shape = self.recent[owner.layer_idx].keys.shape  # type: ignore[union-attr]
        full = (
            2 * owner.rows * shape[1] * shape[3] * 2 * owner.seen * len(self.layers)
        )  # 16-bit full, [B, H, m, D]
        held, unquantized = sum(parts.values()), sum(parts_16bit.values())
        tokens: dict[str, int] = {}
        for store in stores:
            for key, value in store.token_counts.items():
                tokens[key] = tokens.get(key, 0) + value

        def mean(key: str) -> float | None:
            values = [s.log[key] for s in stores if s.log.get(key) is not None]
            return sum(values) / len(values) if values else None

        return {
            "compressed": True,
            "rank_k": mean("rank_k"),
            "rank_v": mean("rank_v"),
            "basis_k": mean("basis_k"),
            "basis_v": mean("basis_v"),
            "probe_error": mean("probe_error"),
            "probe_error_k": mean("probe_error_k"),
            "probe_error_v": mean("probe_error_v"),
            "last_fold_error": mean("last_fold_error"),
            "folds": mean("folds"),
            "refreshes": mean("refreshes"),
            "tokens": tokens,
            "group_bytes": held,
            "group_bytes_unquantized": unquantized,
            "bytes_by_part": parts,
            "group_full_16bit": full,
            "group_compression": full / held if held else None,
            "group_compression_unquantized": full / unquantized if unquantized else None,
        }
