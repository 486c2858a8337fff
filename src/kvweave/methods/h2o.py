"""``h2o``: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv:2306.14048).

Each KV head keeps the entries that received the most accumulated attention ("heavy hitters") plus the most
recent tokens. At prefill the score of an entry is the attention it received from every prompt query (the
column sums of the attention matrix, computed in chunks of queries); during decoding each new query's
attention over the held entries is added, and once a row holds more than its budget the lowest-scoring
non-recent entry is evicted, one per new token, so memory stays bounded. Grouped-query attention: the
weights of the query heads that share a KV head are summed. As in the paper, no sink tokens are reserved
(early tokens collect attention and become heavy hitters by themselves).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kvweave.methods._eviction import EvictingLayer, check_budget
from kvweave.ops.storage import STORAGE_CHOICES, STORAGE_HELP
from kvweave.registry import Method, option, register

if TYPE_CHECKING:
    from kvweave.cache import KVCache


@register("h2o")
@dataclasses.dataclass
class H2O(Method):
    """Heavy hitters (accumulated attention) + recent window, per KV head."""

    budget: int = option(1024, "entries kept per KV head (ignored when ratio is set)")
    ratio: float | None = option(None, "fraction of each row's prompt tokens kept (overrides budget)")
    recent: float = option(0.5, "fraction of the budget reserved for the most recent tokens")
    storage: str = option("auto", STORAGE_HELP)

    evicts = True
    bounded_memory = True
    budget_options = {"ratio": "held fraction", "budget": "held tokens"}
    test_options = {"ratio": 0.4, "recent": 0.5}
    invalid_options = (
        ({"budget": 0}, "budget"),
        ({"ratio": 1.5}, "ratio"),
        ({"ratio": 0.0}, "ratio"),
        ({"recent": 1.5}, "recent"),
    )

    def __post_init__(self) -> None:
        check_budget(self)
        self.check_choice("storage", STORAGE_CHOICES)
        self.check_range("recent", 0.0, 1.0)

    def make_layer(self, cache: KVCache, layer_idx: int) -> H2OLayer:
        return H2OLayer(cache, layer_idx)


class H2OLayer(EvictingLayer):
    """Exact entries with their accumulated attention ``scores: [B, H, T]`` (float32)."""

    state_fields = EvictingLayer.state_fields + ("scores",)
    batch_fields = EvictingLayer.batch_fields + ("scores",)

    entry_state = ("scores",)

    def __init__(self, cache: KVCache, layer_idx: int) -> None:
        super().__init__(cache, layer_idx)
        self.scores: torch.Tensor | None = None

    def after_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, first: int) -> None:
        q_len = query.shape[2]
        if first == 0:
            self.set_budget()
        if first == 0 or self.scores is None:
            self.scores = torch.zeros(self.rows, self.keys.shape[1], 0, device=self.device)
        new = torch.zeros(self.rows, self.keys.shape[1], q_len, device=self.device)
        self.scores = torch.cat([self.scores, new], dim=2) + self.attention_received(
            query, attention_mask, first
        )
        self.evict(self.scores, protected=self.recent(self.method.recent))
