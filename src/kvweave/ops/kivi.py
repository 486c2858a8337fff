"""KIVI blocks (Liu et al., ICML 2024): keys quantized per channel over a block of ``G`` tokens, values per
token over groups of channels, packed into ``uint8`` with float16 scales and minima, and the torch reference
of attention over them without materialising dequantized keys (per-channel scales fold into the query).

``quant`` stores its whole cache this way; DepthWeave's middle tier (``depthweave:middle_bits``) holds the
unfolded tokens of its recent buffer this way. The fused kernels that read these blocks in place are
:mod:`kvweave.kernels.cpu_quant` (C++ on CPU) and :mod:`kvweave.kernels.triton_quant` (Triton).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvweave.ops.quantize import (
    dequantize,
    pack_codes,
    pack_codes_split,
    quantize,
    unpack_codes,
    unpack_codes_split,
)
from kvweave.state import Stateful

__all__ = ["Blocks", "block_logits", "dequantize_blocks", "dequantize_values", "quantize_blocks"]


@dataclasses.dataclass
class Blocks(Stateful):
    """``n`` quantized blocks of ``G`` tokens for every row: packed codes + float16 scales and minima.

    ``key_codes: [B, H, n, D, G*bits/8]`` uint8, channel-major and packed along the block's tokens in split
    order (:func:`~kvweave.ops.quantize.pack_codes_split`), so a channel's codes unpack to a contiguous run of tokens;
    ``value_codes: [B, H, n, G, D*bits/8]`` uint8, packed along channels (:func:`~kvweave.ops.quantize.pack_codes`);
    ``key_scale, key_min: [B, H, n, 1, D]`` (per channel); ``value_scale, value_min: [B, H, n, G, D/group]``
    (per token and channel group).
    """

    state_name = "quant.Blocks"

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_min: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_min: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @property
    def count(self) -> int:
        return int(self.key_codes.shape[2])

    def map(self, fn: Any) -> Blocks:
        return Blocks(*(fn(t) for t in self.tensors()))

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        return Blocks(*(torch.cat(ts, dim=2) for ts in zip(*(p.tensors() for p in parts), strict=True)))


def quantize_blocks(keys: torch.Tensor, values: torch.Tensor, bits: int, channel_group: int) -> Blocks:
    """``keys, values: [B, H, n, G, D]`` -> :class:`Blocks`."""
    b, h, n, g, d = keys.shape
    key_codes, key_scale, key_min = quantize(keys, 3, bits)  # per channel, over the block's tokens
    grouped = values.reshape(b, h, n, g, d // channel_group, channel_group)
    value_codes, value_scale, value_min = quantize(grouped, 5, bits)  # per token, per channel group
    return Blocks(
        pack_codes_split(key_codes.transpose(-1, -2), bits),
        key_scale,
        key_min,
        pack_codes(value_codes.view(b, h, n, g, d), bits),
        value_scale.squeeze(-1),
        value_min.squeeze(-1),
    )


def block_logits(query: torch.Tensor, blocks: Blocks, bits: int) -> torch.Tensor:
    """``q·k`` over quantized key blocks without dequantizing the keys: per-channel scales and minima fold
    into the query, ``q·(c⊙s + m) = (q⊙s)·c + q·m``. ``query: [B, H, R, D]`` float32 -> ``[B, H, R, n*G]``."""
    codes = unpack_codes_split(blocks.key_codes, bits).float()  # [B, H, n, D, G]
    b, h, n, d, g = codes.shape
    scale, minimum = blocks.key_scale.float().squeeze(3), blocks.key_min.float().squeeze(3)  # [B, H, n, D]
    scaled = query.unsqueeze(2) * scale.unsqueeze(3)  # [B, H, n, R, D]
    logits = scaled @ codes  # [B, H, n, R, G]
    logits = logits + (minimum @ query.transpose(-1, -2)).unsqueeze(-1)  # + q·m per block
    return logits.permute(0, 1, 3, 2, 4).reshape(b, h, query.shape[2], n * g)


def dequantize_values(blocks: Blocks, bits: int) -> torch.Tensor:
    """float32 ``values: [B, H, n*G, D]`` of quantized blocks."""
    b, h, n, g, _ = blocks.value_codes.shape
    codes = unpack_codes(blocks.value_codes, bits).float().view(b, h, n, g, blocks.value_scale.shape[-1], -1)
    values = dequantize(codes, blocks.value_scale.unsqueeze(-1), blocks.value_min.unsqueeze(-1))
    return values.reshape(b, h, n * g, -1)


def dequantize_blocks(blocks: Blocks, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`Blocks` -> float32 ``keys, values: [B, H, n*G, D]``."""
    codes = unpack_codes_split(blocks.key_codes, bits).transpose(-1, -2)  # [B, H, n, G, D]
    keys = dequantize(codes, blocks.key_scale, blocks.key_min)
    b, h, n, g, d = keys.shape
    return keys.reshape(b, h, n * g, d), dequantize_values(blocks, bits)
