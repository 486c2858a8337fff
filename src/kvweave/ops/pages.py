"""Page summaries of keys and the upper bound of ``q·k`` they give (Quest), shared by DK-Cache's far tier and
DepthWeave's selective decode.

A page is ``page`` consecutive tokens; its summary is the per-channel minimum and maximum of its keys. For any
key ``k`` of the page, ``q·k <= Σ_d max(q_d·min_d, q_d·max_d)``, so the pages with the largest bounds hold every
key that could have a large logit (Tang et al., "Quest", 2024). :class:`PageBounds` stores the summaries as
INT8 rounded outwards (minimum down, maximum up), so the bound stays an upper bound at a quarter of the bytes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvweave.state import Stateful


def page_upper_bounds(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q·k`` over each page: ``Σ_d max(q_d·min_d, q_d·max_d)``, as two matmuls.

    ``query: [B, H, n, D]`` (a KV head's query rows), ``page_min, page_max: [B, H, P, D]`` -> ``[B, H, n, P]``.
    """
    q = query.float()
    return q.clamp(min=0) @ page_max.transpose(-1, -2) + q.clamp(max=0) @ page_min.transpose(-1, -2)


def page_extremes(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(min, max)`` of each page of ``keys: [..., T, D]`` -> ``[..., ceil(T / page), D]``
    (a partial last page summarises the tokens it has)."""
    t = keys.shape[-2]
    pad = (-t) % page
    low = F.pad(keys.float(), (0, 0, 0, pad), value=float("inf")).unflatten(-2, (-1, page)).amin(-2)
    high = F.pad(keys.float(), (0, 0, 0, pad), value=float("-inf")).unflatten(-2, (-1, page)).amax(-2)
    return low, high


@dataclasses.dataclass
class PageBounds(Stateful):
    """Page summaries ``[H, P, D]`` at INT8 with one float32 scale per page and head (``[H, P, 1]``).

    Rounded outwards, so :meth:`upper_bounds` never falls below the bound of the exact summaries."""

    state_name = "ops.PageBounds"

    low: torch.Tensor  # [H, P, D] int8, floor(min / scale)
    high: torch.Tensor  # [H, P, D] int8, ceil(max / scale)
    scale: torch.Tensor  # [H, P, 1] float32

    @classmethod
    def of(cls, low: torch.Tensor, high: torch.Tensor) -> PageBounds:
        """Quantize exact summaries ``low, high: [H, P, D]``."""
        scale = torch.maximum(low.abs().amax(-1, keepdim=True), high.abs().amax(-1, keepdim=True))
        scale = (scale / 127).clamp_min(1e-12)
        return cls(
            torch.floor(low / scale).clamp(-127, 127).to(torch.int8),
            torch.ceil(high / scale).clamp(-127, 127).to(torch.int8),
            scale.float(),
        )

    @property
    def pages(self) -> int:
        return int(self.low.shape[1])

    def replace_from(self, first_page: int, low: torch.Tensor, high: torch.Tensor) -> PageBounds:
        """Pages ``first_page ..`` replaced by (exact) ``low, high: [H, P', D]``."""
        new = PageBounds.of(low, high)
        keep = slice(0, first_page)
        return PageBounds(
            torch.cat([self.low[:, keep], new.low], 1),
            torch.cat([self.high[:, keep], new.high], 1),
            torch.cat([self.scale[:, keep], new.scale], 1),
        )

    def upper_bounds(self, query: torch.Tensor) -> torch.Tensor:
        """``query: [H, M, D]`` -> ``[H, M, P]`` upper bounds of ``q·k`` over each page."""
        low = self.low.float() * self.scale
        high = self.high.float() * self.scale
        return page_upper_bounds(query.unsqueeze(0), low.unsqueeze(0), high.unsqueeze(0))[0]

    def tensors(self) -> list[torch.Tensor]:
        return [self.low, self.high, self.scale]
