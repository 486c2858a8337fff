#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

// out[b,h,r,t] = scale[b,h,t] * sum_d q[b,h,r,d] * codes[b,h,t,d]
// q: [B,H,R,D] float32 contiguous; codes: [B,H,T,D] int8, last dim contiguous (any other strides);
// scale: [B,H,T] float32 (any strides).
torch::Tensor int8_logits(torch::Tensor q, torch::Tensor codes, torch::Tensor scale) {
  TORCH_CHECK(q.dim() == 4 && codes.dim() == 4 && scale.dim() == 3, "int8_logits: bad ranks");
  TORCH_CHECK(codes.stride(3) == 1, "int8_logits: codes need a contiguous last dimension");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), T = codes.size(2);
  TORCH_CHECK(D <= 1024, "int8_logits: head dim above 1024");
  auto out = torch::empty({B, H, R, T}, q.options());
  const float* qp = q.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t c0 = codes.stride(0), c1 = codes.stride(1), c2 = codes.stride(2);
  const int64_t s0 = scale.stride(0), s1 = scale.stride(1), s2 = scale.stride(2);
  const int64_t CHUNK = 512, chunks = (T + CHUNK - 1) / CHUNK;
  at::parallel_for(0, (B * H) * (chunks), 1, [&](int64_t first, int64_t last) {
  for (int64_t item = first; item < last; ++item) {
    const int64_t bh = item / (chunks), c = item % (chunks);
    {
      const int64_t b = bh / H, h = bh % H;
      const int8_t* base = cp + b * c0 + h * c1;
      const float* sbase = sp + b * s0 + h * s1;
      const float* qh = qp + bh * R * D;
      float* oh = op + bh * R * T;
      float row[1024];
      const int64_t end = std::min(T, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        const int8_t* k = base + t * c2;
        for (int64_t d = 0; d < D; ++d) row[d] = (float)k[d];
        const float s = sbase[t * s2];
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qh + r * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qr[d] * row[d];
          oh[r * T + t] = acc * s;
        }
      }
    }
  }
  });
  return out;
}

// out[b,h,r,d] = sum_t w[b,h,r,t] * scale[b,h,t] * codes[b,h,t,d]
// w: [B,H,R,T] float32 contiguous; codes, scale as in int8_logits. Partial sums per token chunk, then summed.
torch::Tensor int8_values(torch::Tensor w, torch::Tensor codes, torch::Tensor scale) {
  TORCH_CHECK(w.dim() == 4 && codes.dim() == 4 && scale.dim() == 3, "int8_values: bad ranks");
  TORCH_CHECK(codes.stride(3) == 1, "int8_values: codes need a contiguous last dimension");
  const int64_t B = w.size(0), H = w.size(1), R = w.size(2), T = w.size(3), D = codes.size(3);
  TORCH_CHECK(D <= 1024, "int8_values: head dim above 1024");
  const int64_t CHUNK = 1024, chunks = std::max<int64_t>(1, (T + CHUNK - 1) / CHUNK);
  auto partial = torch::zeros({chunks, B, H, R, D}, w.options());
  const float* wp = w.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  const int64_t c0 = codes.stride(0), c1 = codes.stride(1), c2 = codes.stride(2);
  const int64_t s0 = scale.stride(0), s1 = scale.stride(1), s2 = scale.stride(2);
  at::parallel_for(0, (B * H) * (chunks), 1, [&](int64_t first, int64_t last) {
  for (int64_t item = first; item < last; ++item) {
    const int64_t bh = item / (chunks), c = item % (chunks);
    {
      const int64_t b = bh / H, h = bh % H;
      const int8_t* base = cp + b * c0 + h * c1;
      const float* sbase = sp + b * s0 + h * s1;
      const float* wh = wp + bh * R * T;
      float* acc = pp + ((c * B * H) + bh) * R * D;
      float row[1024];
      const int64_t end = std::min(T, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        const int8_t* v = base + t * c2;
        const float s = sbase[t * s2];
        for (int64_t d = 0; d < D; ++d) row[d] = (float)v[d] * s;
        for (int64_t r = 0; r < R; ++r) {
          const float wr = wh[r * T + t];
          float* ar = acc + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] += wr * row[d];
        }
      }
    }
  }
  });
  return chunks == 1 ? partial[0] : partial.sum(0);
}
