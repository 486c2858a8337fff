"""Triton kernels for DepthWeave's selective decode: rebuild, rotate and score only the chosen tokens, and weight
their value coordinates, straight from the packed INT4 / INT8 coordinates (the seed's fused kernel, on GPUs).

The same two operations as the fused C++ kernel (:mod:`kvweave.kernels.cpu_factor`), with the same arguments:

- :func:`factor_logits`: for KV head ``h`` and chosen row ``t``, ``k = RoPE(p_t)(c_t · R_k[:, h])`` (``c_t`` the
  row's dequantized key coordinates, ``R_k: [w, H, D]``) and ``logits[h, g, t] = q[h, g] · k``. A program
  rebuilds a tile of keys in registers, in two halves (``R_k``'s first and second ``D / 2`` columns), which is
  all RoPE's ``rotate_half`` needs, and scores it against the KV head's query heads: no key is written.
- :func:`factor_weighted`: ``out[h, g] = Σ_t P[h, g, t] · c^v_t`` (the caller multiplies by ``R_v`` once).

The torch path of :mod:`kvweave.methods.depthweave.select` (gather the rows, dequantize, matmul, rotate) is the
reference: ``tests/kernels/test_triton_factor.py`` checks these kernels against it op by op over a sweep of
shapes, and through ``make_cache`` + ``model.generate`` with ``depthweave:kernel=triton`` (the interpreter on a
CPU, ``TRITON_INTERPRET=1``, float32). Coordinates are float32 after dequantization; the dots run in IEEE
float32 (no TF32), so the GPU path scores as the torch path does.
"""

from __future__ import annotations

from typing import Any

import torch

from kvweave.kernels.triton_common import HAVE_TRITON, block_size
from kvweave.kernels.triton_common import available as available
from kvweave.kernels.triton_common import unavailable_reason as unavailable_reason

BLOCK_T = 32
"""Chosen tokens per tile."""
BLOCK_W = 16
"""Coordinate columns per step of the rebuild."""


def supports(packed: Any) -> bool:
    """Whether coordinates stored as ``packed`` (a :class:`kvweave.ops.quantize.Packed`) can be read here:
    INT4 / INT8 with float16 per-column scales over row groups, on CUDA (or on the CPU under the interpreter)."""
    return (
        packed.bits in (4, 8)
        and packed.group > 0
        and packed.data.dim() == 2
        and packed.data.device.type in ("cuda", "cpu")
        and packed.scale is not None
        and packed.scale.dtype == torch.float16
    )


def _require() -> None:
    if not available():
        raise RuntimeError(f"Triton factor kernels cannot run: {unavailable_reason()}")


