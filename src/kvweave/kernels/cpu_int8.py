"""Fused CPU kernel for attention over INT8 rows with one float32 scale per token (DK-Cache's steady and far
tiers, :func:`kvweave.ops.quantize.quantize_int8`): score and weight the values straight from the int8 codes,
without writing a dequantized tensor, so a step reads a quarter of the bytes of a float32 tier.

:class:`Int8Rows` is what attention code holds: ``logits`` and ``weighted`` run the C++ kernel on the CPU when
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

_NAME = "kvweave_cpu_int8_v3"

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


def logits_reference(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``query: [B, H, R, D]`` float, ``codes: [B, H, T, D]`` int8, ``scale: [B, H, T, 1]`` -> ``[B, H, R, T]``."""
    return query.float() @ (codes.float() * scale.float()).transpose(-1, -2)


def values_reference(weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weights: [B, H, R, T]`` -> ``[B, H, R, D]``: ``weights @ (codes · scale)``."""
    return weights.float() @ (codes.float() * scale.float())


@dataclasses.dataclass
class Int8Rows:
    """INT8 rows ``codes: [B, H, T, D]`` with ``scale: [B, H, T, 1]`` float32, attended without dequantizing."""

    codes: torch.Tensor
    scale: torch.Tensor
    use_kernel: bool = True

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
        return module.int8_logits(query, self.codes, self.scale[..., 0])

    def weighted(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights: [B, H, R, T]`` -> ``[B, H, R, D]`` float32."""
        module = self._kernel()
        if module is None:
            return values_reference(weights, self.codes, self.scale)
        return module.int8_values(weights.float().contiguous(), self.codes, self.scale[..., 0])
