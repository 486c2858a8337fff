"""Rotary position embedding helpers: move keys between post-RoPE and pre-RoPE form.

transformers hands the cache keys that are already rotated (post-RoPE). Methods that change positions
(position interpolation, DK-Cache's angle compensation, StreamingLLM's shift into the window) or that
factorize keys without their position phase (DepthWeave) de-rotate them with the model's own ``cos, sin``
and rotate them again at attention time. The rotation is the ``rotate_half`` convention that every
supported architecture uses (pairs ``(i, i + D/2)``), so the inverse is exact up to rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from kvweave._compat import rotary_cos_sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [B, H, T, D]`` by the angles in ``cos, sin: [B, T, D]`` (or ``[B, H, T, D]``)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def remove_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`apply_rotary` (rotation by the opposite angles)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos - rotate_half(x) * sin).to(x.dtype)


class Rotary:
    """The model's rotary embedding, evaluated at any (also fractional) positions.

    ``positions: [B, T]`` (float or int) -> ``cos, sin: [B, T, D]`` in float32, so re-rotation at compressed
    positions is as exact as the model's own.
    """

    def __init__(self, rotary_emb: torch.nn.Module, layer_type: str | None = None) -> None:
        self.rotary_emb = rotary_emb
        self.layer_type = layer_type

    def cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin: [B, T, D]`` float32 at ``positions: [B, T]``."""
        like = torch.empty(0, dtype=torch.float32, device=device)
        cos, sin = rotary_cos_sin(self.rotary_emb, like, positions.to(device), self.layer_type)
        return cos.float(), sin.float()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate pre-RoPE ``x: [B, H, T, D]`` to ``positions: [B, T]`` (or ``[B, H, T]``)."""
        cos, sin = self._cos_sin_like(x, positions)
        return apply_rotary(x.float(), cos, sin).to(x.dtype)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Turn post-RoPE ``x: [B, H, T, D]`` at ``positions`` back into pre-RoPE keys."""
        cos, sin = self._cos_sin_like(x, positions)
        return remove_rotary(x.float(), cos, sin).to(x.dtype)

    def _cos_sin_like(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 3:  # per-head positions [B, H, T]
            b, h, t = positions.shape
            cos, sin = self.cos_sin(positions.reshape(b * h, t), x.device)
            return cos.view(b, h, t, -1), sin.view(b, h, t, -1)
        return self.cos_sin(positions.expand(x.shape[0], -1), x.device)


def find_rotary(model: Any) -> torch.nn.Module | None:
    """The model's shared rotary embedding module (``model.model.rotary_emb`` on every supported family)."""
    for module in model.modules():
        if module.__class__.__name__.endswith("RotaryEmbedding"):
            return module  # type: ignore[no-any-return]
    return None


class RopeTable:
    """``cos, sin`` of the model's rotary embedding at integer positions ``0 .. n-1``, grown on demand.

    One per layer type, shared by the layers of a cache (one table per device): rotating held keys every step
    reads the table instead of recomputing sines. Built with the model's own rotary module, so the values are
    the model's. Assumes a position-independent frequency table (not ``dynamic`` RoPE scaling).
    """

    def __init__(self, rotary: Rotary) -> None:
        self.rotary = rotary
        self.tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def ensure(self, length: int, device: torch.device) -> None:
        """Make positions ``< length`` available on ``device``."""
        held = self.tables.get(device)
        if held is None or held[0].shape[0] < length:
            size = max(length, 256, 2 * (held[0].shape[0] if held is not None else 0))
            cos, sin = self.rotary.cos_sin(torch.arange(size, device=device).view(1, -1), device)
            self.tables[device] = (cos[0], sin[0])

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``x: [B, H, T, D]`` rotated to ``positions: [B, T]`` or ``[B, 1 or H, T]`` (int)."""
        cos, sin = self.tables[x.device]
        return apply_rotary(x.float(), cos[positions], sin[positions]).to(x.dtype)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE ``x`` at ``positions`` back to pre-RoPE."""
        cos, sin = self.tables[x.device]
        return remove_rotary(x.float(), cos[positions], sin[positions]).to(x.dtype)
