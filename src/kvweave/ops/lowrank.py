"""Low-rank helpers (DepthWeave-KV's bases, coefficients and residual rows).

- :func:`top_basis`: the leading right singular vectors of a tall matrix ``x: [n, w]`` (token-side bases come
  from ``x @ V``). For ``w`` up to 2048 it diagonalises the Gram ``xᵀx`` (``O(n·w²)``; several times faster on
  CPU than an SVD of ``x``, and only the leading, well-separated directions matter); wider matrices use
  randomized ``torch.svd_lowrank``.

Integer storage of bases, coefficients and residual rows is :class:`kvweave.ops.quantize.Packed`.
"""

from __future__ import annotations

import torch


def top_basis(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``V: [w, r]`` orthonormal leading right singular vectors of ``x: [n, w]`` and ``s: [r]`` (descending).

    ``r = min(rank, n, w)``; float32.
    """
    n, w = x.shape
    r = max(1, min(rank, n, w))
    if w <= 2048:
        x = x.float()
        values, vectors = torch.linalg.eigh(x.T @ x)  # [w, w] Gram, ascending eigenvalues
        values, vectors = values.flip(0)[:r], vectors.flip(1)[:, :r]
        return vectors.contiguous(), values.clamp_min(0).sqrt()
    u, s, v = torch.svd_lowrank(x.float(), q=min(r + 10, n, w), niter=3)
    return v[:, :r].contiguous(), s[:r]


def orthonormal_columns(x: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis ``[w, k]`` of the column span of ``x: [w, c]`` (null directions dropped)."""
    u, s, _ = torch.linalg.svd(x.double(), full_matrices=False)
    keep = s > s.max().clamp_min(1e-30) * 1e-7
    return u[:, keep].float()
