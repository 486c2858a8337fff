"""Fused CPU kernel for attention over KIVI-quantized blocks (``quant``): decode codes, score, softmax and
weight the values in one pass per head, without writing any dequantized tensor.

The torch path in :mod:`kvweave.methods.quant` (unpack to float, per-block matmuls, online softmax) is the
reference it is tested against (``tests/methods/test_quant_kernel.py``). The C++ source below is compiled
on first use with ``torch.utils.cpp_extension.load_inline`` (gcc or clang, ``-O3 -march=native -fopenmp``)
into torch's extension cache, which takes about a minute once per machine; :func:`load` returns ``None``
and :func:`unavailable_reason` says why when there is no compiler, and ``quant:kernel=auto`` then uses the
torch path (``quant:kernel=cpp`` raises instead). The kernel used is recorded in the layer statistics.

Two kernels, with the softmax between them left to torch (its ``exp`` is vectorised): :func:`block_logits`
scores the query rows against packed key blocks (per-channel scales and minima folded into the query), and
:func:`weighted_values` sums the softmax weights times the dequantized values, decoding each value row once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvweave.kernels._build import build, source

__all__ = ["block_logits", "load", "unavailable_reason", "weighted_values"]

_NAME = "kvweave_cpu_quant_v6"

_SOURCE = source("cpu_quant.cpp")

_CPP_DECL = (
    "torch::Tensor quant_logits(torch::Tensor q, torch::Tensor key_codes, torch::Tensor key_scale, "
    "torch::Tensor key_min, int64_t bits, double scaling);\n"
    "torch::Tensor quant_values(torch::Tensor weights, torch::Tensor value_codes, torch::Tensor value_scale, "
    "torch::Tensor value_min, int64_t bits);"
)

_reason: str | None = None


@functools.lru_cache(maxsize=1)
def load() -> Any | None:
    """The compiled extension module, or ``None`` when it cannot be built here (see :func:`unavailable_reason`).

    ``KVWEAVE_NO_CPP=1`` disables it (the torch path is then used everywhere).
    """
    global _reason
    module, _reason = build(_NAME, _CPP_DECL, _SOURCE, ["quant_logits", "quant_values"])
    return module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it has not failed)."""
    return _reason


def _module() -> Any:
    module = load()
    if module is None:
        raise RuntimeError(f"the C++ quant kernel is not available: {unavailable_reason()}")
    return module


def block_logits(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_min: torch.Tensor,
    bits: int,
    scaling: float,
) -> torch.Tensor:
    """``scaling * q·k`` over quantized key blocks (shapes as :class:`kvweave.ops.kivi.Blocks`;
    ``query: [B, H, R, D]``) -> ``[B, H, R, n*G]`` float32."""
    b, h, n, _, _ = key_codes.shape
    return _module().quant_logits(
        query.float().contiguous(),
        key_codes.contiguous(),
        key_scale.float().reshape(b, h, n, -1).contiguous(),
        key_min.float().reshape(b, h, n, -1).contiguous(),
        bits,
        float(scaling),
    )


def weighted_values(
    weights: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_min: torch.Tensor,
    bits: int,
) -> torch.Tensor:
    """``weights @ values`` of quantized value blocks without dequantizing them: ``weights: [B, H, R, n*G]``,
    ``value_codes: [B, H, n, G, W]``, ``value_scale, value_min: [B, H, n, G, D/cg]`` -> ``[B, H, R, D]``."""
    b, h, n, g, w = value_codes.shape
    return _module().quant_values(
        weights.float().contiguous(),
        value_codes.reshape(b, h, n * g, w).contiguous(),
        value_scale.float().reshape(b, h, n * g, -1).contiguous(),
        value_min.float().reshape(b, h, n * g, -1).contiguous(),
        bits,
    )
