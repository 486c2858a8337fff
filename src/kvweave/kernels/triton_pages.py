"""Triton kernel for DK-Cache's far tier: page scoring by key summaries.

Beside the torch reference it is tested against (``tests/kernels/test_triton_pages.py``, under
``TRITON_INTERPRET=1`` without a GPU):

- :func:`page_upper_bounds`: the upper bound of ``q·k`` over each page, ``Σ_d max(q_d·min_d, q_d·max_d)``, of
  ``query: [B, H, n, D]`` (a KV head's query rows, packed) against the per-channel key summaries
  ``page_min, page_max: [B, H, P, D]`` -> ``[B, H, n, P]`` float32. Reference:
  :func:`page_upper_bounds_reference`, the same two-matmul formula as
  :func:`kvweave.methods.dkcache.far.page_upper_bounds`. :func:`page_scores` fuses the maximum over the
  rows that :meth:`kvweave.methods.dkcache.far.FarTier.retrieve` takes next (``.amax(2)``) -> ``[B, H, P]``,
  without writing the ``[B, H, n, P]`` bounds (reference: :func:`page_scores_reference`).

Page scores are always float32. :func:`page_scores` is called by DK-Cache's far tier
(:func:`kvweave.methods.dkcache.far.page_scores`, ``kernel=triton``, the default on CUDA; imported lazily when
chosen, :mod:`kvweave.kernels.registry`).

There is no Triton attention over the chosen pages: DK-Cache attends its retrieved pages beside its other tiers
(RoPE compensation, decoupled steady keys, the entropy its temperature control reads) in one masked softmax,
which a page-attention kernel does not compute; such a kernel was written, no method could call it, so it was
removed.
"""

from __future__ import annotations

import torch

from kvweave.kernels.triton_common import (
    HAVE_TRITON,
    available,
    block_size,
    unavailable_reason,
)

__all__ = [
    "available",
    "page_scores",
    "page_scores_reference",
    "page_upper_bounds",
    "page_upper_bounds_reference",
    "unavailable_reason",
]


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