def _raw(packed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return packed.data.contiguous().view(torch.uint8), packed.scale.contiguous()


def factor_logits(
    query: torch.Tensor,
    packed: Any,
    r_k: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
) -> torch.Tensor:
    """``query: [H, G, D]``, key coordinates ``packed`` (``[n, w]``), ``r_k: [w', H, D]`` (``w' <= w``),
    ``rows: [H, T]``, ``positions: [n]`` with the ``cos, sin: [P, D]`` table (``None``: no rotation) ->
    ``[H, G, T]`` unscaled logits, float32."""
    _require()
    heads, groups, dim = query.shape
    tokens, width = rows.shape[1], r_k.shape[0]
    if dim % 2:
        raise ValueError(f"factor_logits: head dim {dim} is odd; RoPE halves need an even one")
    if r_k.shape[1:] != (heads, dim) or width > packed.width or rows.shape[0] != heads:
        raise ValueError(
            f"factor_logits: r_k {tuple(r_k.shape)}, rows {tuple(rows.shape)} do not fit query "
            f"{tuple(query.shape)} and coordinates of width {packed.width}"
        )
    out = torch.empty(heads, groups, tokens, device=query.device, dtype=torch.float32)
    if tokens == 0 or heads == 0:
        return out
    data, scale = _raw(packed)
    rotate = positions is not None and cos is not None and sin is not None
    q = query.float().contiguous()
    dummy = q  # stands for an absent tensor; never read
    _factor_logits_kernel[(heads, -(-tokens // BLOCK_T))](
        q,
        data,
        scale,
        r_k.float().contiguous(),
        rows.to(torch.int64).contiguous(),
        positions.to(torch.int32).contiguous() if rotate else dummy,  # type: ignore[union-attr]
        cos.float().contiguous() if rotate else dummy,  # type: ignore[union-attr]
        sin.float().contiguous() if rotate else dummy,  # type: ignore[union-attr]
        out,
        heads,
        groups,
        tokens,
        dim,
        dim // 2,
        width,
        data.shape[1],
        scale.shape[1],
        packed.group,
        BITS=packed.bits,
        ROTATE=rotate,
        BLOCK_G=block_size(groups, 16, 64),
        BLOCK_T=BLOCK_T,
        BLOCK_W=BLOCK_W,
        BLOCK_HALF=block_size(dim // 2, 16, 256),
    )
    return out


def factor_weighted(probs: torch.Tensor, packed: Any, rows: torch.Tensor) -> torch.Tensor:
    """``probs: [H, G, T]`` over rows ``rows: [H, T]`` of the value coordinates ``packed`` -> ``[H, G, w]``
    float32."""
    _require()
    heads, groups, tokens = probs.shape
    width = packed.width
    if rows.shape != (heads, tokens):
        raise ValueError(f"factor_weighted: rows {tuple(rows.shape)} do not fit probs {tuple(probs.shape)}")
    out = torch.zeros(heads, groups, width, device=probs.device, dtype=torch.float32)
    if tokens == 0 or heads == 0 or width == 0:
        return out
    data, scale = _raw(packed)
    _factor_weighted_kernel[(heads, -(-width // BLOCK_W))](
        probs.float().contiguous(),
        data,
        scale,
        rows.to(torch.int64).contiguous(),
        out,
        groups,
        tokens,
        width,
        data.shape[1],
        scale.shape[1],
        packed.group,
        BITS=packed.bits,
        BLOCK_G=block_size(groups, 16, 64),
        BLOCK_T=BLOCK_T,
        BLOCK_W=BLOCK_W,
    )
    return out


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _coordinates(data_ptr, scale_ptr, row, t_ok, j, j_ok, BYTES, SCALE_W, GROUP, BITS: tl.constexpr):
        """``[BLOCK_T, BLOCK_W]`` float32: columns ``j`` of rows ``row``, dequantized (0 where masked)."""
        mask = t_ok[:, None] & j_ok[None, :]
        if BITS == 4:  # two per byte, low nibble first, value - 8
            byte = tl.load(data_ptr + row[:, None] * BYTES + (j // 2)[None, :], mask=mask, other=0)
            code = ((byte.to(tl.int32) >> ((j % 2) * 4)[None, :]) & 15) - 8
        else:  # int8 held as uint8
            byte = tl.load(data_ptr + row[:, None] * BYTES + j[None, :], mask=mask, other=0).to(tl.int32)
            code = tl.where(byte >= 128, byte - 256, byte)
        scale = tl.load(scale_ptr + (row // GROUP)[:, None] * SCALE_W + j[None, :], mask=mask, other=0.0)
        return code.to(tl.float32) * scale.to(tl.float32)

    @triton.jit
    def _factor_logits_kernel(
        q_ptr,
        data_ptr,
        scale_ptr,
        r_ptr,
        rows_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        H,
        G,
        T,
        D,
        HALF,
        W,
        BYTES,
        SCALE_W,
        GROUP,
        BITS: tl.constexpr,
        ROTATE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        h = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        row = tl.load(rows_ptr + h * T + t, mask=t_ok, other=0)
        e = tl.arange(0, BLOCK_HALF)
        e_ok = e < HALF
        low = tl.zeros([BLOCK_T, BLOCK_HALF], tl.float32)  # the keys' first D/2 columns
        high = tl.zeros([BLOCK_T, BLOCK_HALF], tl.float32)  # and their last D/2
        for j0 in range(0, W, BLOCK_W):
            j = j0 + tl.arange(0, BLOCK_W)
            j_ok = j < W
            coords = _coordinates(data_ptr, scale_ptr, row, t_ok, j, j_ok, BYTES, SCALE_W, GROUP, BITS)
            basis = r_ptr + (j[:, None] * H + h) * D + e[None, :]
            r_mask = j_ok[:, None] & e_ok[None, :]
            low += tl.dot(coords, tl.load(basis, mask=r_mask, other=0.0), input_precision="ieee")
            high += tl.dot(coords, tl.load(basis + HALF, mask=r_mask, other=0.0), input_precision="ieee")
        if ROTATE:  # rotate_half: [x1, x2] -> [x1·cos - x2·sin, x2·cos + x1·sin]
            pos = tl.load(pos_ptr + row, mask=t_ok, other=0).to(tl.int64)
            at = pos[:, None] * D + e[None, :]
            c_mask = t_ok[:, None] & e_ok[None, :]
            cos_low = tl.load(cos_ptr + at, mask=c_mask, other=0.0)
            cos_high = tl.load(cos_ptr + at + HALF, mask=c_mask, other=0.0)
            sin_low = tl.load(sin_ptr + at, mask=c_mask, other=0.0)
            sin_high = tl.load(sin_ptr + at + HALF, mask=c_mask, other=0.0)
            rotated_low = low * cos_low - high * sin_low
            high = high * cos_high + low * sin_high
            low = rotated_low
        g = tl.arange(0, BLOCK_G)
        g_ok = g < G
        q_at = q_ptr + (h * G + g[:, None]) * D + e[None, :]
        q_mask = g_ok[:, None] & e_ok[None, :]
        q_low = tl.load(q_at, mask=q_mask, other=0.0)
        q_high = tl.load(q_at + HALF, mask=q_mask, other=0.0)
        logits = tl.dot(q_low, tl.trans(low), input_precision="ieee")
        logits += tl.dot(q_high, tl.trans(high), input_precision="ieee")
        tl.store(out_ptr + (h * G + g[:, None]) * T + t[None, :], logits, mask=g_ok[:, None] & t_ok[None, :])

    @triton.jit
    def _factor_weighted_kernel(
        p_ptr,
        data_ptr,
        scale_ptr,
        rows_ptr,
        out_ptr,
        G,
        T,
        W,
        BYTES,
        SCALE_W,
        GROUP,
        BITS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        h = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        j_ok = j < W
        g = tl.arange(0, BLOCK_G)
        g_ok = g < G
        acc = tl.zeros([BLOCK_G, BLOCK_W], tl.float32)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_ok = t < T
            row = tl.load(rows_ptr + h * T + t, mask=t_ok, other=0)
            coords = _coordinates(data_ptr, scale_ptr, row, t_ok, j, j_ok, BYTES, SCALE_W, GROUP, BITS)
            probs = tl.load(
                p_ptr + (h * G + g[:, None]) * T + t[None, :], mask=g_ok[:, None] & t_ok[None, :], other=0.0
            )
            acc += tl.dot(probs, coords, input_precision="ieee")
        tl.store(out_ptr + (h * G + g[:, None]) * W + j[None, :], acc, mask=g_ok[:, None] & j_ok[None, :])
