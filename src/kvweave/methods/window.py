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

from kvweave.cache import CompressedLayer
from kvweave.methods.pi import rerotate, token_positions
from kvweave.ops.attention import masked_attention
from kvweave.ops.masking import visible_mask
from kvweave.ops.storage import STORAGE_CHOICES, STORAGE_HELP
from kvweave.registry import Method, option, register

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
    storage: str = option("auto", STORAGE_HELP)

    evicts = True
    bounded_memory = True
    budget_options = {"ratio": "held fraction", "window": "held tokens"}
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
        self.check_choice("storage", STORAGE_CHOICES)

    def make_layer(self, cache: KVCache, layer_idx: int) -> WindowLayer:
        return WindowLayer(cache, layer_idx, self)


class WindowLayer(CompressedLayer):
    """Holds ``sinks + window`` exact entries (pre-RoPE keys with ``positions="shift"``)."""

    state_fields = CompressedLayer.state_fields + ("window",)

    def __init__(self, cache: KVCache, layer_idx: int, method: Window) -> None:
        super().__init__(cache, layer_idx)
        self.method = method
        self.window = method.window
        self.shift = method.positions == "shift"

    def append(self, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        if self.shift:  # store pre-RoPE keys: they are rotated to their in-cache index at attention time
            positions = token_positions(
                {"position_ids": position_ids}, self.seen, key.shape[2], self.rows, key.device
            )
            key = self.cache.rotary_for(self.layer_idx).unrotate(key.float(), positions).to(key.dtype)
        super().append(key, value, position_ids)

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not self.shift:
            return super().attend(module, query, key, value, attention_mask, **kwargs)
        q_len, first = key.shape[2], self.seen
        self.append(key, value, kwargs.get("position_ids"))
        self.seen += q_len
        if first == 0:  # prefill: exact attention at the model's own positions
            self.record_padding(attention_mask)
            out = self.prompt_attention(module, query, key, value, attention_mask, **kwargs)
        else:
            rotary = self.cache.rotary_for(self.layer_idx)
            positions = self.cache_positions()  # [B, H, T]
            held: torch.Tensor = self.computed(self.keys)
            keys = rotary.rotate(held, positions)
            # each new query sits at the in-cache index of its own entry (the last q_len entries)
            query_positions = positions[:, 0, -q_len:]
            token = token_positions(kwargs, first, q_len, self.rows, query.device)
            query = rerotate(rotary, query, token, query_positions)
            mask = visible_mask(attention_mask, self.held_slots(), first, q_len)
            out = masked_attention(query, keys, self.computed(self.values), mask, kwargs.get("scaling"))
        self.after_attention(query, attention_mask, first)
        return out

    def cache_positions(self) -> torch.Tensor:
        """``[B, H, T]`` RoPE positions in shift mode: each held entry's index among the row's real entries."""
        slots = self.held_slots().to(torch.int64)
        pads = self.pad_count if self.pad_count is not None else torch.zeros_like(slots[:, 0, 0])
        real = slots >= pads.view(-1, 1, 1)
        return (real.cumsum(dim=-1) - 1).clamp(min=0)

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
        self.__init__(self.cache, self.layer_idx, self.method)  # type: ignore[misc]

    def layer_stats(self) -> dict[str, Any]:
        return {"entries": self.entries(), "window": self.window, "sinks": self.method.sinks}
