"""Triton kernel for ``quant`` (KIVI) decode attention over packed key/value blocks, dequantizing in registers.

:func:`quant_attention` computes, for every batch row ``b`` and KV head ``h``, softmax attention of the packed
query rows ``query[b, h]: [R, D]`` (``R`` = query heads of the KV head's group x new queries, packed as
:meth:`kvweave.methods.quant.QuantLayer.chunked_attention` packs them) over the ``T = n*G`` tokens of ``n``
quantized blocks of ``G`` tokens, stored exactly as :class:`kvweave.ops.kivi.Blocks` holds them:

- ``key_codes: [B, H, n, D, G*bits/8]`` uint8, channel-major, packed along the block's tokens in split order
  (:func:`kvweave.ops.quantize.pack_codes_split`: byte ``i`` of a channel holds tokens ``i, i + G/P, ..`` at
  bit offsets ``0, bits, ..``, ``P = 8 // bits``); ``key_scale, key_min: [B, H, n, 1, D]`` (float16, per
  block and channel);
- ``value_codes: [B, H, n, G, Dv*bits/8]`` uint8, packed along channels (:func:`kvweave.ops.quantize.pack_codes`:
  channel ``c`` at byte ``c // P``, bit offset ``(c % P) * bits``); ``value_scale, value_min:
  [B, H, n, G, Dv/cg]`` (float16, per token and group of ``cg`` channels).

A key is ``code * scale + min`` per channel, a value ``code * scale + min`` per token and channel group
(:func:`kvweave.ops.quantize.dequantize`); no dequantized tensor is written to memory. ``visible: [B, H or 1,
R, T]`` (bool, ``None``: every token) masks tokens per row (empty block slots of a padded batch row, a custom
attention mask). Returns ``out: [B, H, R, Dv]`` float32 and ``lse: [B, H, R]`` float32, the natural-log
log-sum-exp of the scaled logits (``-inf`` and ``out = 0`` for a row that sees nothing), so the exact recent
tail can be added with :func:`kvweave.ops.attention.merge_parts` (after ``view(B, H, groups, q, Dv)`` as the
layer does).

The grid is ``(B*H, row blocks, splits)``: long caches are split along the tokens (flash-decoding) and the
splits' partials merged by their log-sum-exp (:func:`kvweave.kernels.triton_common.merge_splits`). float32
queries use exact (``ieee``) float32 dot products; float16 / bfloat16 queries cast the dequantized tiles to the
query dtype for the tensor cores (float32 accumulation).

Reference: :func:`quant_attention_reference` (unpack + dequantize in torch, then
:func:`kvweave.kernels.triton_common.attention_with_lse`), the same arithmetic as
:func:`kvweave.ops.kivi.dequantize_blocks`. Tests: ``tests/kernels/test_triton_quant.py`` (under
``TRITON_INTERPRET=1`` without a GPU), including through ``make_cache`` + ``model.generate``. Called by
:class:`kvweave.methods.quant.QuantLayer` (``kernel=triton``, the default on CUDA), imported lazily when chosen
(:mod:`kvweave.kernels.registry`).
"""

from __future__ import annotations

import torch

from kvweave.kernels.triton_common import (
    HAVE_TRITON,
    attention_with_lse,
    available,
    block_size,
    merge_splits,
    split_count,
    unavailable_reason,
)
from kvweave.ops.quantize import dequantize, unpack_codes, unpack_codes_split

__all__ = ["available", "quant_attention", "quant_attention_reference", "unavailable_reason"]

BLOCK_T = 64
"""Tokens per tile (any block size ``G``: tiles cross block boundaries)."""


