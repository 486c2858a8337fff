"""``window``: attention sinks + a recent window (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453).

Keeps the first ``sinks`` tokens and the last ``window`` tokens; everything between is dropped as soon as
it leaves the window, so memory stays bounded however long decoding runs. Positions: ``keep`` leaves every
key at its original RoPE position (what most serving stacks do); ``shift`` re-rotates held keys to their
index in the cache, as the StreamingLLM paper does, so relative distances never exceed ``sinks + window``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvweave.cache import CompressedLayer, Method, option, register

if TYPE_CHECKING:
    from kvweave.cache import KVCache


@register("window")
@dataclasses.dataclass
class Window(Method):
    """Attention sinks + recent window (StreamingLLM)."""

    window: int = option(1024, "recent tokens kept")
    sinks: int = option(4, "first tokens always kept (attention sinks)")
    ratio: float | None = option(
        None, "fraction of the prompt kept (sets window at prefill; overrides window)"
    )
    positions: str = option("keep", "keep: original RoPE positions; shift: positions inside the cache")

    evicts = True
    bounded_memory = True
    test_options = {"window": 8, "sinks": 2}
    invalid_options = (
        ({"window": 0}, "window"),
        ({"sinks": -1}, "sinks"),
        ({"ratio": 1.5}, "ratio"),
        ({"positions": "middle"}, "positions"),
    )

    def __post_init__(self) -> None:
        self.check_range("window", 1)
        self.check_range("sinks", 0)
        if self.ratio is not None:
            self.check_range("ratio", 0.0, 1.0)
        self.check_choice("positions", ["keep", "shift"])

    @property
    def needs_positions(self) -> bool:  # type: ignore[override]
        return self.positions == "shift"

    def make_layer(self, cache: KVCache, layer_idx: int) -> WindowLayer:
        return WindowLayer(cache, layer_idx, self)


class WindowLayer(CompressedLayer):
    """Holds ``sinks + window`` exact entries."""

    def __init__(self, cache: KVCache, layer_idx: int, method: Window) -> None:
        super().__init__(cache, layer_idx)
        self.method = method
        self.window = method.window

    def after_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, first: int) -> None:
        if self.method.ratio is not None and first == 0:  # prefill: budget from the prompt length
            self.window = max(1, int(self.method.ratio * self.seen) - self.method.sinks)
        held = self.entries()
        budget = self.method.sinks + self.window
        if held <= budget:
            return
        # sinks are the first real tokens of each row (left padding is never a sink)
        order = torch.arange(held, device=self.device).view(1, -1) + held * self.padding_flags()
        sinks = order[:, : held - self.window].topk(self.method.sinks, dim=1, largest=False).indices
        recent = torch.arange(held - self.window, held, device=self.device).view(1, -1).expand(self.rows, -1)
        index = torch.cat([sinks, recent], dim=1)
        self.keep(index.unsqueeze(1).expand(-1, self.keys.shape[1], -1))

    def reset(self) -> None:
        CompressedLayer.__init__(self, self.cache, self.layer_idx)
        self.window = self.method.window

    def layer_stats(self) -> dict[str, Any]:
        return {"entries": self.entries(), "window": self.window, "sinks": self.method.sinks}
