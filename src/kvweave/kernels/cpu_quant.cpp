#include <torch/extension.h>
#include <algorithm>
#include <vector>

// NR rows of sum_i w[r][i] * values[i][:] over len tokens (values: [len, DT], w rows ``stride`` apart).
template <int DT, int NR>
static inline void values_fixed(const float* w, int64_t stride, const float* __restrict__ values, int64_t len,
                                float* out) {
  float acc[NR][DT] = {};
  for (int64_t i = 0; i < len; ++i) {
    const float* v = values + i * DT;
    for (int r = 0; r < NR; ++r) {
      const float wr = w[r * stride + i];
      for (int d = 0; d < DT; ++d) acc[r][d] += wr * v[d];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < DT; ++d) out[r * DT + d] = acc[r][d];
}

// NR rows of logits over one block of GT tokens: out[r][g] = base[r] + sum_d qs[r][d] * codes_t[d][g].
template <int GT, int NR>
static inline void rows_fixed(const float* qs, const float* base, const float* __restrict__ codes_t, int64_t D,
                              float* out, int64_t stride) {
  float acc[NR][GT];
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < GT; ++g) acc[r][g] = base[r];
  for (int64_t d = 0; d < D; ++d) {
    const float* ct = codes_t + d * GT;
    for (int r = 0; r < NR; ++r) {
      const float w = qs[r * D + d];
      for (int g = 0; g < GT; ++g) acc[r][g] += w * ct[g];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < GT; ++g) out[r * stride + g] = acc[r][g];
}

// Scaled logits of R packed query rows over n quantized key blocks of G tokens, for every (batch, head).
// q: [B, H, R, D] float32; key_codes: [B, H, n, D, G/P] uint8, channel-major, byte i of a channel holding
// tokens i, i + G/P, ... at bits 0, BITS, ... (P = 8/BITS codes per byte); key_scale, key_min: [B, H, n, D]
// float32 (per block and channel). Returns [B, H, R, n*G] float32: scaling * q . (c * s + m) =
// (scaling * q * s) . c + scaling * q . m per block. Each channel's codes decode to a contiguous run of
// tokens, and the inner loops run over tokens (they vectorise without reordering a sum).
template <int BITS>
static torch::Tensor logits_impl(torch::Tensor q, torch::Tensor key_codes, torch::Tensor key_scale,
                                 torch::Tensor key_min, double scaling) {
  constexpr int P = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3);
  const int64_t n = key_codes.size(2), GP = key_codes.size(4), G = GP * P, T = n * G;
  auto out = torch::empty({B, H, R, T}, q.options());
  const float* qp = q.data_ptr<float>();
  const uint8_t* kc = key_codes.data_ptr<uint8_t>();
  const float* ks = key_scale.data_ptr<float>();
  const float* km = key_min.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = (float)scaling;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    for (int64_t blk = 0; blk < n; ++blk) {
      std::vector<float> qs_v(R * D), codes_v(D * G), qm(R);
      float* qs = qs_v.data();
      float* codes_t = codes_v.data();
      const float* qh = qp + bh * R * D;
      const float* s = ks + (bh * n + blk) * D;
      const float* m = km + (bh * n + blk) * D;
      const uint8_t* block = kc + (bh * n + blk) * D * GP;
      for (int64_t d = 0; d < D; ++d)
        for (int j = 0; j < P; ++j) {
          const uint8_t* src = block + d * GP;
          float* dst = codes_t + d * G + j * GP;
          for (int64_t i = 0; i < GP; ++i) dst[i] = (float)((src[i] >> (BITS * j)) & MASK);
        }
      for (int64_t r = 0; r < R; ++r) {
        float base = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          qs[r * D + d] = qh[r * D + d] * s[d] * sc;
          base += qh[r * D + d] * m[d];
        }
        qm[r] = base * sc;
      }
      float* lb = op + bh * R * T + blk * G;
      if (G == 32) {  // the default block: four rows' accumulators stay in registers over the channels
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) rows_fixed<32, 4>(qs + r * D, qm.data() + r, codes_t, D, lb + r * T, T);
        for (; r < R; ++r) rows_fixed<32, 1>(qs + r * D, qm.data() + r, codes_t, D, lb + r * T, T);
      } else {
        for (int64_t r = 0; r < R; ++r) {
          float* __restrict__ lr = lb + r * T;
          for (int64_t g = 0; g < G; ++g) lr[g] = qm[r];
          for (int64_t d = 0; d < D; ++d) {
            const float w = qs[r * D + d];
            const float* __restrict__ ct = codes_t + d * G;
            for (int64_t g = 0; g < G; ++g) lr[g] += w * ct[g];
          }
        }
      }
    }
  }
  return out;
}

