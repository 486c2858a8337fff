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
