#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVWEAVE_BLOCKED 1
#endif

// Attention over held rows without a dequantized copy: int8 codes with one float32 scale per token (DK-Cache's
// INT8 tiers), or 16-bit rows (bfloat16 / float16: its exact core and pages at 16-bit storage) with no scale,
// each row widened to float32 in registers.
//
// Two forms of each product. The plain one (any CPU, any head dim) takes one dot product per (token, query row)
// and sums it across lanes. The blocked one (AVX2 + FMA, head dim a multiple of 8) puts eight query rows in the
// lanes of one register and broadcasts each widened row element into them: no sum across lanes, eight tokens
// in flight for the logits, eight query rows' accumulators held in registers over a block of tokens for the
// values. A step's products are arithmetic-bound on the plain form (one horizontal sum per token and row).

struct Scales {  // one float32 scale per (b, h, t), any strides; p == nullptr for 16-bit rows (scale 1)
  const float* p;
  int64_t s0, s1, s2;
  const float* at(int64_t b, int64_t h) const { return p ? p + b * s0 + h * s1 : nullptr; }
};

static Scales scales_of(const torch::Tensor& scale) {
  if (!scale.defined() || scale.numel() == 0) return {nullptr, 0, 0, 0};
  return {scale.data_ptr<float>(), scale.stride(0), scale.stride(1), scale.stride(2)};
}

// out[b,h,r,t] = scale[b,h,t] * sum_d q[b,h,r,d] * rows[b,h,t,d]
template <typename T>
static void logits_plain(const float* qp, const T* cp, Scales sc, float* op, int64_t B, int64_t H, int64_t R,
                         int64_t D, int64_t T_, int64_t c0, int64_t c1, int64_t c2) {
  const int64_t CHUNK = 512, chunks = (T_ + CHUNK - 1) / CHUNK;
  at::parallel_for(0, (B * H) * (chunks), 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t bh = item / (chunks), c = item % (chunks);
      const int64_t b = bh / H, h = bh % H;
      const T* base = cp + b * c0 + h * c1;
      const float* sbase = sc.at(b, h);
      const float* qh = qp + bh * R * D;
      float* oh = op + bh * R * T_;
      float row[1024];
      const int64_t end = std::min(T_, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        const T* k = base + t * c2;
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[d]);
        const float s = sbase ? sbase[t * sc.s2] : 1.f;
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
static void values_plain(const float* wp, const T* cp, Scales sc, float* pp, int64_t B, int64_t H, int64_t R,
                         int64_t D, int64_t T_, int64_t chunks, int64_t CHUNK, int64_t c0, int64_t c1,
                         int64_t c2) {
  at::parallel_for(0, (B * H) * (chunks), 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t bh = item / (chunks), c = item % (chunks);
      const int64_t b = bh / H, h = bh % H;
      const T* base = cp + b * c0 + h * c1;
      const float* sbase = sc.at(b, h);
      const float* wh = wp + bh * R * T_;
      float* acc = pp + ((c * B * H) + bh) * R * D;
      float row[1024];
      const int64_t end = std::min(T_, (c + 1) * CHUNK);
      for (int64_t t = c * CHUNK; t < end; ++t) {
        const T* v = base + t * c2;
        const float s = sbase ? sbase[t * sc.s2] : 1.f;
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

#ifdef KVWEAVE_BLOCKED
// Eight consecutive row elements widened to float32.
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

constexpr int64_t LANES = 8;  // query rows per register
constexpr int64_t TOKENS = 8;  // tokens in flight per logits block

template <typename T>
static void logits_blocked(const float* qp, const T* cp, Scales sc, float* op, int64_t B, int64_t H, int64_t R,
                           int64_t D, int64_t T_, int64_t c0, int64_t c1, int64_t c2) {
  const int64_t CHUNK = 512, chunks = (T_ + CHUNK - 1) / CHUNK, groups = (R + LANES - 1) / LANES;
  at::parallel_for(0, (B * H) * (chunks), 1, [&](int64_t first, int64_t last) {
    alignas(32) float qt[1024 * LANES];     // one group of query rows, transposed: qt[d * LANES + lane]
    alignas(32) float tile[TOKENS * 1024];  // TOKENS rows widened: tile[j * D + d]
    alignas(32) float res[TOKENS * LANES];
    for (int64_t item = first; item < last; ++item) {
      const int64_t bh = item / (chunks), c = item % (chunks);
      const int64_t b = bh / H, h = bh % H;
      const T* base = cp + b * c0 + h * c1;
      const float* sbase = sc.at(b, h);
      const float* qh = qp + bh * R * D;
      float* oh = op + bh * R * T_;
      const int64_t start = c * CHUNK, end = std::min(T_, (c + 1) * CHUNK);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = g * LANES, rows = std::min(LANES, R - r0);
        for (int64_t d = 0; d < D; ++d)
          for (int64_t l = 0; l < LANES; ++l) qt[d * LANES + l] = l < rows ? qh[(r0 + l) * D + d] : 0.f;
        for (int64_t t0 = start; t0 < end; t0 += TOKENS) {
          const int64_t n = std::min(TOKENS, end - t0);
          for (int64_t j = 0; j < TOKENS; ++j) {
            const T* k = base + (t0 + std::min(j, n - 1)) * c2;  // a short block repeats its last row
            for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(tile + j * D + d, load8(k + d));
          }
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
          for (int64_t d = 0; d < D; ++d) {
            const __m256 qd = _mm256_load_ps(qt + d * LANES);
            const float* td = tile + d;
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(td), qd, a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(td + D), qd, a1);
            a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(td + 2 * D), qd, a2);
            a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(td + 3 * D), qd, a3);
            a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(td + 4 * D), qd, a4);
            a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(td + 5 * D), qd, a5);
            a6 = _mm256_fmadd_ps(_mm256_broadcast_ss(td + 6 * D), qd, a6);
            a7 = _mm256_fmadd_ps(_mm256_broadcast_ss(td + 7 * D), qd, a7);
          }
          _mm256_store_ps(res, a0), _mm256_store_ps(res + 8, a1), _mm256_store_ps(res + 16, a2);
          _mm256_store_ps(res + 24, a3), _mm256_store_ps(res + 32, a4), _mm256_store_ps(res + 40, a5);
          _mm256_store_ps(res + 48, a6), _mm256_store_ps(res + 56, a7);
          for (int64_t j = 0; j < n; ++j) {
            const float s = sbase ? sbase[(t0 + j) * sc.s2] : 1.f;
            for (int64_t l = 0; l < rows; ++l) oh[(r0 + l) * T_ + t0 + j] = res[j * LANES + l] * s;
          }
        }
      }
    }
  });
}

