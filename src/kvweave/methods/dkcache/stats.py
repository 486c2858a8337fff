"""DK-Cache's bytes and statistics per layer: what the tiers hold (``nbytes``), what one decode step reads
(``read_bytes``), the entries held and attended, and the numbers ``cache.stats()`` reports (``layer_stats``).

A mixin of :class:`~kvweave.methods.dkcache.layer.DKCacheLayer` (it reads the layer's tiers and step counters);
kept apart so the layer file holds the attention path."""

from __future__ import annotations

from typing import Any

import torch

from kvweave.cache import tensors_nbytes
from kvweave.methods.dkcache.far import FarTier
from kvweave.methods.dkcache.tiers import Tier


class LayerStatsMixin:
    """Byte counts and statistics of a DK-Cache layer (see the module docstring)."""

    core_tier: Tier
    steady_tier: Tier
    far: FarTier | None
    steady_sum: torch.Tensor | None
    steady_count: torch.Tensor | None
    last_entropy: torch.Tensor | None
    last_attended: torch.Tensor | None
    pages_last: torch.Tensor | None
    pages_total: torch.Tensor | None
    pad_count: torch.Tensor | None
    rows: int
    groups: list[int]
    core_size: int
    steady_bound: int
    decode_steps: int
    retrieval_steps: int

    def _tier_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "core": self.core_tier.tensors(),
            "steady": self.steady_tier.tensors(),
            "far": self.far.tensors() if self.far is not None else [],
            "other": [
                t
                for t in (
                    self.steady_sum,
                    self.steady_count,
                    self.last_entropy,
                    self.last_attended,
                    self.pages_last,
                    self.pages_total,
                    self.pad_count,
                )
                if t is not None
            ],
        }

    def read_bytes(self) -> int:
        """Bytes one decode step reads: the live core and steady entries, the far tier's sinks and page summaries,
        and the pages retrieved at the last step (not the far pages left out)."""
        total = self.core_tier.entry_bytes() + self.steady_tier.entry_bytes()
        far = self.far
        if far is None:
            return total
        total += tensors_nbytes(far.sink.values())
        count = far.page_count()
        for summary in (far.page_min, far.page_max):
            if summary is not None:
                total += summary[:, :, :count].numel() * summary.element_size()
        if self.pages_last is not None and far.store:
            per_token = sum(
                t[0, 0, 0].numel() * t.element_size() for name, t in far.store.items() if name != "positions"
            )
            total += int(self.pages_last.sum().item()) * far.page * per_token
        return total

    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds (all tiers, page summaries, running mean). The RoPE table is
        shared by all layers of the cache and is not KV; it is not counted."""
        return tensors_nbytes(t for group in self._tier_tensors().values() for t in group)

    def entries(self) -> int:
        """Entries held per (row, head): core + steady + the far tier (sinks and pages)."""
        far = 0
        if self.far is not None:
            held = self.far.paged_lengths() if self.far.keep_pages else [0] * self.rows
            far = max(
                (min(self.far.sinks, n) + p for n, p in zip(self.far.lengths, held, strict=True)), default=0
            )
        return len(self.core_tier) + len(self.steady_tier) + far

    def attended_entries(self) -> int:
        """Entries in the last decode step's attention (last query, mean over KV heads, largest row)."""
        return 0 if self.last_attended is None else int(round(self.last_attended.max().item()))

    def layer_stats(self) -> dict[str, Any]:
        """Tier sizes, bytes per tier, per-step attention size, pages retrieved, Self-Extend group."""
        far = self.far
        steps = max(self.decode_steps, 1)
        pages_mean = 0.0 if self.pages_total is None else float(self.pages_total.float().mean()) / steps
        return {
            "entries": self.entries(),
            "attended_entries": self.attended_entries(),
            "tiers": {
                "core": len(self.core_tier),
                "steady": len(self.steady_tier),
                "far": max(far.paged_lengths(), default=0) if far is not None and far.keep_pages else 0,
                "sinks": max((min(far.sinks, n) for n in far.lengths), default=0) if far is not None else 0,
            },
            "tier_bytes": {name: tensors_nbytes(group) for name, group in self._tier_tensors().items()},
            "core_bound": self.core_size,
            "steady_bound": self.steady_bound,
            "pages_retrieved_last_step": 0.0
            if self.pages_last is None
            else float(self.pages_last.float().mean()),
            "pages_retrieved_per_step": pages_mean,
            "retrieval_steps": self.retrieval_steps,
            "decode_steps": self.decode_steps,
            "group_size": max(self.groups, default=1),
            "last_attention_entropy": None if self.last_entropy is None else float(self.last_entropy.mean()),
        }