// sum_t weights[r, t] * (c[t] * s[t, group] + m[t, group]) for every (batch, head, row r).
// weights: [B, H, R, T] float32; value_codes: [B, H, T, D*BITS/8] uint8 (T = n*G, any block split);
// value_scale, value_min: [B, H, T, D/cg] float32. Returns [B, H, R, D] float32. Parallel over (batch,
// head) and token chunks, each chunk accumulating its own partial sums.
template <int BITS>
static torch::Tensor values_impl(torch::Tensor weights, torch::Tensor value_codes, torch::Tensor value_scale,
                                 torch::Tensor value_min) {
  constexpr int P = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int64_t B = weights.size(0), H = weights.size(1), R = weights.size(2), T = weights.size(3);
  const int64_t W = value_codes.size(3), D = W * P, groups = value_scale.size(3), cg = D / groups;
  const int64_t chunk = 256, chunks = (T + chunk - 1) / chunk;
  auto partial = torch::zeros({B * H, chunks, R, D}, weights.options());
  const float* wp = weights.data_ptr<float>();
  const uint8_t* vc = value_codes.data_ptr<uint8_t>();
  const float* vs = value_scale.data_ptr<float>();
  const float* vm = value_min.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t t0 = c * chunk, len = std::min(T, t0 + chunk) - t0;
      std::vector<float> buf(len * D);  // the chunk's values, dequantized
      for (int64_t i = 0; i < len; ++i) {
        const int64_t t = t0 + i;
        const uint8_t* row = vc + (bh * T + t) * W;
        float* value = buf.data() + i * D;
        for (int64_t k = 0; k < W; ++k) {
          const int byte = row[k];
          for (int j = 0; j < P; ++j) value[k * P + j] = (float)((byte >> (BITS * j)) & MASK);
        }
        const float* s = vs + (bh * T + t) * groups;
        const float* m = vm + (bh * T + t) * groups;
        for (int64_t gi = 0; gi < groups; ++gi) {
          const float sg = s[gi], mg = m[gi];
          for (int64_t d = gi * cg; d < (gi + 1) * cg; ++d) value[d] = value[d] * sg + mg;
        }
      }
      float* acc = pp + (bh * chunks + c) * R * D;
      const float* wb = wp + bh * R * T + t0;
      if (D == 64) {  // four rows' accumulators stay in registers over the chunk's tokens
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) values_fixed<64, 4>(wb + r * T, T, buf.data(), len, acc + r * D);
        for (; r < R; ++r) values_fixed<64, 1>(wb + r * T, T, buf.data(), len, acc + r * D);
      } else {
        for (int64_t r = 0; r < R; ++r) {
          float* __restrict__ o = acc + r * D;
          for (int64_t i = 0; i < len; ++i) {
            const float w = wb[r * T + i];
            const float* __restrict__ v = buf.data() + i * D;
            for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
          }
        }
      }
    }
  }
  return partial.sum(1).view({B, H, R, D});
}

torch::Tensor quant_logits(torch::Tensor q, torch::Tensor key_codes, torch::Tensor key_scale,
                           torch::Tensor key_min, int64_t bits, double scaling) {
  TORCH_CHECK(q.dim() == 4 && key_codes.dim() == 5, "quant_logits: bad ranks");
  TORCH_CHECK(key_codes.size(3) == q.size(3), "quant_logits: key channels do not match head_dim");
  if (bits == 4) return logits_impl<4>(q, key_codes, key_scale, key_min, scaling);
  if (bits == 2) return logits_impl<2>(q, key_codes, key_scale, key_min, scaling);
  TORCH_CHECK(bits == 8, "quant_logits: bits must be 2, 4 or 8");
  return logits_impl<8>(q, key_codes, key_scale, key_min, scaling);
}

torch::Tensor quant_values(torch::Tensor weights, torch::Tensor value_codes, torch::Tensor value_scale,
                           torch::Tensor value_min, int64_t bits) {
  TORCH_CHECK(weights.dim() == 4 && value_codes.dim() == 4, "quant_values: bad ranks");
  TORCH_CHECK((value_codes.size(3) * (8 / bits)) % value_scale.size(3) == 0, "quant_values: bad groups");
  if (bits == 4) return values_impl<4>(weights, value_codes, value_scale, value_min);
  if (bits == 2) return values_impl<2>(weights, value_codes, value_scale, value_min);
  TORCH_CHECK(bits == 8, "quant_values: bits must be 2, 4 or 8");
  return values_impl<8>(weights, value_codes, value_scale, value_min);
}
