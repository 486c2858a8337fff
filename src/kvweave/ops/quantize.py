"""Integer storage, in one place: every quantizer kvweave uses and the one packed-tensor type.

- Asymmetric min/max codes (KIVI-style ``quant``): :func:`quantize` / :func:`dequantize` with one
  (scale, minimum) per slice, codes packed ``8 // bits`` per byte by :func:`pack_codes` (interleaved) or
  :func:`pack_codes_split` (split runs, for the CPU kernel).
- Symmetric groups (DepthWeave's bases, coefficients and residual rows): :class:`Packed`, a ``[..., n, w]``
  tensor stored at 16 bits (the storage dtype, no scales), INT8 or INT4 (two values per byte along ``w``),
  with float16 scales either per column over groups of ``group`` rows or per row. Rows can be appended;
  only the partial last row group is re-quantized.
- Symmetric INT8 per token with a float32 scale (DK-Cache's steady and far tiers): :func:`quantize_int8`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from kvweave.state import Stateful

SCALE_DTYPE = torch.float16
_SCALE_MIN = 6.2e-5  # smallest normal float16: scales never become subnormal or zero


# ------------------------------------------------------------------------------ asymmetric codes (quant)


def quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``x`` with one (scale, minimum) per slice along ``dim``.

    Returns ``codes`` (uint8, unpacked, same shape as ``x``) and ``scale, minimum`` (float16, ``dim`` kept
    as size 1). The codes are computed against the float16-rounded scale and minimum actually stored.
    """
    x = x.float()
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    levels = (1 << bits) - 1
    scale, minimum = ((high - low) / levels).half(), low.half()
    if not (torch.isfinite(scale).all() and torch.isfinite(minimum).all()):
        raise ValueError(
            "quant: keys or values are NaN/Inf or exceed the float16 range; cannot quantize them"
        )
    step = torch.where(scale == 0, 1.0, scale.float())
    codes = ((x - minimum.float()) / step).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, minimum


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """float32 ``codes * scale + minimum`` (broadcasting)."""
    return codes.float() * scale.float() + minimum.float()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (< 2**bits) along the last dimension, ``8 // bits`` per byte."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    grouped = codes.view(*codes.shape[:-1], -1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    # one slice per position in the byte, then interleave (3x faster on CPU than a broadcast shift)
    codes = torch.stack([(packed >> (bits * k)) & mask for k in range(per_byte)], dim=-1)
    return codes.view(*packed.shape[:-1], -1)


