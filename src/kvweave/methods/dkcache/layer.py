"""DK-Cache's cache layer: the core / steady / far tiers of one decoder layer, the attention step over them
(prefill, and the decode paths the ``path`` option chooses) and the moves between the tiers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvweave._compat import mask_to_bool
from kvweave.cache import CompressedLayer, StepPositions
from kvweave.kernels import cpu_int8
from kvweave.kernels.cpu_int8 import HeldRows
from kvweave.kernels.registry import choose
from kvweave.methods.dkcache.attention import (
    CHUNK_ELEMENTS,
    ScoredPart,
    attend_parts,
    chunked_remapped_prefill,
    compensated_parts,
    concatenated_attention,
    decoupling_bias,
    flash_remapped_prefill,
    prefill_visible,
    remapped_attention,
)
from kvweave.methods.dkcache.far import PAGE_SCORES, FarTier, Part, far_device
from kvweave.methods.dkcache.holding import KeyHolding
from kvweave.methods.dkcache.positions import group_size, grouped_query, is_near
from kvweave.methods.dkcache.stats import LayerStatsMixin
from kvweave.methods.dkcache.tiers import Tier, decouple_keys
from kvweave.ops.rope import RopeTable

if TYPE_CHECKING:
    from kvweave.cache import KVCache
    from kvweave.methods.dkcache import DKCache


class DKCacheLayer(LayerStatsMixin, CompressedLayer):
    """Core / steady / far tiers of one decoder layer (see the package docstring).

    Saved in a cache file: the tiers, how keys are held, the running decoupling sum, the ``attended`` budget and
    the step statistics. Built from the cache and the method: the RoPE table, the trained length, α, and the tier
    bounds (from the options, or from the saved ``attended`` budget)."""

    # per-row tensors of the layer itself (the tiers and the far store select their own rows)
    batch_fields = (
        "steady_sum",
        "steady_count",
        "last_entropy",
        "last_attended",
        "pages_last",
        "pages_total",
        "pad_count",
    )
    state_fields = CompressedLayer.state_fields + (
        "attended_budget",
        "position_limit",
        "rotated",
        "aligned",
        "held_group",
        "core_tier",
        "steady_tier",
        "far",
        "steady_sum",
        "steady_count",
        "groups",
        "last_entropy",
        "last_attended",
        "pages_last",
        "pages_total",
        "decode_steps",
        "retrieval_steps",
    )

    def __init__(
        self, cache: KVCache, layer_idx: int, method: DKCache, chunk_elements: int = CHUNK_ELEMENTS
    ) -> None:
        super().__init__(cache, layer_idx)
        self.method = method
        # elements of one block of work: prefill logits on the chunked path, far keys re-rotated or summarised
        self.chunk_elements = chunk_elements
        self.trained = method.trained_length or int(cache.config.max_position_embeddings)
        self.attended_budget: int | None = (
            None  # with ``attended``: the tokens core + steady hold, set at prefill
        )
        self.core_size, self.steady_bound = self._bounds()
        self.alpha = method.effective_alpha if method.decouple else 0.0
        self.pre_rope = method.key_storage == "pre_rope"
        self.position_limit = 0  # largest position held + 1 (the RoPE table covers it)
        self.table: RopeTable | None = cache.context.rope_table(layer_idx) if self.pre_rope else None
        self.holding = KeyHolding(self.table)  # post-RoPE, pre-RoPE or grouped: the one place that says which
        self.pad: list[int] = []
        self.core_tier = Tier(quantized=False)
        self.steady_tier = Tier(quantized=method.bits == 8)
        self.far: FarTier | None = None
        self.steady_sum: torch.Tensor | None = None  # [B, H, 1, D] float64, running sum of real steady keys
        self.steady_count: torch.Tensor | None = None  # [B] float64
        self.groups: list[int] = []  # Self-Extend group per row at the last step
        self.last_entropy: torch.Tensor | None = None  # [B] normalised attention entropy of the last step
        self.last_attended: torch.Tensor | None = (
            None  # [B] entries the last query attended (mean over heads)
        )
        self.pages_last: torch.Tensor | None = None  # [B, H] far pages retrieved at the last step
        self.pages_total: torch.Tensor | None = None  # [B, H] summed over decode steps
        self.decode_steps = 0
        self.retrieval_steps = 0
        self.scores_kernel: str | None = None  # where the far pages were last scored (torch or triton)

    def reset(self) -> None:
        self.__init__(self.cache, self.layer_idx, self.method, self.chunk_elements)  # type: ignore[misc]

    def after_load(self) -> None:
        """Rebuild what the saved fields determine: the tier bounds and the per-row padding (host ints)."""
        self.core_size, self.steady_bound = self._bounds()
        self.pad = [] if self.pad_count is None else [int(p) for p in self.pad_count.tolist()]

    def _bounds(self) -> tuple[int, int]:
        """``(core, steady)`` in tokens: the method's, or with ``attended`` the prompt's budget split like them."""
        core, steady = self.method.bounds(self.trained)
        budget = self.attended_budget
        if budget is None:
            return core, steady
        return min(budget, max(1, round(budget * core / steady))), budget

    # -- positions
    def _group_sizes(self, step: StepPositions) -> list[int]:
        if not self.method.remaps_positions:
            return [1] * self.rows
        return [group_size(length, self.core_size, self.trained) for length in step.row_lengths]

    # -- how keys are held (saved as three fields of the layer, so cache files read as before)
    @property
    def rotated(self) -> bool:
        return self.holding.rotated

    @rotated.setter
    def rotated(self, value: bool) -> None:
        self.holding.rotated = bool(value)

    @property
    def aligned(self) -> bool:
        return self.holding.aligned

    @aligned.setter
    def aligned(self, value: bool) -> None:
        self.holding.aligned = bool(value)

    @property
    def held_group(self) -> int | None:
        return self.holding.group

    @held_group.setter
    def held_group(self, value: int | None) -> None:
        self.holding.group = None if value is None else int(value)

    def _grouped_query(
        self, query: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor
    ) -> torch.Tensor:
        assert self.table is not None
        return grouped_query(self.table, query, positions, groups, self.core_size)

    # -- the attention step
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Store the new tokens in the core, attend (exact at prefill, over the tiers when decoding), re-tier.

        ``query: [B, Hq, q, D]``, ``key, value: [B, H, q, D]`` (post-RoPE) -> ``[B, q, Hq, D]``.
        """
        q_len, first = key.shape[2], self.seen
        step = self.cache.context.step_positions(
            kwargs.get("position_ids"), first, q_len, self.rows, key.device
        )
        if first == 0:
            self._start(attention_mask, q_len)
        self.groups = self._group_sizes(step)
        grouped = max(self.groups) > 1
        groups = torch.tensor(self.groups, device=key.device) if grouped else None
        scaling = kwargs.get("scaling") or key.shape[-1] ** -0.5
        if self.table is not None:
            self.position_limit = max(self.position_limit, *step.row_lengths)
            self.table.ensure(self.position_limit, key.device)
        holding = self.holding
        if first == 0:
            holding.start(grouped, self.method.hold_rotated, padded=max(self.pad) > 0)
        elif grouped and holding.as_seen and self.table is not None:
            holding.unrotate_held(
                [self.core_tier, self.steady_tier], self.far, self.device, self.chunk_elements
            )
        holding.aligned = holding.aligned and step.aligned
        stored = holding.store(key, step.positions)
        self.seen += q_len
        self.core_tier.append(stored, value, step.positions, self.store_dtype)
        fast = self.method.path == "fast"
        if first == 0:
            out = self._prefill_attention(
                module, query, key, value, stored, attention_mask, step, groups, scaling, kwargs
            )
        elif fast and groups is None and holding.as_seen:
            out = self._exact_attention(query, attention_mask, scaling, first, q_len)
        elif (
            fast
            and groups is not None
            and holding.aligned
            and len(set(self.groups)) == 1
            and first >= self.trained
            and self.table is not None
        ):
            out = self._compensated_attention(query, attention_mask, step, groups, scaling, first, q_len)
        else:
            if holding.group is not None:
                holding.hold_grouped(None, self.steady_tier, self.far, self.device, self.chunk_elements)
            out = self._tiered_attention(query, attention_mask, step, groups, scaling, first, q_len)
        self._retier()
        return out

    def _start(self, attention_mask: torch.Tensor | None, q_len: int) -> None:
        """Prefill: left padding per row and, with ``attended``, the tier bounds from the prompt length."""
        mask = mask_to_bool(attention_mask)
        self.pad = [0] * self.rows if mask is None else (~mask[:, 0, -1, :q_len]).sum(-1).tolist()
        self.pad_count = torch.tensor(self.pad, device=self.device)
        if self.method.attended is not None:  # one set of bounds for the batch: from its longest row
            self.attended_budget = max(
                1, int(self.method.attended * (q_len - min(self.pad))) - self.method.sinks
            )
            self.core_size, self.steady_bound = self._bounds()

    def _prefill_attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        stored: torch.Tensor,
        attention_mask: torch.Tensor | None,
        step: StepPositions,
        groups: torch.Tensor | None,
        scaling: float,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Exact attention over the prompt; beyond the trained range at compensated positions (the fused
        prefill with ``path="fast"`` on an unpadded prompt, else in query chunks)."""
        b, hq, n, _ = query.shape
        if groups is None:
            out = self.prompt_attention(module, query, key, value, attention_mask, **kwargs)
            if self.method.retrieve == "entropy":  # the first decode step reads the prompt's last query
                last = prefill_visible(attention_mask, self.rows, n, n - 1, n, self.device)
                _, self.last_entropy = remapped_attention(
                    query[:, :, -1:], None, key, None, value, last, None, scaling
                )
            return out
        assert self.table is not None
        positions = step.positions
        slots = torch.arange(positions.shape[1], device=self.device).view(1, -1)
        pad = self.pad_count.view(-1, 1)  # type: ignore[union-attr]
        contiguous = bool(((positions == slots - pad) | (slots < pad)).all())  # real tokens at slot - pad
        key_grouped = self.table.rotate(stored, positions // groups.view(-1, 1))
        query_grouped = self._grouped_query(query, positions, groups)
        if self.method.path == "fast" and contiguous and max(self.pad) == 0:
            fast = flash_remapped_prefill(
                query,
                query_grouped,
                key,
                key_grouped,
                value,
                self.core_size,
                self.trained,
                scaling,
                self.method.flash_chunk,
            )
            if fast is not None:
                last = prefill_visible(attention_mask, self.rows, n, n - 1, n, self.device)
                near = is_near(
                    positions[:, -1:].unsqueeze(-1), positions.unsqueeze(1), self.core_size, self.trained
                ).unsqueeze(1)
                _, self.last_entropy = remapped_attention(
                    query[:, :, -1:], query_grouped[:, :, -1:], key, key_grouped, value, last, near, scaling
                )
                return fast
        out, self.last_entropy = chunked_remapped_prefill(
            query,
            query_grouped,
            key,
            key_grouped,
            value,
            positions,
            attention_mask,
            self.core_size,
            self.trained,
            scaling,
            contiguous,
            self.chunk_elements,
        )
        return out

    def _tiered_attention(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        step: StepPositions,
        groups: torch.Tensor | None,
        scaling: float,
        first: int,
        q_len: int,
    ) -> torch.Tensor:
        """Decode: attention over sinks + retrieved far pages + steady (decoupled) + core (incl. the new tokens)."""
        dtype = query.dtype
        query_grouped = self._grouped_query(query, step.positions, groups) if groups is not None else None
        parts: list[Part] = []
        for tier, decoupled in ((self.steady_tier, self.alpha > 0), (self.core_tier, False)):
            if len(tier):
                keys, values, positions = tier.read(dtype)
                mean = self.steady_mean() if decoupled else None
                if mean is not None and self.holding.as_seen and self.table is not None:
                    # R(p)(k - a m) = R(p)k - a R(p)m
                    keys = keys - self.alpha * self.table.rotate(
                        mean.to(keys.dtype).expand_as(keys), positions
                    )
                elif mean is not None:
                    keys = decouple_keys(keys, mean, self.alpha)
                slots = torch.arange(tier.first_slot, tier.first_slot + len(tier), device=self.device)
                parts.append(
                    (keys, values, positions.unsqueeze(1), slots.view(1, 1, -1).expand(self.rows, 1, -1))
                )
        valid: list[torch.Tensor] = [
            torch.ones(self.rows, 1, p[0].shape[2], dtype=torch.bool, device=self.device) for p in parts
        ]
        if self.far is not None:
            for part, ok in self._far_parts(query if query_grouped is None else query_grouped, dtype):
                parts.insert(0, part)
                valid.insert(0, ok)
        rotated = [self.holding.as_attention(p[0], p[2], groups) for p in parts]  # cos/sin shared by heads
        out, self.last_entropy, self.last_attended = concatenated_attention(
            query,
            query_grouped,
            parts,
            rotated,
            valid,
            step.positions,
            attention_mask,
            self.core_size,
            self.trained,
            scaling,
            first,
        )
        self.decode_steps += 1
        return out

    def _compensated_attention(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        step: StepPositions,
        groups: torch.Tensor,
        scaling: float,
        first: int,
        q_len: int,
    ) -> torch.Tensor:
        """Decode beyond the trained range, every position its slot: steady and far keys held at grouped
        positions (:meth:`KeyHolding.hold_grouped`), attention per tier (:func:`compensated_parts`)."""
        assert self.table is not None
        group = self.groups[0]
        self.holding.hold_grouped(group, self.steady_tier, self.far, self.device, self.chunk_elements)
        query_grouped = grouped_query(self.table, query, step.positions, groups, self.core_size)
        far = [] if self.far is None else self._far_parts(query_grouped, query.dtype, False)
        mean = self.steady_mean() if self.alpha > 0 else None
        parts = compensated_parts(
            query,
            query_grouped,
            far,
            [(self.steady_tier, mean), (self.core_tier, None)],
            self.alpha,
            self.table,
            group,
            self.core_size,
            first,
            q_len,
            self.rows,
        )
        return self._attend_parts(parts, query, attention_mask, scaling, first, q_len)

    def _exact_attention(
        self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float, first: int, q_len: int
    ) -> torch.Tensor:
        """Decode at exact positions with keys held as attention sees them: the same attention as
        :meth:`_tiered_attention` (sinks + retrieved pages + decoupled steady + core), computed as logits per
        tier and one softmax over their concatenation, so no key or value is copied, concatenated or rotated.
        The steady tier's decoupling enters as a logit bias."""
        dtype = query.dtype
        b, hq, n, d = query.shape
        parts: list[
            tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
        ] = []
        if self.far is not None:  # keys, values, slots, validity, bias
            parts += [(p[0], p[1], p[3], ok, None) for p, ok in self._far_parts(query, dtype, False)]
        kernel = self.method.kernel in (
            "auto",
            "cpp",
        )  # the C++ kernel may read the INT8 and 16-bit tiers (CPU only)
        if self.method.kernel == "cpp" and cpu_int8.load() is None:
            raise RuntimeError(
                f"dkcache: kernel=cpp, but the C++ INT8 kernel is not available: "
                f"{cpu_int8.unavailable_reason()}; use kernel=auto or kernel=torch"
            )
        for tier, decoupled in ((self.steady_tier, self.alpha > 0), (self.core_tier, False)):
            if len(tier):
                keys, values, positions = tier.read_rows(dtype, kernel)
                slots = torch.arange(tier.first_slot, tier.first_slot + len(tier), device=self.device)
                mean = self.steady_mean() if decoupled else None
                bias = (
                    None
                    if mean is None
                    else decoupling_bias(
                        query, mean, self.alpha, self.table, positions, tier.first_slot, self.holding.aligned
                    )
                )
                parts.append((keys, values, slots.view(1, 1, -1).expand(self.rows, 1, -1), None, bias))
        h = parts[-1][0].shape[1]
        q = query.reshape(b, h, hq // h * n, d)
        scored: list[ScoredPart] = []
        for keys, values, slots, ok, bias in parts:
            logits = keys.logits(q) if isinstance(keys, HeldRows) else q @ keys.to(q.dtype).transpose(-1, -2)
            scored.append((logits if bias is None else logits + bias, values, slots, ok))
        return self._attend_parts(scored, query, attention_mask, scaling, first, q_len)

    def _attend_parts(
        self,
        parts: list[ScoredPart],
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        first: int,
        q_len: int,
    ) -> torch.Tensor:
        kernel = self.method.kernel in ("auto", "cpp") and cpu_int8.load() is not None
        out, self.last_entropy, self.last_attended = attend_parts(
            parts, query.shape, attention_mask, scaling, first, q_len, query.dtype, kernel
        )
        self.decode_steps += 1
        return out

    # -- the far tier in attention
    def _far_parts(
        self, query: torch.Tensor, dtype: torch.dtype, with_positions: bool = True
    ) -> list[tuple[Part, torch.Tensor]]:
        """Sinks and the retrieved far pages as attention parts (keys, values, positions, slots) + validity."""
        assert self.far is not None
        parts = list[tuple[Part, torch.Tensor]]()
        sinks = self.far.sink_part(dtype, self.device, self.pad_count)
        if sinks is not None:
            parts.append(sinks)
        self.pages_last = None
        if self.far.keep_pages and self.far.page_count():
            retrieved = self._retrieve(query, dtype, with_positions)
            if retrieved is not None:
                parts.append(retrieved)
        return parts

    def _retrieve(
        self, query: torch.Tensor, dtype: torch.dtype, with_positions: bool = True
    ) -> tuple[Part, torch.Tensor] | None:
        """The top ``pages`` far pages per (row, KV head) by the upper bound of ``q·k`` (their positions only
        ``with_positions``: the paths that hold keys as attention sees them do not read them)."""
        assert self.far is not None
        rows_on = torch.ones(self.rows, dtype=torch.bool, device=self.device)
        if self.method.retrieve == "entropy" and self.last_entropy is not None:
            entropy = self.last_entropy  # [B], mean over this cache's heads
            # all-reduced under tensor parallelism: every rank gates on the mean over all heads, as one process
            tp = getattr(self.cache, "tp", None)
            if tp is not None:
                entropy = tp.all_reduce(entropy, "mean")
            rows_on = entropy > self.method.entropy_threshold
            if not bool(rows_on.any()):
                return None
        self._refresh_summaries(dtype)
        part, ok, chosen = self.far.retrieve(
            query,
            dtype,
            self.device,
            self.method.pages,
            rows_on,
            self.pad_count,
            with_positions,
            self._scores_on(),
        )
        self.pages_last = chosen.sum(-1)
        self.pages_total = self.pages_last if self.pages_total is None else self.pages_total + self.pages_last
        self.retrieval_steps += 1
        return part, ok

    def _scores_on(self) -> str:
        """Where the far pages are scored: Triton on CUDA (``kernel=auto`` or ``triton``), else torch."""
        choice = self.method.kernel if self.method.kernel in ("auto", "triton") else "torch"
        self.scores_kernel = choose(PAGE_SCORES, choice, self.device)
        return self.scores_kernel

    def _refresh_summaries(self, dtype: torch.dtype) -> None:
        """Bring the far pages' min/max summaries up to date with how attention sees the keys this step."""
        assert self.far is not None
        table = self.table if self.holding.pre_rope_held else None
        self.far.refresh_summaries(dtype, self.device, self.groups, table, self.chunk_elements)

    # -- moving tokens between tiers
    def _retier(self) -> None:
        """core -> steady -> far, by recency (token index), the same boundaries for every row."""
        dtype = self.dtype
        overflow = len(self.core_tier) - self.core_size
        if overflow > 0:
            slot = self.core_tier.first_slot
            keys, values, positions = self.core_tier.pop_front(overflow, dtype)
            keys = self.holding.into_steady(keys, positions)
            self.steady_tier.first_slot = slot if not len(self.steady_tier) else self.steady_tier.first_slot
            stored = self.steady_tier.append(keys, values, positions, self.store_dtype)
            self._update_mean(stored, positions, slot, +1)
        overflow = len(self.steady_tier) - (self.steady_bound - self.core_size)
        if overflow > 0:
            slot = self.steady_tier.first_slot
            keys, values, positions = self.steady_tier.pop_front(overflow, dtype)
            self._update_mean(keys, positions, slot, -1)
            if self.far is None:
                self.far = FarTier(
                    self.method.sinks,
                    self.method.page,
                    quantized=self.method.bits == 8 or self.method.far_dtype == "int8",
                    keep_pages=self.method.retrieve != "never",
                    device=far_device(self.device, self.method.offload),
                )
            self.far.add(keys, values, positions, slot, self.pad, self.store_dtype)
        if not len(self.steady_tier):
            self.steady_tier.first_slot = self.core_tier.first_slot
        self.core_tier.fit()
        self.steady_tier.fit()

    def _update_mean(self, keys: torch.Tensor, positions: torch.Tensor, first_slot: int, sign: int) -> None:
        """Running sum / count of the steady tier's real keys (padding excluded), per (row, head); pre-RoPE with
        ``key_storage="pre_rope"`` (held keys are de-rotated for it while they are held post-RoPE)."""
        if self.alpha <= 0:
            return
        keys = self.holding.pre_rope(keys, positions)
        slots = torch.arange(first_slot, first_slot + keys.shape[2], device=self.device).view(1, -1)
        real = (slots >= self.pad_count.view(-1, 1)).double()  # type: ignore[union-attr]
        total = (keys.double() * real.view(real.shape[0], 1, -1, 1)).sum(2, keepdim=True)
        if self.steady_sum is None or self.steady_count is None:
            self.steady_sum, self.steady_count = torch.zeros_like(total), torch.zeros_like(real[:, 0])
        self.steady_sum += sign * total
        self.steady_count += sign * real.sum(-1)

    def steady_mean(self) -> torch.Tensor | None:
        """``[B, H, 1, D]`` the decoupling mean in use (pre-RoPE with pre_rope storage, else post-RoPE), ``None``
        before the tier fills."""
        if self.steady_sum is None or self.steady_count is None:
            return None
        return self.steady_sum / self.steady_count.clamp(min=1).view(-1, 1, 1, 1)

    # -- batch (bytes and stats: LayerStatsMixin, stats.py)
    def select_rows(self, rows: torch.Tensor) -> None:
        order = rows.tolist()
        for tier in (self.core_tier, self.steady_tier):
            tier.select_rows(rows)
        if self.far is not None:
            self.far.select_rows(rows)
        self.pad = [self.pad[i] for i in order] if self.pad else []
        self.groups = [self.groups[i] for i in order] if self.groups else []
        for name in self.batch_fields:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, rows.to(value.device)))
        self.rows = len(order)
