"""Fused CPU kernel for attention over held rows: INT8 rows with one float32 scale per token (DK-Cache's steady
and far tiers, :func:`kvweave.ops.quantize.quantize_int8`) or 16-bit rows (bfloat16 / float16: its exact core
at 16-bit storage). Scores and weights the values straight from the codes or 16-bit rows, without writing a
dequantized or widened float32 copy, so a step reads a quarter (INT8) or half (16-bit) of the bytes of a
float32 tier and pays no conversion pass.

:class:`HeldRows` is what attention code holds: ``logits`` and ``weighted`` run the C++ kernel on the CPU when
it builds (``torch.utils.cpp_extension``, once per machine, like :mod:`kvweave.kernels.cpu_quant`) and the torch
reference (dequantize, matmul) otherwise or on other devices; ``kernel_used`` says which ran. Tested against the
reference in ``tests/methods/test_int8_kernel.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from kvweave.kernels._build import build, source

_NAME = "kvweave_cpu_int8_v4"

_SOURCE = source("cpu_int8.cpp")

_CPP_DECL = (
    "torch::Tensor int8_logits(torch::Tensor q, torch::Tensor codes, torch::Tensor scale);\n"
    "torch::Tensor int8_values(torch::Tensor w, torch::Tensor codes, torch::Tensor scale);"
)

_reason: str | None = None


@functools.lru_cache(maxsize=1)
def load() -> Any | None:
    """The compiled extension, or ``None`` when it cannot be built here (``KVWEAVE_NO_CPP=1`` disables it)."""
    global _reason
    module, _reason = build(_NAME, _CPP_DECL, _SOURCE, ["int8_logits", "int8_values"])
    return module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it has not failed)."""
    return _reason


SIXTEEN_BITS = (torch.bfloat16, torch.float16)
"""16-bit row dtypes the kernel reads without a scale."""


def _rows(codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return codes.float() if scale is None else codes.float() * scale.float()


def logits_reference(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``query: [B, H, R, D]`` float, ``codes: [B, H, T, D]`` int8 with ``scale: [B, H, T, 1]`` (or 16-bit rows
    with ``None``) -> ``[B, H, R, T]``."""
    return query.float() @ _rows(codes, scale).transpose(-1, -2)


def values_reference(weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``weights: [B, H, R, T]`` -> ``[B, H, R, D]``: ``weights @ (codes · scale)``."""
    return weights.float() @ _rows(codes, scale)


@dataclasses.dataclass
class HeldRows:
    """Rows ``codes: [B, H, T, D]`` attended without a dequantized copy: int8 with ``scale: [B, H, T, 1]``
    float32, or bfloat16 / float16 with ``scale=None``."""

    codes: torch.Tensor
    scale: torch.Tensor | None
    use_kernel: bool = True

    def __post_init__(self) -> None:
        if self.scale is None and self.codes.dtype not in SIXTEEN_BITS:
            raise ValueError(f"HeldRows: {self.codes.dtype} rows need a scale (only 16-bit rows go without)")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def _kernel(self) -> Any | None:
        if not self.use_kernel or self.codes.device.type != "cpu" or self.codes.stride(-1) != 1:
            return None
        return load()

    @property
    def kernel_used(self) -> str:
        return "cpp" if self._kernel() is not None else "torch"

    def logits(self, query: torch.Tensor) -> torch.Tensor:
        """``query: [B, H, R, D]`` -> ``[B, H, R, T]`` float32."""
        module = self._kernel()
        if module is None:
            return logits_reference(query, self.codes, self.scale)
        b, h = self.codes.shape[:2]
        query = query.float().expand(b, h, -1, -1).contiguous()
        return module.int8_logits(query, self.codes, self._kernel_scale())

    def weighted(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights: [B, H, R, T]`` -> ``[B, H, R, D]`` float32."""
        module = self._kernel()
        if module is None:
            return values_reference(weights, self.codes, self.scale)
        return module.int8_values(weights.float().contiguous(), self.codes, self._kernel_scale())

    def _kernel_scale(self) -> torch.Tensor:
        """``[B, H, T]`` scales, or an empty tensor for 16-bit rows (the kernel then scales by 1)."""
        return self.scale[..., 0] if self.scale is not None else self.codes.new_empty(0, dtype=torch.float32)