def pack_codes_split(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (< 2**bits) along the last dimension (length L) in split order: byte ``i`` holds
    codes ``i, i + L/P, i + 2L/P, ...`` (``P = 8 // bits``), so unpacking concatenates contiguous runs."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    parts = codes.to(torch.int32).view(*codes.shape[:-1], per_byte, -1)
    shifts = (torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits).view(-1, 1)
    return (parts << shifts).sum(-2).to(torch.uint8)


def unpack_codes_split(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes_split`."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * k)) & mask for k in range(per_byte)], dim=-1)


# ----------------------------------------------------------------- symmetric groups (DepthWeave's Packed)


@dataclasses.dataclass
class Packed(Stateful):
    """A ``[..., n, w]`` tensor at ``bits`` per element.

    ``data``: the values (``bits=16``: storage dtype), int8 (``bits=8``) or uint8 holding two 4-bit values per
    byte along ``w`` (``bits=4``). ``scale``: float16, ``[..., ceil(n / group), w]`` (per column, row groups)
    or ``[..., n, 1]`` (``group=0``: per row); ``None`` at 16 bits.
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    bits: int
    width: int
    group: int

    @property
    def rows(self) -> int:
        return int(self.data.shape[-2])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored values as ``[..., n, w]`` in ``dtype``."""
        if self.bits == 16:
            return self.data.to(dtype)
        values = _unpack4(self.data, self.width, dtype) if self.bits == 4 else self.data.to(dtype)
        scale = self.scale.to(dtype)  # type: ignore[union-attr]
        if self.group <= 0:
            return values * scale
        n, whole = self.rows, self.rows - self.rows % self.group
        # scales broadcast over each group of rows (no repeated copy of the scale tensor)
        head = (
            values[..., :whole, :].unflatten(-2, (-1, self.group))
            * scale[..., : whole // self.group, :].unsqueeze(-2)
        ).flatten(-3, -2)
        if whole == n:
            return head
        return torch.cat([head, values[..., whole:, :] * scale[..., -1:, :]], dim=-2)

    def gather_rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``index`` (any shape ``[...]``, int64) of a ``[n, w]`` tensor, dequantized: ``[..., w]``.

        Only the chosen rows are read and unpacked (selective decode reads a few rows of a long store)."""
        data = self.data[index]
        if self.bits == 16:
            return data.to(dtype)
        values = _unpack4(data, self.width, dtype) if self.bits == 4 else data.to(dtype)
        scale = self.scale[index if self.group <= 0 else index // self.group]  # type: ignore[index]
        return values * scale.to(dtype)

    def gather_groups(self, groups: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Whole row groups ``groups: [..., c]`` of a ``[n, w]`` tensor quantized with ``group > 0``, dequantized:
        ``[..., c·group, w]`` (rows past ``n`` in a partial last group repeat row ``n - 1``). One scale row per
        group is read, not one per row: the cheap way to read whole pages."""
        offsets = torch.arange(self.group, device=groups.device)
        rows = (groups.unsqueeze(-1) * self.group + offsets).clamp(max=self.rows - 1)  # [..., c, group]
        data = self.data[rows]
        if self.bits == 16:
            return data.to(dtype).flatten(-3, -2)
        values = _unpack4(data, self.width, dtype) if self.bits == 4 else data.to(dtype)
        scale = self.scale[groups].to(dtype).unsqueeze(-2)  # type: ignore[index]  # [..., c, 1, w]
        return (values * scale).flatten(-3, -2)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this object holds (for byte accounting)."""
        return [self.data] if self.scale is None else [self.data, self.scale]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def logical_elements(self) -> int:
        """Number of stored values (``n·w`` times leading dims): the unquantized size in elements."""
        return math.prod(self.data.shape[:-1]) * self.width

    def append_rows(self, x: torch.Tensor) -> Packed:
        """A new :class:`Packed` with rows ``x: [..., m, w]`` added after the stored ones."""
        if self.bits == 16 or self.group == 0:
            new = pack(x, self.bits, self.group, self.data.dtype)
            scales = None if self.scale is None else [self.scale, new.scale]
            scale = None if scales is None else torch.cat(scales, dim=-2)  # type: ignore[arg-type]
            return Packed(torch.cat([self.data, new.data], dim=-2), scale, self.bits, self.width, self.group)
        keep = self.rows - self.rows % self.group  # rows in complete groups stay as they are
        tail = self.dequantize()[..., keep:, :]
        new = pack(torch.cat([tail, x.float()], dim=-2), self.bits, self.group, self.data.dtype)
        kept_scale = self.scale[..., : keep // self.group, :]  # type: ignore[index]
        scale = torch.cat([kept_scale, new.scale], dim=-2)  # type: ignore[list-item]
        return Packed(
            torch.cat([self.data[..., :keep, :], new.data], dim=-2), scale, self.bits, self.width, self.group
        )


def pack(x: torch.Tensor, bits: int, group: int, dtype: torch.dtype) -> Packed:
    """Store ``x: [..., n, w]`` at ``bits`` (16: as ``dtype``; 8/4: symmetric integers).

    ``group > 0``: one scale per column for each ``group`` consecutive rows; ``group == 0``: one per row.
    """
    width = x.shape[-1]
    if bits == 16:
        return Packed(x.to(dtype).clone(memory_format=torch.contiguous_format), None, 16, width, group)
    if bits not in (8, 4):
        raise ValueError(f"bits={bits} is not supported; choose 16, 8 or 4")
    levels = 127 if bits == 8 else 7
    x = x.float()
    if group > 0:
        n = x.shape[-2]
        pad = (-n) % group
        amax = F.pad(x.abs(), (0, 0, 0, pad)).unflatten(-2, (-1, group)).amax(dim=-2)  # [..., ceil(n/g), w]
    else:
        amax = x.abs().amax(dim=-1, keepdim=True)  # [..., n, 1]
    scale = (amax / levels).clamp_min(_SCALE_MIN).to(SCALE_DTYPE)
    expanded = (
        scale.float().repeat_interleave(group, dim=-2)[..., : x.shape[-2], :] if group > 0 else scale.float()
    )
    q = torch.round(x / expanded).clamp(-levels, levels)
    data = q.to(torch.int8) if bits == 8 else _pack4(q)
    return Packed(data.contiguous(), scale.contiguous(), bits, width, group)


def fake_quantize(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``x`` after a round trip through :func:`pack` at ``bits`` (identity at 16 bits)."""
    if bits == 16:
        return x
    return pack(x, bits, group, x.dtype).dequantize(x.dtype)


def packed_bytes(rows: int, width: int, bits: int, group: int, element_size: int) -> int:
    """Bytes :func:`pack` would hold for a ``[rows, width]`` matrix (no leading dims)."""
    if rows == 0 or width == 0:
        return 0
    if bits == 16:
        return rows * width * element_size
    data = rows * width if bits == 8 else rows * ((width + 1) // 2)
    scales = (math.ceil(rows / group) * width if group > 0 else rows) * 2
    return data + scales


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """Integers in [-7, 7] ``[..., w]`` -> uint8 ``[..., ceil(w/2)]`` (low nibble: even columns)."""
    u = (q + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = F.pad(u, (0, 1), value=8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack4(data: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_pack4`, as ``dtype`` values ``[..., width]``: two uint8 masks, one interleave, one
    conversion (the decode-time path; several times faster on CPU than going through int16)."""
    nibbles = torch.stack([data & 15, data >> 4], dim=-1).flatten(-2)[..., :width]
    return nibbles.to(dtype).sub_(8)


# ------------------------------------------------------------------- per-token INT8 (DK-Cache's tiers)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 with one float32 scale per token: ``x: [..., D]`` -> ``(int8 [..., D], scale [..., 1])``."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
    return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_int8` (to ``dtype``)."""
    return (q.float() * scale).to(dtype)
