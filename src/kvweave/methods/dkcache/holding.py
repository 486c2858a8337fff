"""How a DK-Cache layer holds its keys, in one value object: post-RoPE, pre-RoPE, or grouped at ``p // G``.

- **post-RoPE** (``rotated``): keys as attention sees them at exact positions (``key_storage="post_rope"``, and
  ``pre_rope`` storage until the context outgrows the trained range, when ``hold_rotated``).
- **pre-RoPE** (not ``rotated``, no ``group``): every tier holds unrotated keys; attention rotates them at exact
  or remapped (Self-Extend) positions each step.
- **grouped** (``group = G``): while compensating on the fast path beyond the trained range, steady and far keys
  (sinks, pages) are held rotated at their grouped positions ``p // G`` (re-rotated only when ``G`` grows); the
  core stays pre-RoPE.

The tiers ask it what a stored key is (:meth:`store`, :meth:`as_attention`, :meth:`pre_rope`,
:meth:`into_steady`) and it moves every held key between these forms (:meth:`unrotate_held`,
:meth:`hold_grouped`). Nothing else reads the three fields; a layer keeps them as its saved state (``rotated``,
``held_group``, ``aligned``), so cache files read as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvweave.ops.rope import RopeTable


@dataclasses.dataclass
class KeyHolding:
    """How keys are held (see the module docstring); ``table`` is ``None`` with post-RoPE storage."""

    table: RopeTable | None
    rotated: bool = True
    group: int | None = None
    aligned: bool = True  # every held token's position is its slot

    # -- what a held key is
    @property
    def as_seen(self) -> bool:
        """Keys are held as attention sees them at exact positions (nothing to rotate)."""
        return self.table is None or self.rotated

    @property
    def pre_rope_held(self) -> bool:
        """Every tier holds unrotated keys (page summaries are then taken at rotated positions)."""
        return self.table is not None and not self.rotated and self.group is None

    def start(self, grouped: bool, hold_rotated: bool, padded: bool) -> None:
        """A prefill: hold keys post-RoPE unless this prompt is already beyond the trained range (or storage asks
        for pre-RoPE keys)."""
        self.rotated = self.table is None or (hold_rotated and not grouped)
        self.aligned = not padded

    def store(self, key: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A new post-RoPE ``key: [B, H, q, D]`` at ``positions: [B, q]`` as the core holds it."""
        if self.as_seen:
            return key
        assert self.table is not None
        return self.table.unrotate(key, positions)

    def as_attention(
        self, keys: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Held keys -> (exact, grouped) keys as attention sees them; ``positions: [B, 1 or H, T]``. Held as seen,
        the grouped keys are the exact ones."""
        if self.as_seen:
            return keys, keys
        assert self.table is not None
        exact = self.table.rotate(keys, positions)
        grouped = exact if groups is None else self.table.rotate(keys, positions // groups.view(-1, 1, 1))
        return exact, grouped

    def pre_rope(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Steady keys as held -> pre-RoPE (the decoupling mean is kept pre-RoPE with pre-RoPE storage)."""
        if self.table is None:
            return keys
        if self.group is not None:
            return self.table.unrotate(keys, positions // self.group)
        return self.table.unrotate(keys, positions) if self.rotated else keys

    def into_steady(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Core keys leaving for the steady tier, as the steady tier holds them (grouped: rotated at ``p // G``;
        the core is pre-RoPE then)."""
        if self.group is None:
            return keys
        assert self.table is not None
        return self.table.rotate(keys, positions // self.group)

    # -- moving every held key
    def unrotate_held(self, tiers: list[Any], far: Any, device: torch.device, chunk_elements: int) -> None:
        """The context just outgrew the trained range: from now on keys are held pre-RoPE, so they can be rotated
        at remapped positions. One pass over every held key (INT8 entries are dequantized and requantized); far
        page summaries are recomputed at the new positions."""
        table = self.table
        assert table is not None
        for tier in tiers:
            tier.map_keys(table.unrotate)
        if far is not None:
            far.map_keys(table.unrotate, device, chunk_elements)
            far.clean_pages = 0
        self.rotated = False

    def hold_grouped(
        self, group: int | None, steady: Any, far: Any, device: torch.device, chunk_elements: int
    ) -> None:
        """Re-rotate the steady and far keys (sinks and pages) from how they are held to positions ``p // group``
        (``None``: back to pre-RoPE). Held keys must be pre-RoPE or grouped; one pass over them."""
        table, old = self.table, self.group
        assert table is not None and not self.rotated
        if old == group:
            return

        def regroup(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            keys = keys if old is None else table.unrotate(keys, positions // old)
            return keys if group is None else table.rotate(keys, positions // group)

        steady.map_keys(regroup)
        if far is not None:
            far.map_keys(regroup, device, chunk_elements)
            far.clean_pages = 0
        self.group = group
