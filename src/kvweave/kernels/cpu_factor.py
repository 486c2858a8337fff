"""Fused CPU kernel for DepthWeave's selective decode: rebuild, rotate and score only the chosen tokens, and
weight their value coordinates, straight from the INT4 / INT8 coordinates (the seed's fused kernel, for CPUs).

For KV head ``h`` and chosen row ``t`` of a segment: ``k = RoPE(p_t)(c_t · R_k[:, h])`` (``c_t`` the row's
dequantized key coordinates, ``R_k: [w, H, D]``), ``logits[h, g, t] = q[h, g] · k``; and ``out[h, g] = Σ_t
P[h, g, t] · c^v_t`` (the value coordinates; the caller multiplies by ``R_v`` once). No coordinate, key or value
tensor of the chosen tokens is written. The torch path in :mod:`kvweave.methods.depthweave.select` (gather the
rows, dequantize, matmul, rotate) is the reference it is tested against (``tests/methods/test_factor_kernel.py``).
Built on first use like :mod:`kvweave.kernels.cpu_quant`; :func:`load` returns ``None`` where it cannot be.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvweave.kernels._build import build, source

_NAME = "kvweave_cpu_factor_v4"

_SOURCE = source("cpu_factor.cpp")

_CPP_DECL = (
    "torch::Tensor factor_logits(torch::Tensor q, torch::Tensor data, torch::Tensor scale, int64_t bits, "
    "int64_t group, torch::Tensor R, torch::Tensor rows, torch::Tensor positions, torch::Tensor cos, "
    "torch::Tensor sin);\n"
    "torch::Tensor factor_weighted(torch::Tensor P, torch::Tensor data, torch::Tensor scale, int64_t bits, "
    "int64_t group, torch::Tensor rows);"
)

_reason: str | None = None


@functools.lru_cache(maxsize=1)
def load() -> Any | None:
    """The compiled extension, or ``None`` when it cannot be built here (``KVWEAVE_NO_CPP=1`` disables it)."""
    global _reason
    module, _reason = build(_NAME, _CPP_DECL, _SOURCE, ["factor_logits", "factor_weighted"])
    return module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it has not failed)."""
    return _reason


def supports(packed: Any) -> bool:
    """Whether coordinates stored as ``packed`` (a :class:`kvweave.ops.quantize.Packed`) can be read here."""
    return (
        packed.bits in (4, 8)
        and packed.group > 0
        and packed.data.device.type == "cpu"
        and packed.data.dim() == 2
        and packed.scale is not None
        and packed.scale.dtype == torch.float16
    )


def _raw(packed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    data = packed.data.contiguous()
    return data.view(torch.uint8), packed.scale.contiguous()


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
    ``[H, G, T]`` unscaled logits."""
    module = load()
    assert module is not None, unavailable_reason()
    data, scale = _raw(packed)
    empty = torch.empty(0)
    return module.factor_logits(
        query.float().contiguous(),
        data,
        scale,
        packed.bits,
        packed.group,
        r_k.float().contiguous(),
        rows.to(torch.int64).contiguous(),
        empty.to(torch.int32) if positions is None else positions.to(torch.int32).contiguous(),
        empty if cos is None else cos.float().contiguous(),
        empty if sin is None else sin.float().contiguous(),
    )


def factor_weighted(probs: torch.Tensor, packed: Any, rows: torch.Tensor) -> torch.Tensor:
    """``probs: [H, G, T]`` over rows ``rows: [H, T]`` of the value coordinates ``packed`` -> ``[H, G, w]``."""
    module = load()
    assert module is not None, unavailable_reason()
    data, scale = _raw(packed)
    return module.factor_weighted(
        probs.float().contiguous(), data, scale, packed.bits, packed.group, rows.to(torch.int64).contiguous()
    )
