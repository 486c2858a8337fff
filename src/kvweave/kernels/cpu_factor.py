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

from kvweave.kernels._build import build

_NAME = "kvweave_cpu_factor_v3"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

// Dequantized coordinates of one row: bits 4 (two per byte, low nibble first, value - 8) or 8 (int8), times
// the float16 scale of its row group (per column).
static inline void decode_row(const uint8_t* data, int64_t bytes_per_row, const at::Half* scale, int64_t w,
                              int64_t bits, int64_t row, int64_t group, float* out) {
  const uint8_t* src = data + row * bytes_per_row;
  const at::Half* s = scale + (row / group) * w;
  if (bits == 4) {
    for (int64_t j = 0; j < w; ++j) {
      const uint8_t byte = src[j >> 1];
      const int v = (j & 1) ? (byte >> 4) : (byte & 15);
      out[j] = (float)(v - 8) * (float)s[j];
    }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(src);
    for (int64_t j = 0; j < w; ++j) out[j] = (float)q[j] * (float)s[j];
  }
}

// logits[h, g, t] = q[h, g, :] . RoPE(pos[rows[h, t]]) (c_{rows[h,t]} @ R[:, h, :])
// q: [H, G, D] f32; data: [n, bytes] uint8; scale: [ceil(n/group), w] f16; R: [w, H, D] f32 (w <= width of c);
// rows: [H, T] int64; positions: [n] int32 or empty (no rotation); cos, sin: [P, D] f32.
torch::Tensor factor_logits(torch::Tensor q, torch::Tensor data, torch::Tensor scale, int64_t bits, int64_t group,
                            torch::Tensor R, torch::Tensor rows, torch::Tensor positions, torch::Tensor cos,
                            torch::Tensor sin) {
  const int64_t H = q.size(0), G = q.size(1), D = q.size(2), T = rows.size(1), w = R.size(0);
  const int64_t width = scale.size(1), bytes = data.size(1);
  TORCH_CHECK(D <= 512 && width <= 4096, "factor_logits: shapes too large");
  auto out = torch::empty({H, G, T}, q.options());
  const float* qp = q.data_ptr<float>();
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  const float* rp = R.data_ptr<float>();
  const int64_t* rowp = rows.data_ptr<int64_t>();
  const bool rotate = positions.numel() > 0;
  const int32_t* pp = rotate ? positions.data_ptr<int32_t>() : nullptr;
  const float* cp = rotate ? cos.data_ptr<float>() : nullptr;
  const float* snp = rotate ? sin.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t half = D / 2, CHUNK = 64, chunks = (T + CHUNK - 1) / CHUNK;
  at::parallel_for(0, (H) * (chunks), 1, [&](int64_t first, int64_t last) {
  for (int64_t item = first; item < last; ++item) {
    const int64_t h = item / (chunks), c = item % (chunks);
    {
      std::vector<float> coords(width), key(D), rot(D);
      const int64_t end = std::min(T, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        const int64_t row = rowp[h * T + t];
        decode_row(dp, bytes, sp, width, bits, row, group, coords.data());
        std::fill(key.begin(), key.end(), 0.f);
        for (int64_t j = 0; j < w; ++j) {
          const float cj = coords[j];
          const float* rj = rp + (j * H + h) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) key[d] += cj * rj[d];
        }
        const float* kf = key.data();
        if (rotate) {
          const float* cs = cp + (int64_t)pp[row] * D;
          const float* sn = snp + (int64_t)pp[row] * D;
          for (int64_t d = 0; d < half; ++d) {
            rot[d] = key[d] * cs[d] - key[d + half] * sn[d];
            rot[d + half] = key[d + half] * cs[d + half] + key[d] * sn[d + half];
          }
          kf = rot.data();
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qp + (h * G + g) * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qg[d] * kf[d];
          op[(h * G + g) * T + t] = acc;
        }
      }
    }
  }
  });
  return out;
}

// out[h, g, :w] = sum_t P[h, g, t] * c_{rows[h, t]}[:w]; P: [H, G, T] f32; data, scale as above.
torch::Tensor factor_weighted(torch::Tensor P, torch::Tensor data, torch::Tensor scale, int64_t bits,
                              int64_t group, torch::Tensor rows) {
  const int64_t H = P.size(0), G = P.size(1), T = P.size(2), width = scale.size(1), bytes = data.size(1);
  const int64_t CHUNK = 256, chunks = std::max<int64_t>(1, (T + CHUNK - 1) / CHUNK);
  auto partial = torch::zeros({chunks, H, G, width}, P.options());
  const float* wp = P.data_ptr<float>();
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  const int64_t* rowp = rows.data_ptr<int64_t>();
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, (H) * (chunks), 1, [&](int64_t first, int64_t last) {
  for (int64_t item = first; item < last; ++item) {
    const int64_t h = item / (chunks), c = item % (chunks);
    {
      std::vector<float> coords(width);
      float* acc = pp + ((c * H) + h) * G * width;
      const int64_t end = std::min(T, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        decode_row(dp, bytes, sp, width, bits, rowp[h * T + t], group, coords.data());
        for (int64_t g = 0; g < G; ++g) {
          const float p = wp[(h * G + g) * T + t];
          float* ag = acc + g * width;
#pragma omp simd
          for (int64_t j = 0; j < width; ++j) ag[j] += p * coords[j];
        }
      }
    }
  }
  });
  return chunks == 1 ? partial[0] : partial.sum(0);
}
"""

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
