#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

// Attention over held rows without a dequantized copy: int8 codes with one float32 scale per token (DK-Cache's
// INT8 tiers), or 16-bit rows (bfloat16 / float16: its exact core and pages at 16-bit storage) with no scale,
// each row widened to float32 in registers.

// out[b,h,r,t] = scale[b,h,t] * sum_d q[b,h,r,d] * rows[b,h,t,d]
template <typename T>
static void logits_impl(const float* qp, const T* cp, const float* sp, float* op, int64_t B, int64_t H,
                        int64_t R, int64_t D, int64_t T_, int64_t c0, int64_t c1, int64_t c2, int64_t s0,
                        int64_t s1, int64_t s2) {
  const int64_t CHUNK = 512, chunks = (T_ + CHUNK - 1) / CHUNK;
  at::parallel_for(0, (B * H) * (chunks), 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t bh = item / (chunks), c = item % (chunks);
      const int64_t b = bh / H, h = bh % H;
      const T* base = cp + b * c0 + h * c1;
      const float* sbase = sp ? sp + b * s0 + h * s1 : nullptr;
      const float* qh = qp + bh * R * D;
      float* oh = op + bh * R * T_;
      float row[1024];
      const int64_t end = std::min(T_, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        const T* k = base + t * c2;
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[d]);
        const float s = sbase ? sbase[t * s2] : 1.f;
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qh + r * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qr[d] * row[d];
          oh[r * T_ + t] = acc * s;
        }
      }
    }
  });
}

// out[b,h,r,d] = sum_t w[b,h,r,t] * scale[b,h,t] * rows[b,h,t,d]; partial sums per token chunk, then summed.
template <typename T>
static void values_impl(const float* wp, const T* cp, const float* sp, float* pp, int64_t B, int64_t H,
                        int64_t R, int64_t D, int64_t T_, int64_t chunks, int64_t CHUNK, int64_t c0,
                        int64_t c1, int64_t c2, int64_t s0, int64_t s1, int64_t s2) {
  at::parallel_for(0, (B * H) * (chunks), 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t bh = item / (chunks), c = item % (chunks);
      const int64_t b = bh / H, h = bh % H;
      const T* base = cp + b * c0 + h * c1;
      const float* sbase = sp ? sp + b * s0 + h * s1 : nullptr;
      const float* wh = wp + bh * R * T_;
      float* acc = pp + ((c * B * H) + bh) * R * D;
      float row[1024];
      const int64_t end = std::min(T_, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        const T* v = base + t * c2;
        const float s = sbase ? sbase[t * s2] : 1.f;
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(v[d]) * s;
        for (int64_t r = 0; r < R; ++r) {
          const float wr = wh[r * T_ + t];
          float* ar = acc + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] += wr * row[d];
        }
      }
    }
  });
}

static void check_rows(const torch::Tensor& rows, const torch::Tensor& scale, const char* name) {
  TORCH_CHECK(rows.dim() == 4, name, ": rows need rank 4");
  TORCH_CHECK(rows.stride(3) == 1, name, ": rows need a contiguous last dimension");
  TORCH_CHECK(rows.size(3) <= 1024, name, ": head dim above 1024");
  const auto kind = rows.scalar_type();
  TORCH_CHECK(kind == torch::kChar || kind == torch::kBFloat16 || kind == torch::kHalf, name,
              ": rows must be int8, bfloat16 or float16");
  if (kind == torch::kChar) {
    TORCH_CHECK(scale.defined() && scale.dim() == 3, name, ": int8 rows need a [B, H, T] scale");
  }
}

// q: [B,H,R,D] float32 contiguous; rows: [B,H,T,D] (last dim contiguous, any other strides); scale: [B,H,T]
// float32 (any strides) for int8 rows, an empty tensor for 16-bit rows.
torch::Tensor int8_logits(torch::Tensor q, torch::Tensor codes, torch::Tensor scale) {
  TORCH_CHECK(q.dim() == 4, "int8_logits: bad ranks");
  check_rows(codes, scale, "int8_logits");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), T = codes.size(2);
  auto out = torch::empty({B, H, R, T}, q.options());
  const bool scaled = scale.defined() && scale.numel() > 0;
  const float* sp = scaled ? scale.data_ptr<float>() : nullptr;
  const int64_t s0 = scaled ? scale.stride(0) : 0, s1 = scaled ? scale.stride(1) : 0,
                s2 = scaled ? scale.stride(2) : 0;
  const int64_t c0 = codes.stride(0), c1 = codes.stride(1), c2 = codes.stride(2);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (codes.scalar_type()) {
    case torch::kChar:
      logits_impl(qp, codes.data_ptr<int8_t>(), sp, op, B, H, R, D, T, c0, c1, c2, s0, s1, s2);
      break;
    case torch::kBFloat16:
      logits_impl(qp, codes.data_ptr<at::BFloat16>(), sp, op, B, H, R, D, T, c0, c1, c2, s0, s1, s2);
      break;
    default:
      logits_impl(qp, codes.data_ptr<at::Half>(), sp, op, B, H, R, D, T, c0, c1, c2, s0, s1, s2);
  }
  return out;
}

// w: [B,H,R,T] float32 contiguous; rows, scale as in int8_logits.
torch::Tensor int8_values(torch::Tensor w, torch::Tensor codes, torch::Tensor scale) {
  TORCH_CHECK(w.dim() == 4, "int8_values: bad ranks");
  check_rows(codes, scale, "int8_values");
  const int64_t B = w.size(0), H = w.size(1), R = w.size(2), T = w.size(3), D = codes.size(3);
  const int64_t CHUNK = 1024, chunks = std::max<int64_t>(1, (T + CHUNK - 1) / CHUNK);
  auto partial = torch::zeros({chunks, B, H, R, D}, w.options());
  const bool scaled = scale.defined() && scale.numel() > 0;
  const float* sp = scaled ? scale.data_ptr<float>() : nullptr;
  const int64_t s0 = scaled ? scale.stride(0) : 0, s1 = scaled ? scale.stride(1) : 0,
                s2 = scaled ? scale.stride(2) : 0;
  const int64_t c0 = codes.stride(0), c1 = codes.stride(1), c2 = codes.stride(2);
  const float* wp = w.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  switch (codes.scalar_type()) {
    case torch::kChar:
      values_impl(wp, codes.data_ptr<int8_t>(), sp, pp, B, H, R, D, T, chunks, CHUNK, c0, c1, c2, s0, s1, s2);
      break;
    case torch::kBFloat16:
      values_impl(wp, codes.data_ptr<at::BFloat16>(), sp, pp, B, H, R, D, T, chunks, CHUNK, c0, c1, c2, s0,
                  s1, s2);
      break;
    default:
      values_impl(wp, codes.data_ptr<at::Half>(), sp, pp, B, H, R, D, T, chunks, CHUNK, c0, c1, c2, s0, s1, s2);
  }
  return chunks == 1 ? partial[0] : partial.sum(0);
}
