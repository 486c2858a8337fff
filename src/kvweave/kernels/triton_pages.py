"""Triton kernels for DK-Cache's far tier: page scoring by key summaries, and attention over chosen pages.

Two computations, each beside the torch reference it is tested against (``tests/kernels/test_triton_pages.py``,
under ``TRITON_INTERPRET=1`` without a GPU):

- :func:`page_upper_bounds`: the upper bound of ``q·k`` over each page, ``Σ_d max(q_d·min_d, q_d·max_d)``, of
  ``query: [B, H, n, D]`` (a KV head's query rows, packed) against the per-channel key summaries
  ``page_min, page_max: [B, H, P, D]`` -> ``[B, H, n, P]`` float32. Reference:
  :func:`page_upper_bounds_reference`, the same two-matmul formula as
  :func:`kvweave.methods.dkcache.far.page_upper_bounds`. :func:`page_scores` fuses the maximum over the
  rows that :meth:`kvweave.methods.dkcache.far.FarTier.retrieve` takes next (``.amax(2)``) -> ``[B, H, P]``,
  without writing the ``[B, H, n, P]`` bounds (reference: :func:`page_scores_reference`).
- :func:`page_attention`: softmax attention of ``query: [B, H, R, D]`` over the tokens of the pages
  ``page_index: [B, H, k]`` (int; an index outside ``[0, P)``, e.g. ``-1``, is a slot that joins nothing) of
  paged ``keys: [B, H, P, page, D]`` and ``values: [B, H, P, page, Dv]`` -- the far store
  ``[B, H, P*page, D]`` viewed by page, as :meth:`~kvweave.methods.dkcache.far.FarTier.pages_of` reads it,
  keys as attention sees them (already rotated). Keys and values are each either floating point or INT8
  with one float32 scale per token, ``key_scales / value_scales: [B, H, P, page, 1]``
  (:func:`kvweave.ops.quantize.quantize_int8`; the scale is folded into the logits / softmax weights instead
  of dequantizing). ``lengths: [B]`` (int, optional): paged tokens per row; token ``p*page + j`` of row ``b``
  exists only if it is below ``lengths[b]`` (the partial last page, rows of different lengths). Returns
  ``out: [B, H, R, Dv]`` float32 and ``lse: [B, H, R]`` float32, the natural-log log-sum-exp of the scaled
  logits (``-inf`` and ``out = 0`` for a row that sees nothing), to be merged with the other tiers by
  :func:`kvweave.ops.attention.merge_parts`. Reference: :func:`page_attention_reference` (gather the pages,
  dequantize, :func:`kvweave.kernels.triton_common.attention_with_lse`).

float32 queries use exact (``ieee``) float32 dot products; float16 / bfloat16 queries run the attention's dot
products in the query dtype (float32 accumulation). Page scores are always float32. :func:`page_scores` is
called by DK-Cache's far tier (:func:`kvweave.methods.dkcache.far.page_scores`, ``kernel=triton``, the default on
CUDA; imported lazily when chosen, :mod:`kvweave.kernels.registry`). :func:`page_attention` is not called by a
method yet: DK-Cache attends its retrieved pages beside the other tiers (RoPE compensation, decoupled steady
keys) in one masked softmax, which this kernel does not compute.
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

__all__ = [
    "available",
    "page_attention",
    "page_attention_reference",
    "page_scores",
    "page_scores_reference",
    "page_upper_bounds",
    "page_upper_bounds_reference",
    "unavailable_reason",
]

BLOCK_T = 64
"""Tokens per attention tile (tiles run over the chosen pages' tokens, across page boundaries)."""


def _require() -> None:
    if not available():
        raise RuntimeError(f"Triton kernels cannot run here: {unavailable_reason()}")


# ----------------------------------------------------------------------------------------------- page scores


def _check_summaries(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> None:
    b, h, _, d = query.shape
    if page_min.shape != page_max.shape or page_min.dim() != 4 or tuple(page_min.shape[:2]) != (b, h):
        raise ValueError(
            f"page summaries {tuple(page_min.shape)} / {tuple(page_max.shape)} do not fit query "
            f"{tuple(query.shape)} (expected [B, H, P, D])"
        )
    if page_min.shape[3] != d:
        raise ValueError(f"page summaries have {page_min.shape[3]} channels, the query {d}")


def page_upper_bounds_reference(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor
) -> torch.Tensor:
    """``Σ_d max(q_d·min_d, q_d·max_d)`` as two matmuls: ``[B, H, n, D]`` x ``[B, H, P, D]`` -> ``[B, H, n, P]``."""
    _check_summaries(query, page_min, page_max)
    q = query.float()
    return q.clamp(min=0) @ page_max.float().transpose(-1, -2) + q.clamp(max=0) @ page_min.float().transpose(
        -1, -2
    )


def page_scores_reference(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor
) -> torch.Tensor:
    """The largest upper bound over the query rows: ``[B, H, P]`` (``-inf`` if ``n == 0``)."""
    bounds = page_upper_bounds_reference(query, page_min, page_max)
    if bounds.shape[2] == 0:
        return bounds.new_full((bounds.shape[0], bounds.shape[1], bounds.shape[3]), float("-inf"))
    return bounds.amax(2)


def _bounds(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, reduce: bool
) -> torch.Tensor:
    _require()
    _check_summaries(query, page_min, page_max)
    b, h, n, d = query.shape
    pages = page_min.shape[2]
    shape = (b, h, pages) if reduce else (b, h, n, pages)
    if pages == 0 or n == 0 or d == 0:
        fill = float("-inf") if reduce and n == 0 else 0.0
        return torch.full(shape, fill, device=query.device, dtype=torch.float32)
    out = torch.empty(shape, device=query.device, dtype=torch.float32)
    block_n, block_p, block_d = block_size(n, 16, 32), block_size(pages, 16, 64), block_size(d, 16, 64)
    out_strides = (out.stride(0), out.stride(1), 0, out.stride(2)) if reduce else out.stride()
    grid = (b * h, -(-pages // block_p), 1 if reduce else -(-n // block_n))
    _page_bounds_kernel[grid](
        query,
        page_min,
        page_max,
        out,
        h,
        n,
        pages,
        d,
        *query.stride(),
        *page_min.stride(),
        *page_max.stride(),
        *out_strides,
        REDUCE=reduce,
        BLOCK_N=block_n,
        BLOCK_P=block_p,
        BLOCK_D=block_d,
    )
    return out


def page_upper_bounds(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q·k`` over each page in one Triton kernel: ``query: [B, H, n, D]``,
    ``page_min, page_max: [B, H, P, D]`` (any strides, e.g. ``[:, :, :count]`` of a larger buffer)
    -> ``[B, H, n, P]`` float32."""
    return _bounds(query, page_min, page_max, reduce=False)


def page_scores(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """``page_upper_bounds(query, page_min, page_max).amax(2)`` without the intermediate -> ``[B, H, P]``."""
    return _bounds(query, page_min, page_max, reduce=True)


# -------------------------------------------------------------------------------------------- page attention


def _page_layout(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_index: torch.Tensor,
    key_scales: torch.Tensor | None,
    value_scales: torch.Tensor | None,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Check shapes; the scales as ``[B, H, P, page]`` (``None`` where not quantized)."""
    b, h, _, d = query.shape
    if keys.dim() != 5 or tuple(keys.shape[:2]) != (b, h) or keys.shape[4] != d:
        raise ValueError(
            f"page_attention: keys {tuple(keys.shape)} do not fit query {tuple(query.shape)} "
            "(expected [B, H, P, page, D])"
        )
    if values.dim() != 5 or tuple(values.shape[:4]) != tuple(keys.shape[:4]):
        raise ValueError(
            f"page_attention: values {tuple(values.shape)} do not fit keys {tuple(keys.shape)} "
            "(expected [B, H, P, page, Dv])"
        )
    if page_index.dim() != 3 or tuple(page_index.shape[:2]) != (b, h):
        raise ValueError(f"page_attention: page_index {tuple(page_index.shape)} is not [B, H, k]")
    if lengths is not None and tuple(lengths.shape) != (b,):
        raise ValueError(f"page_attention: lengths {tuple(lengths.shape)} is not [B]")
    scales = []
    for name, tensor, scale in (("keys", keys, key_scales), ("values", values, value_scales)):
        if (tensor.dtype == torch.int8) != (scale is not None):
            raise ValueError(
                f"page_attention: {name} are {tensor.dtype}: INT8 {name} need scales, others none"
            )
        scales.append(None if scale is None else scale.reshape(tensor.shape[:4]))
    return scales[0], scales[1]


def page_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_index: torch.Tensor,
    scaling: float,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    *,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`page_attention` in torch: gather the chosen pages, dequantize, masked softmax (``splits``
    ignored)."""
    k_scale, v_scale = _page_layout(query, keys, values, page_index, key_scales, value_scales, lengths)
    b, h, pages, size, _ = keys.shape
    chosen = page_index.shape[2]
    real = (page_index >= 0) & (page_index < pages)  # [B, H, k]
    index = page_index.clamp(0, max(pages - 1, 0)).long()

    def take(tensor: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        width = tensor.shape[4]
        picked = tensor.gather(2, index.view(b, h, chosen, 1, 1).expand(b, h, chosen, size, width)).float()
        if scale is not None:
            picked = picked * scale.gather(2, index.view(b, h, chosen, 1).expand(-1, -1, -1, size)).unsqueeze(
                -1
            )
        return picked.reshape(b, h, chosen * size, width)

    ok = real.unsqueeze(-1).expand(b, h, chosen, size)
    if lengths is not None:
        token = index.unsqueeze(-1) * size + torch.arange(size, device=keys.device)  # [B, H, k, page]
        ok = ok & (token < lengths.to(keys.device).view(b, 1, 1, 1))
    visible = ok.reshape(b, h, 1, chosen * size)
    return attention_with_lse(query, take(keys, k_scale), take(values, v_scale), visible, scaling)


def page_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_index: torch.Tensor,
    scaling: float,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    *,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query: [B, H, R, D]`` over the tokens of pages ``page_index: [B, H, k]`` of paged
    ``keys: [B, H, P, page, D]``, ``values: [B, H, P, page, Dv]`` (any strides; INT8 with ``key_scales /
    value_scales: [B, H, P, page, 1]`` float32) in one Triton kernel -> ``out: [B, H, R, Dv]`` float32,
    ``lse: [B, H, R]`` float32. ``splits``: parts the chosen tokens are split into (``None``: fill the GPU)."""
    _require()
    k_scale, v_scale = _page_layout(query, keys, values, page_index, key_scales, value_scales, lengths)
    b, h, r, d = query.shape
    pages, size, dv = keys.shape[2], keys.shape[3], values.shape[4]
    tokens = page_index.shape[2] * size
    device = query.device
    if tokens == 0 or r == 0 or pages == 0:
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
    count = -(-tiles // per_split)
    index = page_index.contiguous()
    dummy = q  # stands for an absent tensor; never read
    out = torch.empty(b * h, count, r, dv, device=device, dtype=torch.float32)
    lse = torch.empty(b * h, count, r, device=device, dtype=torch.float32)
    _page_attention_kernel[(b * h, row_blocks, count)](
        q,
        keys,
        values,
        k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy,
        index,
        lengths.to(device) if lengths is not None else dummy,
        out,
        lse,
        h,
        r,
        d,
        dv,
        pages,
        size,
        page_index.shape[2],
        tokens,
        per_split * BLOCK_T,
        *keys.stride()[:4],
        keys.stride(4),
        *values.stride()[:4],
        values.stride(4),
        *(k_scale.stride() if k_scale is not None else (0, 0, 0, 0)),
        *(v_scale.stride() if v_scale is not None else (0, 0, 0, 0)),
        float(scaling),
        KEY_INT8=k_scale is not None,
        VALUE_INT8=v_scale is not None,
        HAS_LENGTHS=lengths is not None,
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
    def _page_bounds_kernel(
        q_ptr,
        lo_ptr,
        hi_ptr,
        out_ptr,
        H,
        N,
        P,
        D,
        q_sb,
        q_sh,
        q_sn,
        q_sd,
        lo_sb,
        lo_sh,
        lo_sp,
        lo_sd,
        hi_sb,
        hi_sh,
        hi_sp,
        hi_sd,
        out_sb,
        out_sh,
        out_sn,
        out_sp,
        REDUCE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        b = bh // H
        h = bh % H
        pages = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        page_ok = pages < P
        if REDUCE:  # every row block, keeping the maximum
            row_start = 0
            row_end = N
        else:
            row_start = tl.program_id(2) * BLOCK_N
            row_end = tl.minimum(row_start + BLOCK_N, N)
        best = tl.full([BLOCK_P], float("-inf"), tl.float32)
        for n0 in range(row_start, row_end, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            row_ok = rows < row_end
            acc = tl.zeros([BLOCK_N, BLOCK_P], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                d_ok = d < D
                q = tl.load(
                    q_ptr + b * q_sb + h * q_sh + rows[:, None] * q_sn + d[None, :] * q_sd,
                    mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                s_mask = page_ok[:, None] & d_ok[None, :]
                lo = tl.load(
                    lo_ptr + b * lo_sb + h * lo_sh + pages[:, None] * lo_sp + d[None, :] * lo_sd,
                    mask=s_mask,
                    other=0.0,
                ).to(tl.float32)
                hi = tl.load(
                    hi_ptr + b * hi_sb + h * hi_sh + pages[:, None] * hi_sp + d[None, :] * hi_sd,
                    mask=s_mask,
                    other=0.0,
                ).to(tl.float32)
                acc += tl.dot(tl.maximum(q, 0.0), tl.trans(hi), input_precision="ieee")
                acc += tl.dot(tl.minimum(q, 0.0), tl.trans(lo), input_precision="ieee")
            if REDUCE:
                best = tl.maximum(best, tl.max(tl.where(row_ok[:, None], acc, float("-inf")), 0))
            else:
                tl.store(
                    out_ptr + b * out_sb + h * out_sh + rows[:, None] * out_sn + pages[None, :] * out_sp,
                    acc,
                    mask=row_ok[:, None] & page_ok[None, :],
                )
        if REDUCE:
            tl.store(out_ptr + b * out_sb + h * out_sh + pages * out_sp, best, mask=page_ok)

    @triton.jit
    def _page_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        index_ptr,
        len_ptr,
        out_ptr,
        lse_ptr,
        H,
        R,
        D,
        DV,
        P,
        PAGE,
        K,
        TOKENS,
        SPLIT_TOKENS,
        k_sb,
        k_sh,
        k_sp,
        k_st,
        k_sd,
        v_sb,
        v_sh,
        v_sp,
        v_st,
        v_sd,
        ks_sb,
        ks_sh,
        ks_sp,
        ks_st,
        vs_sb,
        vs_sh,
        vs_sp,
        vs_st,
        scaling,
        KEY_INT8: tl.constexpr,
        VALUE_INT8: tl.constexpr,
        HAS_LENGTHS: tl.constexpr,
        LOW_PRECISION: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
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
        if HAS_LENGTHS:
            length = tl.load(len_ptr + b).to(tl.int64)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
        start = split * SPLIT_TOKENS
        end = tl.minimum(start + SPLIT_TOKENS, TOKENS)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)  # position among the chosen pages' tokens
            t_ok = t < end
            page = tl.load(index_ptr + bh * K + t // PAGE, mask=t_ok, other=-1).to(tl.int64)
            offset = t % PAGE
            ok = t_ok & (page >= 0) & (page < P)
            if HAS_LENGTHS:
                ok = ok & (page * PAGE + offset < length)
            page = tl.where(ok, page, 0)
            k_mask = ok[:, None] & d_ok[None, :]
            k = tl.load(
                k_ptr
                + b * k_sb
                + h * k_sh
                + page[:, None] * k_sp
                + offset[:, None] * k_st
                + d[None, :] * k_sd,
                mask=k_mask,
                other=0.0,
            )
            if LOW_PRECISION:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            else:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            if KEY_INT8:  # per-token scale folded into the logits
                k_scale = tl.load(
                    ks_ptr + b * ks_sb + h * ks_sh + page * ks_sp + offset * ks_st, mask=ok, other=0.0
                ).to(tl.float32)
                s = s * k_scale[None, :]
            s = tl.where(ok[None, :], s * scaling, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: nothing to rescale
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr
                + b * v_sb
                + h * v_sh
                + page[:, None] * v_sp
                + offset[:, None] * v_st
                + dv[None, :] * v_sd,
                mask=ok[:, None] & dv_ok[None, :],
                other=0.0,
            )
            if VALUE_INT8:  # per-token scale folded into the softmax weights
                v_scale = tl.load(
                    vs_ptr + b * vs_sb + h * vs_sh + page * vs_sp + offset * vs_st, mask=ok, other=0.0
                ).to(tl.float32)
                pv = p * v_scale[None, :]
            else:
                pv = p
            if LOW_PRECISION:
                acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype))
            else:
                acc = acc * alpha[:, None] + tl.dot(pv, v.to(tl.float32), input_precision="ieee")
            m_i = m_new
        seen_any = l_i > 0
        result = acc / tl.where(seen_any, l_i, 1.0)[:, None]
        part = (bh * splits + split) * R + rows  # index into [B*H, splits, R]
        tl.store(out_ptr + part[:, None] * DV + dv[None, :], result, mask=row_ok[:, None] & dv_ok[None, :])
        lse = tl.where(seen_any, m_i + tl.log(tl.where(seen_any, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_ok)