def _shapes(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    bits: int,
) -> tuple[int, int, int, int]:
    """``(G, T, Dv, cg)`` after checking the packed shapes against ``query``."""
    if bits not in (2, 4, 8):
        raise ValueError(f"quant_attention: bits must be 2, 4 or 8, got {bits}")
    per_byte = 8 // bits
    b, h, _, d = query.shape
    if key_codes.dim() != 5 or tuple(key_codes.shape[:2]) != (b, h) or key_codes.shape[3] != d:
        raise ValueError(
            f"quant_attention: key_codes {tuple(key_codes.shape)} do not fit query {tuple(query.shape)} "
            "(expected [B, H, n, D, G*bits/8])"
        )
    n, group = key_codes.shape[2], key_codes.shape[4] * per_byte
    if value_codes.dim() != 5 or tuple(value_codes.shape[:4]) != (b, h, n, group):
        raise ValueError(
            f"quant_attention: value_codes {tuple(value_codes.shape)} do not fit key_codes "
            f"{tuple(key_codes.shape)} (expected [B, H, n, G, Dv*bits/8])"
        )
    dv = value_codes.shape[4] * per_byte
    if dv % value_scale.shape[-1]:
        raise ValueError(f"quant_attention: {value_scale.shape[-1]} value groups do not divide Dv={dv}")
    return group, n * group, dv, dv // value_scale.shape[-1]


