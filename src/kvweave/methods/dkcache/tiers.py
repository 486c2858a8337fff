"""DK-Cache's core and steady tiers (tokens of consecutive slots in a buffer that grows at the end and shrinks
at the front) and the decoupling helpers: the steady tier's mean, ``K − α·mean`` and what it does to softmax
attention (:func:`measure_key_shift`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvweave.ops.attention import masked_softmax
from kvweave.ops.quantize import dequantize_int8, quantize_int8
from kvweave.state import Stateful

GROWTH = 16
"""Tier buffers and the far store grow by 1/GROWTH of their size when full (slack counts as memory held: a
quarter made DK-Cache hold ~25 % more than its tokens after the first decode step; a copy per ~size/16 tokens
is cheap). Read when a buffer grows, here and in :mod:`kvweave.methods.dkcache.far`."""

KeyMap = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(keys [B, H, T, D], positions [B, T] int64) -> keys``: a re-rotation of held keys."""


# ------------------------------------------------------------------------------------------- decoupling


def steady_mean(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, H, 1, D]`` mean over the valid entries of ``keys: [B, H, T, D]`` (``valid: [B, T]``), per head."""
    weights = valid.to(keys.dtype).view(valid.shape[0], 1, -1, 1)
    return (keys * weights).sum(2, keepdim=True) / weights.sum(2, keepdim=True).clamp(min=1)


def decouple_keys(keys: torch.Tensor, mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """``K̂ = K − α·mean`` (seed §四.2); ``keys: [B, H, T, D]``, ``mean: [B, H, 1, D]``."""
    return keys - alpha * mean.to(keys.dtype)


def measure_key_shift(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tier: torch.Tensor,
    alpha: float = 0.38,
    scaling: float | None = None,
) -> dict[str, float]:
    """How ``K − α·mean(K_tier)`` changes softmax attention when applied to every key vs to the tier only.

    ``query: [B, Hq, q, D]``, ``keys, values: [B, H, T, D]`` as attention sees them (post-RoPE), ``tier: [T]`` or
    ``[B, T]`` bool (the steady tier's entries, whose mean is subtracted). Computed in float64. Returns the
    largest change of any attention probability and output element for the *uniform* shift (every key, what
    the seed's code does: a no-op up to rounding) and the *tier-only* shift (the seed's text, what ``dkcache``
    does), and the attention mass on the tier before and after the tier-only shift.
    """
    q, k, v = query.double(), keys.double(), values.double()
    b, hq, _, d = q.shape
    groups = hq // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    tier = tier.to(torch.bool).expand(b, -1)
    mean = steady_mean(k, tier)
    scale = scaling if scaling is not None else d**-0.5

    def attend(shifted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = masked_softmax(q @ shifted.transpose(-1, -2) * scale, None)
        return probs, probs @ v

    probs, out = attend(k)
    uniform_probs, uniform_out = attend(decouple_keys(k, mean, alpha))
    in_tier = tier.view(b, 1, 1, -1)
    tier_probs, tier_out = attend(torch.where(in_tier.transpose(-1, -2), decouple_keys(k, mean, alpha), k))
    mass = (probs * in_tier).sum(-1).mean().item()
    return {
        "uniform_max_prob_change": (uniform_probs - probs).abs().max().item(),
        "uniform_max_output_change": (uniform_out - out).abs().max().item(),
        "tier_max_prob_change": (tier_probs - probs).abs().max().item(),
        "tier_max_output_change": (tier_out - out).abs().max().item(),
        "tier_mass_before": mass,
        "tier_mass_after": (tier_probs * in_tier).sum(-1).mean().item(),
    }


# ----------------------------------------------------------------------------------------------- storage


class Buffer(Stateful):
    """A tensor that grows at the end and shrinks at the front along ``dim`` without a copy per step.

    Saved: the whole tensor (its spare capacity included) and the live range ``begin .. end``."""

    state_name = "dkcache.Buffer"
    state_fields = ("dim", "data", "begin", "end")

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.data: torch.Tensor | None = None
        self.begin = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.begin

    def view(self) -> torch.Tensor:
        assert self.data is not None
        return self.data.narrow(self.dim, self.begin, len(self))

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[self.dim]
        if self.data is None:
            self.data, self.begin, self.end = x.clone(memory_format=torch.contiguous_format), 0, n
            return
        if self.end + n > self.data.shape[self.dim]:
            needed = len(self) + n
            self._reallocate(needed + max(16, needed // GROWTH))
        self.data.narrow(self.dim, self.end, n).copy_(x)
        self.end += n

    def pop_front(self, n: int) -> torch.Tensor:
        """The first ``n`` entries (a view, valid until the next append) and drop them."""
        out = self.view().narrow(self.dim, 0, n)
        self.begin += n
        return out

    def fit(self) -> None:
        """Release capacity after a large move (prefill) so held bytes stay honest: spare room beyond what
        :meth:`append` would leave (``max(16, live // GROWTH)``) is given back, keeping that much."""
        if self.data is None:
            return
        slack = max(16, len(self) // GROWTH)
        if self.data.shape[self.dim] - len(self) > slack:
            self._reallocate(len(self) + slack)

    def _reallocate(self, capacity: int) -> None:
        live = self.view()
        shape = list(live.shape)
        shape[self.dim] = capacity
        data = live.new_empty(shape)
        data.narrow(self.dim, 0, live.shape[self.dim]).copy_(live)
        self.data, self.begin, self.end = data, 0, live.shape[self.dim]

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.data is not None:
            self.data = self.data.index_select(0, rows.to(self.data.device))

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.data is None else [self.data]


class Tier(Stateful):
    """Tokens of consecutive slots (the same slots in every row): ``keys, values: [B, H, T, D]``,
    ``positions: [B, T]`` (RoPE positions). INT8 tiers hold int8 entries and a float32 scale per token."""

    state_name = "dkcache.Tier"
    state_fields = ("quantized", "parts", "positions", "first_slot")

    def __init__(self, quantized: bool) -> None:
        self.quantized = quantized
        self.parts = {name: Buffer(2) for name in ("keys", "values", "key_scales", "value_scales")}
        self.positions = Buffer(1)
        self.first_slot = 0

    def __len__(self) -> int:
        return len(self.positions)

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        store_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Add entries (an exact tier holds them at ``store_dtype``, default theirs); returns the keys as stored
        (dequantized), for the running mean."""
        if self.quantized:
            (keys_q, key_scales), (values_q, value_scales) = quantize_int8(keys), quantize_int8(values)
            for name, part in (
                ("keys", keys_q),
                ("values", values_q),
                ("key_scales", key_scales),
                ("value_scales", value_scales),
            ):
                self.parts[name].append(part)
            keys = dequantize_int8(keys_q, key_scales, keys.dtype)
        else:
            keys = keys.to(store_dtype or keys.dtype)
            self.parts["keys"].append(keys)
            self.parts["values"].append(values.to(store_dtype or values.dtype))
        self.positions.append(positions.to(torch.int32))
        return keys

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``keys, values`` (``dtype``) and ``positions`` (int64) of every entry."""
        return self._read(
            {name: part.view() for name, part in self.parts.items() if part.data is not None},
            self.positions.view(),
            dtype,
        )

    def read_rows(self, dtype: torch.dtype, kernel: bool) -> tuple[Any, Any, torch.Tensor]:
        """Like :meth:`read`, but rows the CPU kernel reads in place come as
        :class:`~kvweave.kernels.cpu_int8.HeldRows` (attended without a dequantized or widened copy; ``kernel``:
        may use the C++ kernel): an INT8 tier's codes, and with ``kernel`` a 16-bit exact tier attended in
        float32 (the core at 16-bit storage, which would otherwise be widened every step)."""
        from kvweave.kernels.cpu_int8 import SIXTEEN_BITS, HeldRows

        if not self.quantized:
            keys, held = self.parts["keys"], self.parts["keys"].data
            in_place = held is not None and held.dtype in SIXTEEN_BITS and held.device.type == "cpu"
            if not (kernel and in_place and dtype == torch.float32):
                return self.read(dtype)
            return (
                HeldRows(keys.view(), None, kernel),
                HeldRows(self.parts["values"].view(), None, kernel),
                self.positions.view().to(torch.int64),
            )
        view = {name: part.view() for name, part in self.parts.items()}
        return (
            HeldRows(view["keys"], view["key_scales"], kernel),
            HeldRows(view["values"], view["value_scales"], kernel),
            self.positions.view().to(torch.int64),
        )

    def entry_bytes(self) -> int:
        """Bytes of the live entries (keys, values, scales, positions; not the buffers' slack capacity)."""
        total = 0
        for part in (*self.parts.values(), self.positions):
            if part.data is not None and len(part):
                live = part.view()
                total += live.numel() * live.element_size()
        return total

    def pop_front(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove and return the oldest ``n`` entries."""
        parts = {name: part.pop_front(n) for name, part in self.parts.items() if part.data is not None}
        out = self._read(parts, self.positions.pop_front(n), dtype)
        self.first_slot += n
        return out

    def _read(
        self, parts: dict[str, torch.Tensor], positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.quantized:
            keys = dequantize_int8(parts["keys"], parts["key_scales"], dtype)
            values = dequantize_int8(parts["values"], parts["value_scales"], dtype)
        else:  # .to is a no-op when the tier holds the model's dtype
            keys, values = parts["keys"].to(dtype), parts["values"].to(dtype)
        return keys, values, positions.to(torch.int64)

    def map_keys(self, fn: KeyMap) -> None:
        """Replace every held key ``k`` by ``fn(k, positions)`` in place (``[B, H, T, D]``, ``[B, T]`` int64)."""
        if not len(self):
            return
        keys, _, positions = self.read(torch.float32)
        mapped = fn(keys, positions)
        if self.quantized:
            codes, scales = quantize_int8(mapped)
            self.parts["keys"].view().copy_(codes)
            self.parts["key_scales"].view().copy_(scales)
        else:
            self.parts["keys"].view().copy_(mapped)

    def fit(self) -> None:
        for part in (*self.parts.values(), self.positions):
            part.fit()

    def select_rows(self, rows: torch.Tensor) -> None:
        for part in (*self.parts.values(), self.positions):
            part.select_rows(rows)

    def tensors(self) -> list[torch.Tensor]:
        return [t for part in (*self.parts.values(), self.positions) for t in part.tensors()]
