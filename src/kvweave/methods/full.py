"""``full``: the exact cache (the reference every other method is measured against).

It stores what transformers' ``DynamicCache`` stores, in the same layer objects, so greedy generation gives the
same tokens and logits; kvweave only adds byte accounting and statistics on top.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvweave._compat import CacheLayerMixin, DynamicLayer
from kvweave.registry import Method, register

if TYPE_CHECKING:
    from kvweave.cache import KVCache


@register("full")
@dataclasses.dataclass
class Full(Method):
    """Exact KV cache, identical to transformers' DynamicCache."""

    exact = True
    uses_kvweave_attention = False
    vllm = "vLLM's own paged cache is the exact reference there (KVWEAVE_VLLM_METHOD unset)"

    def make_layer(self, cache: KVCache, layer_idx: int) -> CacheLayerMixin:
        return DynamicLayer()
