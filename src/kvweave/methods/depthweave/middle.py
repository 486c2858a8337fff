"""The recent buffer's middle tier (``middle_bits``): tokens that have left the exact newest ``recent`` but are
not folded yet, held as KIVI-style integer blocks so the same bytes keep more of them unfolded.

Blocks of :data:`MIDDLE_BLOCK` tokens, laid out as ``quant`` lays its blocks (:class:`kvweave.ops.kivi.Blocks`):
keys quantized per channel over the block (min/max of each channel over its tokens: key outliers sit in fixed
channels), values per token over groups of :data:`VALUE_GROUP` channels, asymmetric codes packed ``8 // bits``
per byte with float16 scales and minima. Attention reads them in place (:class:`MiddlePart`): the per-channel
key scales fold into the query and the values are decoded row by row inside ``quant``'s fused C++ kernel
(:mod:`kvweave.kernels.cpu_quant`), or in its torch reference where the kernel does not run; no dequantized
copy of the tier is made per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from kvweave.kernels import cpu_quant
from kvweave.kernels.registry import Kernel, choose
from kvweave.ops.kivi import Blocks, block_logits, dequantize_blocks, dequantize_values, quantize_blocks
from kvweave.ops.quantize import pack_codes_split, unpack_codes
from kvweave.state import Stateful

MIDDLE_BLOCK = 32  # tokens per block (the key scales' span)
VALUE_GROUP = 32  # channels per value scale (the head size when smaller)
LAYOUT = 2  # 2: ``quant``'s block layout; 1 (caches saved before it): keys packed along channels

MIDDLE_ATTENTION = Kernel("depthweave middle-tier attention", cpp="kvweave.kernels.cpu_quant")


def token_bytes(heads: int, dim: int, bits: int) -> float:
    """Bytes one token of one layer costs in the middle tier: codes plus its share of the scales and minima."""
    group = min(VALUE_GROUP, dim)
    keys = dim * bits / 8 + 4 * dim / MIDDLE_BLOCK  # per-channel (scale, minimum) per block of tokens
    values = dim * bits / 8 + 4 * (dim // group)  # per-token (scale, minimum) per channel group
    return heads * (keys + values)


def middle_backend(kernel: str, device: torch.device) -> str:
    """``cpp`` or ``torch``: what attends over the middle tier for DepthWeave's ``kernel`` option. There is no
    Triton kernel for it: ``triton`` (and ``auto`` on CUDA) take the torch path, which also reads the codes."""
    return choose(MIDDLE_ATTENTION, kernel if kernel in ("cpp", "torch") else "auto", device)


@dataclasses.dataclass
class MiddleBlocks(Stateful):
    """``n`` blocks of :data:`MIDDLE_BLOCK` tokens for every batch row, oldest first, as :class:`Blocks` holds
    them: ``key_codes: [B, H, n, D, T·bits/8]`` (channel-major), ``key_scale, key_min: [B, H, n, 1, D]``,
    ``value_codes: [B, H, n, T, D·bits/8]``, ``value_scale, value_min: [B, H, n, T, D/g]`` (``T`` =
    :data:`MIDDLE_BLOCK`, ``g`` the value group)."""

    state_name = "depthweave.MiddleBlocks"
    state_defaults: ClassVar[dict[str, Any]] = {"layout": 1}  # saved before the layout field: layout 1

    bits: int
    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_min: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_min: torch.Tensor
    layout: int = dataclasses.field(default=LAYOUT, kw_only=True)

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, bits: int) -> MiddleBlocks:
        """Quantize ``keys, values: [B, H, n·T, D]`` (whole blocks) into blocks."""
        b, h, m, d = keys.shape
        assert m % MIDDLE_BLOCK == 0, "the middle tier takes whole blocks"
        shape = (b, h, m // MIDDLE_BLOCK, MIDDLE_BLOCK, d)
        blocks = quantize_blocks(
            keys.float().view(shape), values.float().view(shape), bits, min(VALUE_GROUP, d)
        )
        return cls(bits, *blocks.tensors())

    def after_load(self) -> None:
        """A file saved with layout 1 (keys packed along channels, value scales with a trailing unit axis):
        the same codes and scales rearranged into :class:`Blocks`' layout."""
        if self.layout == LAYOUT:
            return
        b, h, n, t, _ = self.key_codes.shape
        codes = unpack_codes(self.key_codes, self.bits)  # [B, H, n, T, D]
        self.key_codes = pack_codes_split(codes.transpose(-1, -2).contiguous(), self.bits)
        self.value_codes = self.value_codes.reshape(b, h, n, t, -1)
        self.value_scale, self.value_min = self.value_scale.squeeze(-1), self.value_min.squeeze(-1)
        self.layout = LAYOUT

    def blocks(self, row: int | None = None) -> Blocks:
        """The tier as :class:`Blocks` (batch row ``row`` only, batch axis kept, when given)."""
        tensors = self.tensors()
        if row is not None:
            tensors = [t[row : row + 1] for t in tensors]
        return Blocks(*tensors)

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.key_codes,
            self.key_scale,
            self.key_min,
            self.value_codes,
            self.value_scale,
            self.value_min,
        ]

    def count(self) -> int:
        """Tokens held (per row)."""
        return int(self.key_codes.shape[2]) * MIDDLE_BLOCK

    def dense(self, row: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ``keys, values`` float32: ``[B, H, n·T, D]`` (or ``[H, n·T, D]`` for batch row ``row``)."""
        keys, values = dequantize_blocks(self.blocks(row), self.bits)
        return (keys[0], values[0]) if row is not None else (keys, values)

    def append(self, other: MiddleBlocks) -> MiddleBlocks:
        return MiddleBlocks(
            self.bits,
            *(torch.cat([a, b], dim=2) for a, b in zip(self.tensors(), other.tensors(), strict=True)),
        )

    def drop_blocks(self, count: int) -> MiddleBlocks | None:
        """The blocks after the oldest ``count`` (``None`` when none is left)."""
        if count >= self.key_codes.shape[2]:
            return None
        return MiddleBlocks(self.bits, *(t[:, :, count:].clone() for t in self.tensors()))

    def select_rows(self, rows: torch.Tensor) -> MiddleBlocks:
        return MiddleBlocks(self.bits, *(t.index_select(0, rows.to(t.device)) for t in self.tensors()))


class MiddlePart:
    """Batch row ``row``'s middle tier as a part of :func:`~kvweave.methods.depthweave.parts.attend_parts`:
    logits with the key scales folded into the query, values weighted straight from their codes (``backend``:
    ``cpp``, the fused kernel, or ``torch``, its reference)."""

    def __init__(self, middle: MiddleBlocks, row: int, slots: torch.Tensor, backend: str) -> None:
        self.blocks, self.bits, self.slots, self.backend = middle.blocks(row), middle.bits, slots, backend

    def logits(self, query: torch.Tensor) -> torch.Tensor:
        """``query: [H, M, D]`` float32 -> ``[H, M, n]``."""
        b = self.blocks
        if self.backend == "cpp":
            return cpu_quant.block_logits(query[None], b.key_codes, b.key_scale, b.key_min, self.bits, 1.0)[0]
        return block_logits(query[None], b, self.bits)[0]

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs: [H, M, n]`` -> ``[H, M, D]``."""
        b = self.blocks
        if self.backend == "cpp":
            return cpu_quant.weighted_values(
                probs[None], b.value_codes, b.value_scale, b.value_min, self.bits
            )[0]
        return probs @ dequantize_values(b, self.bits)[0]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = dequantize_blocks(self.blocks, self.bits)
        return keys[0], values[0]
