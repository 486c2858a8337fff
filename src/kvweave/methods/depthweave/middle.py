"""The recent buffer's middle tier (``middle_bits``): tokens that have left the exact newest ``recent`` but are
not folded yet, held as KIVI-style integer blocks so the same bytes keep more of them unfolded.

Blocks of :data:`MIDDLE_BLOCK` tokens: keys quantized per channel over the block (min/max of each channel over
its tokens: key outliers sit in fixed channels), values per token over groups of :data:`VALUE_GROUP` channels,
asymmetric codes packed ``8 // bits`` per byte with float16 scales and minima (:mod:`kvweave.ops.quantize`).
A block is read whole, dequantized, by the layer's attention over its recent buffer (a few hundred tokens).
"""

from __future__ import annotations

import dataclasses

import torch

from kvweave.ops.quantize import dequantize, pack_codes, quantize, unpack_codes
from kvweave.state import Stateful

MIDDLE_BLOCK = 32  # tokens per block (the key scales' span)
VALUE_GROUP = 32  # channels per value scale (the head size when smaller)


def token_bytes(heads: int, dim: int, bits: int) -> float:
    """Bytes one token of one layer costs in the middle tier: codes plus its share of the scales and minima."""
    group = min(VALUE_GROUP, dim)
    keys = dim * bits / 8 + 4 * dim / MIDDLE_BLOCK  # per-channel (scale, minimum) per block of tokens
    values = dim * bits / 8 + 4 * (dim // group)  # per-token (scale, minimum) per channel group
    return heads * (keys + values)


@dataclasses.dataclass
class MiddleBlocks(Stateful):
    """``n`` blocks of :data:`MIDDLE_BLOCK` tokens for every batch row, oldest first.

    ``key_codes: [B, H, n, T, D·bits/8]`` (per-channel scales ``key_scale, key_min: [B, H, n, 1, D]``),
    ``value_codes: [B, H, n, T, D/g, g·bits/8]`` (per-token scales ``value_scale, value_min: [B, H, n, T, D/g,
    1]``), ``T`` = :data:`MIDDLE_BLOCK`, ``g`` = the value group.
    """

    state_name = "depthweave.MiddleBlocks"

    bits: int
    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_min: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_min: torch.Tensor

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, bits: int) -> MiddleBlocks:
        """Quantize ``keys, values: [B, H, n·T, D]`` (whole blocks) into blocks."""
        b, h, m, d = keys.shape
        assert m % MIDDLE_BLOCK == 0, "the middle tier takes whole blocks"
        k = keys.float().view(b, h, m // MIDDLE_BLOCK, MIDDLE_BLOCK, d)
        key_codes, key_scale, key_min = quantize(k, 3, bits)
        group = min(VALUE_GROUP, d)
        v = values.float().view(b, h, m // MIDDLE_BLOCK, MIDDLE_BLOCK, d // group, group)
        value_codes, value_scale, value_min = quantize(v, 5, bits)
        return cls(
            bits,
            pack_codes(key_codes, bits),
            key_scale,
            key_min,
            pack_codes(value_codes, bits),
            value_scale,
            value_min,
        )

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

    def dense(self, rows: slice | int = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ``keys, values`` float32: ``[B, H, n·T, D]`` (or ``[H, n·T, D]`` for one ``rows`` int)."""
        fields = [t[rows] for t in self.tensors()]
        key_codes, key_scale, key_min, value_codes, value_scale, value_min = fields
        keys = dequantize(unpack_codes(key_codes, self.bits), key_scale, key_min)
        values = dequantize(unpack_codes(value_codes, self.bits), value_scale, value_min)
        lead = keys.shape[:-3]
        d = keys.shape[-1]
        return keys.reshape(*lead, -1, d), values.reshape(*lead, -1, d)

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
