"""``keydiff``: keep the most distinctive keys (Park et al. 2025, arXiv:2504.15364).

Query-agnostic eviction: each KV head scores its held keys by cosine similarity to the anchor (the mean of
the held keys, each normalised to unit length) and evicts the most similar ones, keeping the keys least like
the average. It needs no attention weights, so it works with any attention kernel. At prefill the prompt
is cut to the budget at once; during decoding, once a row is over budget, the most similar entry is evicted
for each new token (the anchor recomputed over what is held), so memory stays bounded. Keys are the cached
post-RoPE keys, as in the reference implementation; no sinks or recent window are reserved. The paper feeds
long prompts block by block, evicting after each block; here prefill attention is exact and the prompt is
cut once after it (kvpress's one-shot variant), the same scores over the whole prompt.
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


@register("keydiff")
@dataclasses.dataclass
class KeyDiff(Method):
    """Keys least similar to the mean key, per KV head (query-agnostic)."""

    budget: int = option(1024, "entries kept per KV head (ignored when ratio is set)")
    ratio: float | None = option(None, "fraction of each row's prompt tokens kept (overrides budget)")
    storage: str = option("auto", STORAGE_HELP)

    evicts = True
    bounded_memory = True
    budget_options = {"ratio": "held fraction", "budget": "held tokens"}
    test_options = {"budget": 16}
    invalid_options = (({"budget": 0}, "budget"), ({"ratio": 1.5}, "ratio"), ({"ratio": -0.5}, "ratio"))

    def __post_init__(self) -> None:
        check_budget(self)
        self.check_choice("storage", STORAGE_CHOICES)

    def make_layer(self, cache: KVCache, layer_idx: int) -> KeyDiffLayer:
        return KeyDiffLayer(cache, layer_idx)


def key_diversity(keys: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """``[B, H, T]``: minus the cosine similarity of each key to the mean unit key of its head.

    ``keys: [B, H, T, D]``, ``pad: [B, H, T]`` (padding entries do not count in the mean).
    """
    unit = F.normalize(keys.float(), dim=-1)
    real = (~pad).unsqueeze(-1).float()
    anchor = (unit * real).sum(dim=2, keepdim=True) / real.sum(dim=2, keepdim=True).clamp(min=1.0)
    return -F.cosine_similarity(keys.float(), anchor, dim=-1)


class KeyDiffLayer(EvictingLayer):
    """Exact entries; evicts the keys most similar to the head's mean key."""

    def after_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, first: int) -> None:
        if first == 0:
            self.set_budget()
        if self.over_budget():
            keys: torch.Tensor = self.keys
            self.evict(key_diversity(keys, self.pad_entries()))