template <typename T>
static void values_blocked(const float* wp, const T* cp, Scales sc, float* pp, int64_t B, int64_t H, int64_t R,
                           int64_t D, int64_t T_, int64_t chunks, int64_t CHUNK, int64_t c0, int64_t c1,
                           int64_t c2) {
  constexpr int64_t BLOCK = 64;  // tokens whose scaled weights are transposed at once
  const int64_t groups = (R + LANES - 1) / LANES;
  at::parallel_for(0, (B * H) * (chunks), 1, [&](int64_t first, int64_t last) {
    alignas(32) float wt[BLOCK * LANES];  // wt[j * LANES + lane] = w[r0 + lane, t0 + j] * scale[t0 + j]
    for (int64_t item = first; item < last; ++item) {
      const int64_t bh = item / (chunks), c = item % (chunks);
      const int64_t b = bh / H, h = bh % H;
      const T* base = cp + b * c0 + h * c1;
      const float* sbase = sc.at(b, h);
      const float* wh = wp + bh * R * T_;
      float* acc = pp + ((c * B * H) + bh) * R * D;
      const int64_t start = c * CHUNK, end = std::min(T_, (c + 1) * CHUNK);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = g * LANES, rows = std::min(LANES, R - r0);
        for (int64_t t0 = start; t0 < end; t0 += BLOCK) {
          const int64_t n = std::min(BLOCK, end - t0);
          for (int64_t j = 0; j < n; ++j) {
            const float s = sbase ? sbase[(t0 + j) * sc.s2] : 1.f;
            for (int64_t l = 0; l < LANES; ++l) wt[j * LANES + l] = l < rows ? wh[(r0 + l) * T_ + t0 + j] * s : 0.f;
          }
          for (int64_t d = 0; d < D; d += 8) {  // eight query rows x eight values of d, summed over the block
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t j = 0; j < n; ++j) {
              const __m256 v = load8(base + (t0 + j) * c2 + d);
              const float* wj = wt + j * LANES;
              a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(wj), v, a0);
              a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + 1), v, a1);
              a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + 2), v, a2);
              a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + 3), v, a3);
              a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + 4), v, a4);
              a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + 5), v, a5);
              a6 = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + 6), v, a6);
              a7 = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + 7), v, a7);
            }
            const __m256 sums[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
            for (int64_t l = 0; l < rows; ++l) {
              float* ar = acc + (r0 + l) * D + d;
              _mm256_storeu_ps(ar, _mm256_add_ps(_mm256_loadu_ps(ar), sums[l]));
            }
          }
        }
      }
    }
  });
}
#endif

