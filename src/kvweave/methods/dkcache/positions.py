"""Self-Extend position remapping (Jin et al. 2024, arXiv:2401.01325): tier bounds, the group size, the
remapped relative positions and the grouped query positions DK-Cache's angle compensation uses."""

from __future__ import annotations

import torch

from kvweave.ops.rope import RopeTable


def default_bounds(trained: int) -> tuple[int, int]:
    """Seed bounds scaled to the model: 128K trained -> core 8K, steady to 64K, i.e. ``L/16`` and ``L/2``."""
    return max(1, trained // 16), max(1, trained // 2)


def group_size(length: int, window: int, trained: int) -> int:
    """Smallest Self-Extend group ``G`` that keeps every relative position of ``length`` tokens trained.

    Neighbours (distance < ``window``) keep exact positions; other pairs use ``(i // G + window − window // G) −
    j // G``, whose largest value is ``(length − 1) // G + window − window // G``; it must stay ``<= trained − 1``.
    ``1`` (the identity) while ``length <= trained``.
    """
    if length <= trained:
        return 1
    if window >= trained - 1:
        raise ValueError(
            f"dkcache: RoPE compensation needs core < trained length - 1 (core={window}, trained "
            f"length={trained}); lower core or set rope_compensation=False"
        )
    group = max(2, (length - 1 - window) // (trained - window))  # a lower bound of the answer
    while (length - 1) // group + window - window // group > trained - 1:
        group += 1
    return group


def remapped_distance(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int,
    group: int | torch.Tensor,
    trained: int | None = None,
) -> torch.Tensor:
    """Relative position attention uses for each (query, key) pair under angle compensation (broadcasting).

    Exact for neighbours (distance < ``window``) and for queries inside the trained range (position <
    ``trained``: every distance they see was trained), grouped otherwise."""
    exact = query_positions - key_positions
    grouped = (query_positions // group + window - window // group) - key_positions // group
    return torch.where(is_near(query_positions, key_positions, window, trained), exact, grouped)


def is_near(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int, trained: int | None = None
) -> torch.Tensor:
    """Pairs that keep exact RoPE positions: distance < ``window``, or a query inside the trained range."""
    near = query_positions - key_positions < window
    return near if trained is None else near | (query_positions < trained)


def grouped_query_positions(positions: torch.Tensor, groups: torch.Tensor, window: int) -> torch.Tensor:
    """Query positions for the grouped (far) part: ``i // G + window − window // G``; ``positions: [B, q]``."""
    groups = groups.view(-1, 1)
    return positions // groups + window - window // groups


def grouped_query(
    table: RopeTable, query: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor, window: int
) -> torch.Tensor:
    """The post-RoPE ``query: [B, Hq, q, D]`` at ``positions: [B, q]`` re-rotated to its grouped positions."""
    pre = table.unrotate(query, positions)
    return table.rotate(pre, grouped_query_positions(positions, groups, window))
