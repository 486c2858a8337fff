"""``pi``: linear position interpolation (Chen et al. 2023, arXiv:2306.15595), applied at inference.

Every token's RoPE position ``p`` becomes ``p / factor``: keys are re-rotated from ``p`` to ``p / factor``
as they are stored and each query is re-rotated the same way before attention, so relative distances shrink
by ``factor`` and a context ``factor`` times longer than the trained one stays inside the trained range of
angles. It changes positions only: nothing is evicted or quantized and the cache holds what the exact cache
holds (``compresses`` is False). The paper fine-tunes the model briefly after interpolating; without that
step (as here) quality drops for short contexts — this row measures that zero-shot effect. Only the
full-attention layers are interpolated: sliding-window layers (Gemma3's local layers) keep transformers'
own cache and positions.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any

import torch

from kvweave.cache import CompressedLayer
from kvweave.ops.storage import STORAGE_CHOICES, STORAGE_HELP
from kvweave.registry import Method, option, register

if TYPE_CHECKING:
    from kvweave.cache import KVCache


@register("pi")
@dataclasses.dataclass
class PositionInterpolation(Method):
    """Linear RoPE position interpolation (positions divided by ``factor``); no compression."""

    factor: float = option(2.0, "positions are divided by this factor")
    storage: str = option("auto", STORAGE_HELP)

    needs_positions = True
    exact_prefill = False  # the prompt itself is attended at interpolated positions
    compresses = False
    test_options = {"factor": 2.0}
    invalid_options = (({"factor": 0.5}, "factor"), ({"factor": 0.0}, "factor"))

    def __post_init__(self) -> None:
        self.check_range("factor", 1.0)
        self.check_choice("storage", STORAGE_CHOICES)

    def make_layer(self, cache: KVCache, layer_idx: int) -> InterpolatedLayer:
        return InterpolatedLayer(cache, layer_idx)


def rerotate(
    rotary: Any, x: torch.Tensor, positions: torch.Tensor, new_positions: torch.Tensor
) -> torch.Tensor:
    """Post-RoPE ``x: [B, H, T, D]`` at ``positions: [B, T]`` rotated to ``new_positions`` (one rounding)."""
    pre = rotary.unrotate(x.float(), positions)
    return rotary.rotate(pre, new_positions).to(x.dtype)


def token_positions(
    kwargs: dict[str, Any], first: int, q_len: int, rows: int, device: torch.device
) -> torch.Tensor:
    """``[B, q]`` RoPE positions of the new tokens (the model's ``position_ids``, else ``first ..``)."""
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(first, first + q_len, device=device).view(1, -1)
    return positions.to(device).expand(rows, -1)


class InterpolatedLayer(CompressedLayer):
    """Exact entries whose keys are stored at the interpolated positions."""

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        rotary = self.cache.rotary_for(self.layer_idx)
        positions = token_positions(kwargs, self.seen, key.shape[2], self.rows, key.device)
        new_positions = positions.float() / typing.cast(PositionInterpolation, self.cache.method).factor
        query = rerotate(rotary, query, positions, new_positions)
        key = rerotate(rotary, key, positions, new_positions)
        return super().attend(module, query, key, value, attention_mask, **kwargs)