def quant_attention_reference(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_min: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_min: torch.Tensor,
    bits: int,
    scaling: float,
    visible: torch.Tensor | None = None,
    *,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quant_attention` in torch: dequantize every block, then softmax attention (``splits`` ignored)."""
    _shapes(query, key_codes, value_codes, value_scale, bits)
    codes = unpack_codes_split(key_codes, bits).transpose(-1, -2)  # [B, H, n, G, D]
    keys = dequantize(codes, key_scale, key_min)
    b, h, n, g, d = keys.shape
    vcodes = unpack_codes(value_codes, bits).float().view(b, h, n, g, value_scale.shape[-1], -1)
    values = dequantize(vcodes, value_scale.unsqueeze(-1), value_min.unsqueeze(-1)).reshape(b, h, n * g, -1)
    return attention_with_lse(query, keys.reshape(b, h, n * g, d), values, visible, scaling)


def quant_attention(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_min: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_min: torch.Tensor,
    bits: int,
    scaling: float,
    visible: torch.Tensor | None = None,
    *,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query: [B, H, R, D]`` over quantized blocks (shapes in the module docstring) in one
    Triton kernel -> ``out: [B, H, R, Dv]`` float32, ``lse: [B, H, R]`` float32.

    ``splits``: how many parts the token axis is split into (``None``: enough to fill the GPU).
    """
    if not available():
        raise RuntimeError(f"quant_attention: Triton kernels cannot run here: {unavailable_reason()}")
    group, tokens, dv, cg = _shapes(query, key_codes, value_codes, value_scale, bits)
    b, h, r, d = query.shape
    device = query.device
    if tokens == 0 or r == 0:
        return (
            torch.zeros(b, h, r, dv, device=device),
            torch.full((b, h, r), float("-inf"), device=device),
        )
    low_precision = query.dtype in (torch.float16, torch.bfloat16)
    q = query.contiguous() if low_precision else query.float().contiguous()
    block_r, block_d, block_dv = block_size(r, 16, 64), block_size(d, 16, 256), block_size(dv, 16, 256)
    row_blocks = -(-r // block_r)
    tiles = -(-tokens // BLOCK_T)
    count = split_count(b * h * row_blocks, tiles, device, splits)
    per_split = -(-tiles // count)
    count = -(-tiles // per_split)  # no empty split
    if visible is not None:
        vis = visible.view(torch.uint8) if visible.dtype == torch.bool else visible.to(torch.uint8)
        vis = vis.expand(b, h, r, tokens)
        strides = vis.stride()
    else:
        vis, strides = q, (0, 0, 0, 0)  # never read
    out = torch.empty(b * h, count, r, dv, device=device, dtype=torch.float32)
    lse = torch.empty(b * h, count, r, device=device, dtype=torch.float32)
    _quant_attention_kernel[(b * h, row_blocks, count)](
        q,
        key_codes.contiguous(),
        key_scale.contiguous(),
        key_min.contiguous(),
        value_codes.contiguous(),
        value_scale.contiguous(),
        value_min.contiguous(),
        vis,
        out,
        lse,
        h,
        r,
        tokens,
        d,
        dv,
        value_codes.shape[-1],
        value_scale.shape[-1],
        cg,
        key_codes.shape[2],
        per_split * BLOCK_T,
        *strides,
        float(scaling),
        BITS=bits,
        G=group,
        HAS_VISIBLE=visible is not None,
        LOW_PRECISION=low_precision,
        BLOCK_R=block_r,
        BLOCK_T=BLOCK_T,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
    )
    merged, total = merge_splits(out, lse)
    return merged.view(b, h, r, dv), total.view(b, h, r)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _quant_attention_kernel(
        q_ptr,
        kc_ptr,
        ks_ptr,
        km_ptr,
        vc_ptr,
        vs_ptr,
        vm_ptr,
        vis_ptr,
        out_ptr,
        lse_ptr,
        H,
        R,
        T,
        D,
        DV,
        W,
        VGROUPS,
        CG,
        NBLOCKS,
        SPLIT_TOKENS,
        vis_sb,
        vis_sh,
        vis_sr,
        vis_st,
        scaling,
        BITS: tl.constexpr,
        G: tl.constexpr,
        HAS_VISIBLE: tl.constexpr,
        LOW_PRECISION: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        PER_BYTE: tl.constexpr = 8 // BITS
        GP: tl.constexpr = G // PER_BYTE  # bytes per channel of a key block
        MASK: tl.constexpr = (1 << BITS) - 1
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        b = bh // H
        h = bh % H
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        dv = tl.arange(0, BLOCK_DV)
        dv_ok = dv < DV
        q = tl.load(
            q_ptr + bh * R * D + rows[:, None] * D + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        key_base = bh * NBLOCKS * D
        value_base = bh * T
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
        start = split * SPLIT_TOKENS
        end = tl.minimum(start + SPLIT_TOKENS, T)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_ok = t < end
            blk = t // G
            g = t % G
            # keys [BLOCK_T, BLOCK_D]: token g of a block is at byte g % GP of its channel, bits (g // GP)*BITS
            k_mask = t_ok[:, None] & d_ok[None, :]
            channel = key_base + blk[:, None] * D + d[None, :]  # index into [B*H, n, D]
            byte = tl.load(kc_ptr + channel * GP + (g % GP)[:, None], mask=k_mask, other=0)
            code = (byte.to(tl.int32) >> ((g // GP) * BITS)[:, None]) & MASK
            k_scale = tl.load(ks_ptr + channel, mask=k_mask, other=0.0).to(tl.float32)
            k_min = tl.load(km_ptr + channel, mask=k_mask, other=0.0).to(tl.float32)
            k = code.to(tl.float32) * k_scale + k_min
            if LOW_PRECISION:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            else:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            s = s * scaling
            if HAS_VISIBLE:
                seen = tl.load(
                    vis_ptr + b * vis_sb + h * vis_sh + rows[:, None] * vis_sr + t[None, :] * vis_st,
                    mask=row_ok[:, None] & t_ok[None, :],
                    other=0,
                )
                s = tl.where((seen != 0) & t_ok[None, :], s, float("-inf"))
            else:
                s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: nothing to rescale
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            # values [BLOCK_T, BLOCK_DV]: channel c at byte c // PER_BYTE, bits (c % PER_BYTE)*BITS
            v_mask = t_ok[:, None] & dv_ok[None, :]
            token = value_base + t[:, None]  # index into [B*H, T]
            vbyte = tl.load(vc_ptr + token * W + (dv // PER_BYTE)[None, :], mask=v_mask, other=0)
            vcode = (vbyte.to(tl.int32) >> ((dv % PER_BYTE) * BITS)[None, :]) & MASK
            v_group = token * VGROUPS + (dv // CG)[None, :]
            v_scale = tl.load(vs_ptr + v_group, mask=v_mask, other=0.0).to(tl.float32)
            v_min = tl.load(vm_ptr + v_group, mask=v_mask, other=0.0).to(tl.float32)
            v = vcode.to(tl.float32) * v_scale + v_min
            if LOW_PRECISION:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        seen_any = l_i > 0
        result = acc / tl.where(seen_any, l_i, 1.0)[:, None]
        part = (bh * splits + split) * R + rows  # index into [B*H, splits, R]
        tl.store(out_ptr + part[:, None] * DV + dv[None, :], result, mask=row_ok[:, None] & dv_ok[None, :])
        lse = tl.where(seen_any, m_i + tl.log(tl.where(seen_any, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_ok)