#ifdef KVWEAVE_BLOCKED
// exp over eight lanes (Cephes' single-precision polynomial, ~1 ulp on [-87, 88]); -inf gives exactly 0.
static inline __m256 exp8(__m256 x) {
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  const __m256 masked = _mm256_cmp_ps(x, minus_inf, _CMP_EQ_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.3762f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(masked, _mm256_mul_ps(y, _mm256_castsi256_ps(power)));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

// One softmax over the concatenation of attention parts' logits, without concatenating them.
// logits: float32 contiguous [B,H,R,T_i] per part (-inf where hidden). Returns the probabilities per part
// ([B,H,R,T_i] each, softmax of scaling * logits over all parts together) and, last, each row's entropy
// -sum p log p ([B,H,R]), computed as log Z - sum(e x) / Z with x = scaling * (logit - max), e = exp(x).
// A row that sees nothing gets zero probabilities and zero entropy.
std::vector<torch::Tensor> parts_softmax(std::vector<torch::Tensor> logits, double scaling) {
  TORCH_CHECK(!logits.empty(), "parts_softmax: no parts");
  const auto& first = logits[0];
  TORCH_CHECK(first.dim() == 4, "parts_softmax: logits need rank 4");
  const int64_t rows = first.size(0) * first.size(1) * first.size(2);
  std::vector<const float*> in;
  std::vector<float*> outp;
  std::vector<int64_t> width;
  std::vector<torch::Tensor> out;
  for (const auto& part : logits) {
    TORCH_CHECK(part.scalar_type() == torch::kFloat && part.is_contiguous(),
                "parts_softmax: logits must be contiguous float32");
    TORCH_CHECK(part.dim() == 4 && part.size(0) == first.size(0) && part.size(1) == first.size(1) &&
                    part.size(2) == first.size(2),
                "parts_softmax: parts disagree on [B, H, R]");
    out.push_back(torch::empty_like(part));
    in.push_back(part.data_ptr<float>());
    outp.push_back(out.back().data_ptr<float>());
    width.push_back(part.size(3));
  }
  auto entropy = torch::empty({first.size(0), first.size(1), first.size(2)}, first.options());
  float* ep = entropy.data_ptr<float>();
  const float sc = static_cast<float>(scaling);
  const size_t parts = in.size();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float top = -INFINITY;
      for (size_t i = 0; i < parts; ++i) {
        const float* x = in[i] + row * width[i];
        int64_t j = 0;
#ifdef KVWEAVE_BLOCKED
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= width[i]; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + j));
        top = std::max(top, hmax8(m8));
#endif
        for (; j < width[i]; ++j) top = std::max(top, x[j]);
      }
      if (top == -INFINITY) {  // sees nothing (padding): zeros, the rule of masked_softmax
        for (size_t i = 0; i < parts; ++i) std::fill(outp[i] + row * width[i], outp[i] + (row + 1) * width[i], 0.f);
        ep[row] = 0.f;
        continue;
      }
      float total = 0.f, weighted = 0.f;
      for (size_t i = 0; i < parts; ++i) {
        const float* x = in[i] + row * width[i];
        float* o = outp[i] + row * width[i];
        int64_t j = 0;
#ifdef KVWEAVE_BLOCKED
        const __m256 top8 = _mm256_set1_ps(top), sc8 = _mm256_set1_ps(sc);
        __m256 t8 = _mm256_setzero_ps(), w8 = t8;
        for (; j + 8 <= width[i]; j += 8) {
          const __m256 raw = _mm256_loadu_ps(x + j);
          const __m256 hidden = _mm256_cmp_ps(raw, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
          const __m256 z = _mm256_andnot_ps(hidden, _mm256_mul_ps(_mm256_sub_ps(raw, top8), sc8));
          const __m256 e = _mm256_andnot_ps(hidden, exp8(z));
          _mm256_storeu_ps(o + j, e);
          t8 = _mm256_add_ps(t8, e);
          w8 = _mm256_fmadd_ps(e, z, w8);
        }
        total += hsum8(t8), weighted += hsum8(w8);
#endif
        for (; j < width[i]; ++j) {
          if (x[j] == -INFINITY) {
            o[j] = 0.f;
            continue;
          }
          const float z = (x[j] - top) * sc, e = std::exp(z);
          o[j] = e, total += e, weighted += e * z;
        }
      }
      const float inv = 1.f / total;
      for (size_t i = 0; i < parts; ++i) {
        float* o = outp[i] + row * width[i];
#pragma omp simd
        for (int64_t j = 0; j < width[i]; ++j) o[j] *= inv;
      }
      ep[row] = std::log(total) - weighted * inv;
    }
  });
  out.push_back(entropy);
  return out;
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

