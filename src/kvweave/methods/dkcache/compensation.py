"""DK-Cache beyond the trained range (RoPE angle compensation, Self-Extend): the fast decode over keys held at
grouped positions, and re-holding keys when the context first outgrows the trained range or the group grows.

A mixin of :class:`~kvweave.methods.dkcache.layer.DKCacheLayer` (it uses the layer's tiers, RoPE table and
attention helpers); kept apart so the layer file holds the common path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvweave.cache import StepPositions
from kvweave.methods.dkcache.attention import ScoredPart, grouped_decoupling_bias
from kvweave.methods.dkcache.positions import is_near


class CompensationMixin:
    """Decode beyond the trained range and the key re-holding it needs (see the module docstring)."""

    table: Any
    held_group: int | None
    rotated: bool
    groups: list[int]
    core_size: int
    alpha: float
    rows: int
    device: torch.device
    chunk_elements: int
    core_tier: Any
    steady_tier: Any
    far: Any
    _grouped_query: Callable[..., torch.Tensor]
    _far_parts: Callable[..., Any]
    steady_mean: Callable[[], torch.Tensor | None]
    _attend_parts: Callable[..., torch.Tensor]

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
        """Decode beyond the trained range, every position its slot: the same attention as
        :meth:`_tiered_attention`, computed per tier. Steady and far keys are held rotated at their grouped
        positions ``p // G`` (re-rotated only when ``G`` grows), so they only meet the grouped query; every
        steady and far key is at least ``core`` tokens from the query (the core tier holds the newest ``core``),
        hence never a neighbour. The (small) core tier is rotated at exact and grouped positions each step and
        its neighbours take the exact logits. The steady decoupling enters as a logit bias at grouped positions."""
        table = self.table
        assert table is not None
        group = self.groups[0]
        if self.held_group != group:
            self._hold_grouped(group)
        dtype = query.dtype
        b, hq, n, d = query.shape
        query_grouped = self._grouped_query(query, step.positions, groups)
        h = self.core_tier.parts["keys"].view().shape[1]
        q, qg = query.reshape(b, h, hq // h * n, d), query_grouped.reshape(b, h, hq // h * n, d)
        parts: list[ScoredPart] = []
        if self.far is not None:
            for (keys, values, _, slots), ok in self._far_parts(query_grouped, dtype, False):
                parts.append((qg @ keys.to(qg.dtype).transpose(-1, -2), values, slots, ok))
        for tier in (self.steady_tier, self.core_tier):
            if not len(tier):
                continue
            keys, values, positions = tier.read(dtype)
            slots = torch.arange(tier.first_slot, tier.first_slot + len(tier), device=self.device)
            if tier is self.steady_tier:
                logits = qg @ keys.to(qg.dtype).transpose(-1, -2)
                mean = self.steady_mean() if self.alpha > 0 else None
                if mean is not None:
                    logits = logits + grouped_decoupling_bias(
                        query_grouped, mean, self.alpha, table, tier.first_slot, len(tier), group
                    )
            else:
                queries = torch.arange(first, first + q_len, device=self.device).view(-1, 1)
                near = is_near(queries, slots.view(1, -1), self.core_size)  # [n, T] (positions are slots)
                exact = q @ table.rotate(keys, positions).to(q.dtype).transpose(-1, -2)
                far_logits = qg @ table.rotate(keys, positions // group).to(qg.dtype).transpose(-1, -2)
                logits = torch.where(near.repeat(hq // h, 1), exact, far_logits)
            parts.append((logits, values, slots.view(1, 1, -1).expand(self.rows, 1, -1), None))
        return self._attend_parts(parts, query.shape, attention_mask, scaling, first, q_len)

    # -- how keys are held
    def _hold_grouped(self, group: int | None) -> None:
        """Re-rotate the steady and far keys (sinks and pages) from how they are held to positions ``p // group``
        (``None``: back to pre-RoPE, every tier then held as ``rotated`` says). Held keys must be pre-RoPE or
        grouped; one pass over them (INT8 entries are dequantized and requantized)."""
        table, old = self.table, self.held_group
        assert table is not None and not self.rotated
        if old == group:
            return

        def regroup(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            keys = keys if old is None else table.unrotate(keys, positions // old)
            return keys if group is None else table.rotate(keys, positions // group)

        self.steady_tier.map_keys(regroup)
        if self.far is not None:
            self.far.map_keys(regroup, self.device, self.chunk_elements)
            self.far.clean_pages = 0
        self.held_group = group

    def _unrotate_held(self) -> None:
        """The context just outgrew the trained range: from now on keys are held pre-RoPE, so they can be rotated
        at remapped positions. One pass over every held key (INT8 entries are dequantized and requantized); the
        decoupling mean is already pre-RoPE; far-page summaries are recomputed at the new positions."""
        table = self.table
        assert table is not None
        for tier in (self.core_tier, self.steady_tier):
            tier.map_keys(table.unrotate)
        if self.far is not None:
            self.far.map_keys(table.unrotate, self.device, self.chunk_elements)
            self.far.clean_pages = 0
        self.rotated = False
