"""Fused CPU kernel for attention over held rows: INT8 rows with one float32 scale per token (DK-Cache's steady
and far tiers, :func:`kvweave.ops.quantize.quantize_int8`) or 16-bit rows (bfloat16 / float16: its exact core
at 16-bit storage). Scores and weights the values straight from the codes or 16-bit rows, without writing a
dequantized or widened float32 copy, so a step reads a quarter (INT8) or half (16-bit) of the bytes of a
float32 tier and pays no conversion pass.

:class:`HeldRows` is what attention code holds: ``logits`` and ``weighted`` run the C++ kernel on the CPU when
it builds (``torch.utils.cpp_extension``, once per machine, like :mod:`kvweave.kernels.cpu_quant`) and the torch
reference (dequantize, matmul) otherwise or on other devices; ``kernel_used`` says which ran. Tested against the
reference in ``tests/methods/test_int8_kernel.py``.

The kernel has two forms of each product: a plain one (one dot product per token and query row, summed across
lanes; any CPU) and a blocked one (eight query rows in the lanes of a register, each widened row element
broadcast into them; AVX2 builds), which :class:`HeldRows` uses where it can (``blocked``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from kvweave.kernels._build import build, source

_NAME = "kvweave_cpu_int8_v5"

_SOURCE = source("cpu_int8.cpp")

_CPP_DECL = (
    "torch::Tensor int8_logits(torch::Tensor q, torch::Tensor codes, torch::Tensor scale, bool blocked);\n"
    "torch::Tensor int8_values(torch::Tensor w, torch::Tensor codes, torch::Tensor scale, bool blocked);\n"
    "bool int8_blocked_available();\n"
    "std::vector<torch::Tensor> parts_softmax(std::vector<torch::Tensor> logits, double scaling);"
)

_reason: str | None = None


@functools.lru_cache(maxsize=1)
def load() -> Any | None:
    """The compiled extension, or ``None`` when it cannot be built here (``KVWEAVE_NO_CPP=1`` disables it)."""
    global _reason
    module, _reason = build(
        _NAME, _CPP_DECL, _SOURCE, ["int8_logits", "int8_values", "int8_blocked_available", "parts_softmax"]
    )
    return module


def blocked_available() -> bool:
    """Whether the built kernel has its blocked form (AVX2, FMA and F16C at build time)."""
    module = load()
    return module is not None and bool(module.int8_blocked_available())


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


def parts_softmax_reference(
    logits: list[torch.Tensor], scaling: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One softmax over the concatenated ``scaling · logits`` of attention parts (``[B, H, R, T_i]`` each, -inf
    where hidden): the probabilities per part and each row's entropy ``-Σ p log p`` ``[B, H, R]``; a row that
    sees nothing gets zeros (the rule of masked softmax)."""
    probs = torch.cat([x.float() for x in logits], dim=-1).mul(scaling).softmax(-1).nan_to_num(0.0)
    entropy = -(probs * probs.clamp(min=torch.finfo(probs.dtype).tiny).log()).sum(-1)
    return list(probs.split([x.shape[-1] for x in logits], dim=-1)), entropy


def parts_softmax(logits: list[torch.Tensor], scaling: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`parts_softmax_reference` in one C++ pass per row (no concatenation, no copy per part, the entropy
    from the softmax's own sums) on the CPU when the kernel builds; the reference otherwise. The probabilities
    come back contiguous, as :meth:`HeldRows.weighted` reads them."""
    module = load() if all(x.device.type == "cpu" for x in logits) else None
    if module is None:
        return parts_softmax_reference(logits, scaling)
    *probs, entropy = module.parts_softmax([x.float().contiguous() for x in logits], float(scaling))
    return probs, entropy


@dataclasses.dataclass
class HeldRows:
    """Rows ``codes: [B, H, T, D]`` attended without a dequantized copy: int8 with ``scale: [B, H, T, 1]``
    float32, or bfloat16 / float16 with ``scale=None``."""

    codes: torch.Tensor
    scale: torch.Tensor | None
    use_kernel: bool = True
    blocked: bool = True
    """The kernel's blocked form (query rows in register lanes, AVX2 builds, head dim a multiple of 8) where
    it can run; ``False`` keeps the plain form (one dot product per token and query row) for comparison."""

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
        return module.int8_logits(query, self.codes, self._kernel_scale(), self.blocked)

    def weighted(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights: [B, H, R, T]`` -> ``[B, H, R, D]`` float32."""
        module = self._kernel()
        if module is None:
            return values_reference(weights, self.codes, self.scale)
        return module.int8_values(
            weights.float().contiguous(), self.codes, self._kernel_scale(), self.blocked
        )

    def _kernel_scale(self) -> torch.Tensor:
        """``[B, H, T]`` scales, or an empty tensor for 16-bit rows (the kernel then scales by 1)."""
        return self.scale[..., 0] if self.scale is not None else self.codes.new_empty(0, dtype=torch.float32)
