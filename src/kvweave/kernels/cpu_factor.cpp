#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

// Dequantized coordinates of one row: bits 4 (two per byte, low nibble first, value - 8) or 8 (int8), times
// the scale of its row group (per column), given as float (``RowScales`` converts each group's float16 scales
// once, not once per row).
static inline void decode_row(const uint8_t* data, int64_t bytes_per_row, const float* s, int64_t w, int64_t bits,
                              int64_t row, float* out) {
  const uint8_t* src = data + row * bytes_per_row;
  if (bits == 4) {
    const int64_t pairs = w / 2;
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t byte = src[p];
      out[2 * p] = (float)((int)(byte & 15) - 8) * s[2 * p];
      out[2 * p + 1] = (float)((int)(byte >> 4) - 8) * s[2 * p + 1];
    }
    if (w & 1) out[w - 1] = (float)((int)(src[pairs] & 15) - 8) * s[w - 1];
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
    for (int64_t j = 0; j < w; ++j) out[j] = (float)q[j] * s[j];
  }
}

// The float scales of the row group a row falls in, converted when the group changes (chosen rows come in pages
// of consecutive rows, so mostly once per page).
struct RowScales {
  const at::Half* scale;
  int64_t width, group, current = -1;
  std::vector<float> values;
  RowScales(const at::Half* s, int64_t w, int64_t g) : scale(s), width(w), group(g), values(w) {}
  const float* of(int64_t row) {
    const int64_t g = row / group;
    if (g != current) {
      const at::Half* src = scale + g * width;
      for (int64_t j = 0; j < width; ++j) values[j] = (float)src[j];
      current = g;
    }
    return values.data();
  }
};

// key[0:DD] = sum_j coords[j] * rj[0:DD], rj = R + (j * H + h) * D + offset: the accumulators stay in registers
// (a fixed width the compiler unrolls; 64 floats = 8 AVX2 registers; spans of 32 measured slower at head size
// 128, and 64 was 1.2-2.1x faster than accumulating in memory at head sizes 64 and 128).
template <int DD>
static inline void rebuild_span(const float* coords, const float* R, int64_t w, int64_t stride, float* key) {
  float acc[DD];
  for (int d = 0; d < DD; ++d) acc[d] = 0.f;
  for (int64_t j = 0; j < w; ++j) {
    const float cj = coords[j];
    const float* rj = R + j * stride;
#pragma GCC unroll 64
    for (int d = 0; d < DD; ++d) acc[d] += cj * rj[d];
  }
  for (int d = 0; d < DD; ++d) key[d] = acc[d];
}

// key[0:D] = coords[0:w] @ R[0:w, h, 0:D] (R: [w, H, D]).
static inline void rebuild_key(const float* coords, const float* R, int64_t w, int64_t H, int64_t h, int64_t D,
                               float* key) {
  const float* base = R + h * D;
  const int64_t stride = H * D;
  if (D % 64 == 0) {  // head sizes 64, 128, 256: spans of 64 channels in registers
    for (int64_t at = 0; at < D; at += 64) rebuild_span<64>(coords, base + at, w, stride, key + at);
    return;
  }
  std::fill(key, key + D, 0.f);
  for (int64_t j = 0; j < w; ++j) {
    const float cj = coords[j];
    const float* rj = base + j * stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) key[d] += cj * rj[d];
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
      RowScales scales(sp, width, group);
      const int64_t end = std::min(T, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        const int64_t row = rowp[h * T + t];
        decode_row(dp, bytes, scales.of(row), width, bits, row, coords.data());
        rebuild_key(coords.data(), rp, w, H, h, D, key.data());
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
      RowScales scales(sp, width, group);
      float* acc = pp + ((c * H) + h) * G * width;
      const int64_t end = std::min(T, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        const int64_t row = rowp[h * T + t];
        decode_row(dp, bytes, scales.of(row), width, bits, row, coords.data());
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
