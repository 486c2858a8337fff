"""``snapkv``: observation-window selection at prefill (Li et al., NeurIPS 2024, arXiv:2404.14469).

At prefill the last ``window`` prompt queries (the "observation window") vote for the prompt entries: their
attention over the entries before the window is summed (over the window's queries and over the query heads
of each KV head's group), smoothed with a 1-D max or average pool of width ``pool`` so that neighbours of
an important token survive with it, and each KV head keeps its top entries plus the observation window
itself. As in the paper, decoding appends new tokens uncompressed: memory grows with the generated length
(``bounded_memory`` is False), the saving is on the prompt.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvweave.methods._eviction import EvictingLayer, check_budget
from kvweave.ops.storage import STORAGE_CHOICES, STORAGE_HELP
from kvweave.registry import Method, option, register

if TYPE_CHECKING:
    from kvweave.cache import KVCache


@register("snapkv")
@dataclasses.dataclass
class SnapKV(Method):
    """Prompt entries chosen by the attention of the last prompt queries (observation window)."""

    budget: int = option(1024, "prompt entries kept per KV head, window included (ignored when ratio is set)")
    ratio: float | None = option(None, "fraction of each row's prompt tokens kept (overrides budget)")
    window: int = option(32, "observation window: last prompt queries that score, always kept")
    pool: int = option(7, "pooling width over the scores (odd; 1 = no pooling)")
    pooling: str = option("max", "max or avg pooling of the scores")
    storage: str = option("auto", STORAGE_HELP)

    evicts = True
    budget_options = {"ratio": "held fraction", "budget": "held tokens"}
    renamed_options = {"kernel": "pool"}  # "kernel" names a backend elsewhere
    test_options = {"budget": 16, "window": 4, "pool": 3}
    invalid_options = (
        ({"budget": 0}, "budget"),
        ({"ratio": 2.0}, "ratio"),
        ({"window": 0}, "window"),
        ({"pool": 4}, "pool"),
        ({"pool": 0}, "pool"),
        ({"pooling": "sum"}, "pooling"),
    )

    def __post_init__(self) -> None:
        check_budget(self)
        self.check_choice("storage", STORAGE_CHOICES)
        self.check_range("window", 1)
        self.check_range("pool", 1)
        if self.pool % 2 == 0:
            raise ValueError(f"{self.name}: option pool={self.pool!r} is not allowed; use an odd width >= 1")
        self.check_choice("pooling", ["max", "avg"])

    def make_layer(self, cache: KVCache, layer_idx: int) -> SnapKVLayer:
        return SnapKVLayer(cache, layer_idx)


class SnapKVLayer(EvictingLayer):
    """Compresses the prompt once, at prefill."""

    def after_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, first: int) -> None:
        if first != 0:
            return  # decoding: new tokens stay, uncompressed
        self.set_budget()
        if not self.over_budget():
            return
        window = min(self.method.window, query.shape[2])
        start = query.shape[2] - window
        mask = attention_mask[:, :, start:] if attention_mask is not None else None
        scores = self.attention_received(query[:, :, start:], mask, start)
        observed = torch.arange(self.entries(), device=self.device).view(1, 1, -1) >= start
        scores = self.pool(scores.masked_fill(observed, 0.0))  # the paper pools the prefix scores only
        self.evict(scores, protected=observed)

    def pool(self, scores: torch.Tensor) -> torch.Tensor:
        """1-D pooling of ``scores: [B, H, T]`` along the tokens (same length out)."""
        width = self.method.pool
        if width == 1:
            return scores
        b, h, t = scores.shape
        flat = scores.reshape(b * h, 1, t)
        if self.method.pooling == "max":
            pooled = F.max_pool1d(flat, width, stride=1, padding=width // 2)
        else:
            pooled = F.avg_pool1d(flat, width, stride=1, padding=width // 2, count_include_pad=True)
        return pooled.view(b, h, t)