// Whether this build has the blocked form (AVX2 + FMA + F16C); it serves head dims that are a multiple of 8.
bool int8_blocked_available() {
#ifdef KVWEAVE_BLOCKED
  return true;
#else
  return false;
#endif
}

static bool use_blocked(bool blocked, int64_t D) {
#ifdef KVWEAVE_BLOCKED
  return blocked && D % 8 == 0;
#else
  return false;
#endif
}

// Calls f(typed pointer to the rows) for the rows' dtype.
template <typename F>
static void on_rows(const torch::Tensor& codes, F&& f) {
  switch (codes.scalar_type()) {
    case torch::kChar: f(codes.data_ptr<int8_t>()); break;
    case torch::kBFloat16: f(codes.data_ptr<at::BFloat16>()); break;
    default: f(codes.data_ptr<at::Half>());
  }
}

// q: [B,H,R,D] float32 contiguous; rows: [B,H,T,D] (last dim contiguous, any other strides); scale: [B,H,T]
// float32 (any strides) for int8 rows, an empty tensor for 16-bit rows. `blocked` picks the blocked form where
// the build and the head dim allow it, the plain form otherwise.
torch::Tensor int8_logits(torch::Tensor q, torch::Tensor codes, torch::Tensor scale, bool blocked) {
  TORCH_CHECK(q.dim() == 4, "int8_logits: bad ranks");
  check_rows(codes, scale, "int8_logits");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), T = codes.size(2);
  auto out = torch::empty({B, H, R, T}, q.options());
  const Scales sc = scales_of(scale);
  const int64_t c0 = codes.stride(0), c1 = codes.stride(1), c2 = codes.stride(2);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool fast = use_blocked(blocked, D);
  on_rows(codes, [&](auto* cp) {
#ifdef KVWEAVE_BLOCKED
    if (fast) return logits_blocked(qp, cp, sc, op, B, H, R, D, T, c0, c1, c2);
#endif
    logits_plain(qp, cp, sc, op, B, H, R, D, T, c0, c1, c2);
  });
  return out;
}

// w: [B,H,R,T] float32 contiguous; rows, scale, blocked as in int8_logits.
torch::Tensor int8_values(torch::Tensor w, torch::Tensor codes, torch::Tensor scale, bool blocked) {
  TORCH_CHECK(w.dim() == 4, "int8_values: bad ranks");
  check_rows(codes, scale, "int8_values");
  const int64_t B = w.size(0), H = w.size(1), R = w.size(2), T = w.size(3), D = codes.size(3);
  const int64_t CHUNK = 1024, chunks = std::max<int64_t>(1, (T + CHUNK - 1) / CHUNK);
  auto partial = torch::zeros({chunks, B, H, R, D}, w.options());
  const Scales sc = scales_of(scale);
  const int64_t c0 = codes.stride(0), c1 = codes.stride(1), c2 = codes.stride(2);
  const float* wp = w.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  const bool fast = use_blocked(blocked, D);
  on_rows(codes, [&](auto* cp) {
#ifdef KVWEAVE_BLOCKED
    if (fast) return values_blocked(wp, cp, sc, pp, B, H, R, D, T, chunks, CHUNK, c0, c1, c2);
#endif
    values_plain(wp, cp, sc, pp, B, H, R, D, T, chunks, CHUNK, c0, c1, c2);
  });
  return chunks == 1 ? partial[0] : partial.sum(0);
}
