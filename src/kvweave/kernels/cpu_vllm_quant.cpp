#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVW_AVX2 1
#endif

// Decode attention of a layer's decode rows straight from kvweave's packed vLLM blocks (QuantSlot layout): per
// slot [key codes (C bytes) | value codes (C) | value scale, min (float16, VG each) | tail]; a block's tails,
// read in slot order from byte `start`, begin with its key groups' headers (float16 scale [D], minimum [D]
// each). Keys are per channel over key groups, values per token over channel groups; codes are packed along
// the channels, 8 / bits per byte, the first channel in the lowest bits. A row's tokens from `quantized` on
// take their keys from its residual row ([H, block_size, D] float32, the exact keys of its unfinished group).
//
// Work is cut into items of (row, KV head, run of blocks) of about equal size, run in parallel; each item keeps
// an online softmax, and one pass per (row, head) merges its items and, when given, the row's new token
// (exact key and value). Inside an item the codes are unpacked "planar": for 4 bits the low nibbles of a
// slot's code bytes (channels 0, 2, 4, ...) then the high ones (1, 3, 5, ...), so unpacking is a shift and a
// mask over contiguous bytes; the query is permuted the same way once per item and the output back once per
// row. Keys are never dequantized: a group's per-channel scale is folded into the query and its minimum into
// one dot product per query head, so a token's logit is the query's dot product with its codes; a tile's key
// codes are transposed first, so that a query head's logits are vectorized over the tile's tokens. Values with
// one group per head are not dequantized either: their scale goes into the attention weights and their
// minimum into one running sum per query head.
//
// q: [R, H, G, D] f32 (each row's query heads, packed per KV head); k_new, v_new: [R, H, D] f32 or empty;
// pages: [NB, H, BS, SLOT] uint8; table: [R, W] block ids (int32 as vLLM keeps them, or int64); cached,
// quantized, res_row: one int each per row (res_row: the row's residual row, -1 for none); residual:
// [X, H, BS, D] f32 or empty. Returns
// out [R, H, G, D] f32 and lse [R, H, G] f32 (natural log of the scaled logits' sum; -inf where nothing
// was attended).

static inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// exp(x) for x <= 0 in float32 (relative error ~2e-7): 2^floor * a degree-6 polynomial of the fraction, plain
// arithmetic so that loops over it vectorize. Below -87 it returns exp(-87) (~1.6e-38), which times a zero
// running sum is still zero.
static inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#ifdef KVW_AVX2
// The hot loops of a tile with AVX2 + FMA intrinsics (16 vector registers): what the compiler's own
// vectorization of the portable loops left as scalar exponentials and spilled accumulators. Same arithmetic
// (float32, the same exponential polynomial), in the same order per output lane.
static inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 fi = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The tile's key codes as floats, channel-major: kt[d, t] for channel d (byte d / PB, its (d % PB)-th code), tokens t < T (lanes past T
// repeat token T - 1). One gather reads 4 code bytes of 8 tokens (slots `slot_bytes` apart), which are then
// 4 * 8 / BITS channels of those 8 tokens: shifts and masks, no byte transposition.
template <int BITS, int64_t TILE>
static inline void unpack_keys_avx2(const uint8_t* first, int64_t slot_bytes, int64_t T, int64_t C, float* kt) {
  constexpr int PB = 8 / BITS;
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  for (int64_t t8 = 0; t8 < T; t8 += 8) {
    alignas(32) int32_t idx[8];
    for (int i = 0; i < 8; ++i) idx[i] = static_cast<int32_t>(std::min<int64_t>(t8 + i, T - 1) * slot_bytes);
    const __m256i at = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
    for (int64_t w = 0; w < C; w += 4) {
      const __m256i word = _mm256_i32gather_epi32(reinterpret_cast<const int*>(first + w), at, 1);
      for (int i = 0; i < 4; ++i)
        for (int p = 0; p < PB; ++p) {
          const __m128i shift = _mm_cvtsi32_si128(8 * i + p * BITS);
          const __m256i code = _mm256_and_si256(_mm256_srl_epi32(word, shift), mask);
          _mm256_storeu_ps(kt + ((w + i) * PB + p) * TILE + t8, _mm256_cvtepi32_ps(code));
        }
    }
  }
}

// x[g, t] = q[g] . kt[:, t] for NG query heads and 32 tokens from t0: NG x 4 accumulators in registers, each
// key row loaded once for the NG heads.
template <int NG, int64_t TILE>
static inline void logits_avx2(const float* q, const float* kt, int64_t D, int64_t t0, float* x) {
  __m256 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = kt + d * TILE + t0;
    const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8);
    const __m256 k2 = _mm256_loadu_ps(kd + 16), k3 = _mm256_loadu_ps(kd + 24);
    for (int g = 0; g < NG; ++g) {
      const __m256 w = _mm256_broadcast_ss(q + g * D + d);
      a[g][0] = _mm256_fmadd_ps(w, k0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(w, k1, a[g][1]);
      a[g][2] = _mm256_fmadd_ps(w, k2, a[g][2]);
      a[g][3] = _mm256_fmadd_ps(w, k3, a[g][3]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(x + g * TILE + t0 + 8 * c, a[g][c]);
}

// acc[g, :] += sum over t < T of p[g, t] * v[t, :] for NG query heads: NG x 2 accumulators (16 channels) in
// registers, each value row loaded once for the NG heads.
template <int NG>
static inline void accumulate_avx2(const float* p, int64_t stride, const float* v, float* acc, int64_t T,
                                   int64_t D) {
  for (int64_t c = 0; c < D; c += 16) {
    __m256 a[NG][2];
    for (int g = 0; g < NG; ++g) {
      a[g][0] = _mm256_loadu_ps(acc + g * D + c);
      a[g][1] = _mm256_loadu_ps(acc + g * D + c + 8);
    }
    for (int64_t t = 0; t < T; ++t) {
      const __m256 v0 = _mm256_loadu_ps(v + t * D + c), v1 = _mm256_loadu_ps(v + t * D + c + 8);
      for (int g = 0; g < NG; ++g) {
        const __m256 w = _mm256_broadcast_ss(p + g * stride + t);
        a[g][0] = _mm256_fmadd_ps(w, v0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(w, v1, a[g][1]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm256_storeu_ps(acc + g * D + c, a[g][0]);
      _mm256_storeu_ps(acc + g * D + c + 8, a[g][1]);
    }
  }
}
#endif

struct Item {
  int64_t row, head, b_first, b_end;
};

struct Shape {
  int64_t H, G, D, BS, SLOT, W, group, key_group, code_bytes, value_bytes;
  float scale;
};

// One item: the online softmax over its blocks, a tile of tokens (at most one key group, at most 64 tokens) at
// a time. m, l: [G]; acc: [G, D] in planar channel order.
// acc[g, :] += sum over the tile's tokens t of p[g, t] * v[t, :] (p: [G, stride], v: [T, D]). With the head
// size fixed, GB query heads' sums stay in registers over the tile and each value row is loaded once for them.
template <int DIM>
static inline void accumulate(const float* p, int64_t stride, const float* v, float* acc, int64_t G, int64_t T,
                              int64_t D) {
#ifdef KVW_AVX2
  if constexpr (DIM > 0 && DIM % 16 == 0) {
    int64_t g0 = 0;
    for (; g0 + 4 <= G; g0 += 4) accumulate_avx2<4>(p + g0 * stride, stride, v, acc + g0 * DIM, T, DIM);
    if (G - g0 == 3) accumulate_avx2<3>(p + g0 * stride, stride, v, acc + g0 * DIM, T, DIM);
    if (G - g0 == 2) accumulate_avx2<2>(p + g0 * stride, stride, v, acc + g0 * DIM, T, DIM);
    if (G - g0 == 1) accumulate_avx2<1>(p + g0 * stride, stride, v, acc + g0 * DIM, T, DIM);
    return;
  }
#endif
  if constexpr (DIM > 0) {
    constexpr int64_t GB = DIM <= 64 ? 4 : 2;
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
      const int64_t gn = std::min<int64_t>(GB, G - g0);
      float a[GB][DIM];
      for (int64_t gb = 0; gb < GB; ++gb)
        for (int64_t i = 0; i < DIM; ++i) a[gb][i] = gb < gn ? acc[(g0 + gb) * DIM + i] : 0.f;
      for (int64_t t = 0; t < T; ++t) {
        const float* vt = v + t * DIM;
        for (int64_t gb = 0; gb < GB; ++gb) {
          const float w = gb < gn ? p[(g0 + gb) * stride + t] : 0.f;
#pragma omp simd
          for (int64_t i = 0; i < DIM; ++i) a[gb][i] += w * vt[i];
        }
      }
      for (int64_t gb = 0; gb < gn; ++gb)
        for (int64_t i = 0; i < DIM; ++i) acc[(g0 + gb) * DIM + i] = a[gb][i];
    }
  } else {
    for (int64_t g = 0; g < G; ++g) {
      float* ag = acc + g * D;
      for (int64_t t = 0; t < T; ++t) {
        const float w = p[g * stride + t];
        const float* vt = v + t * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) ag[i] += w * vt[i];
      }
    }
  }
}

// One thread's working buffers for attend_item, kept between items and calls (vector growth zero-fills; what
// an item reads it writes first, except lanes past a tile's tokens, which no result reads).
struct Scratch {
  std::vector<float> qs, qm, kscale, kmin, kt, vv, x, vscale, vmin, msum;
  std::vector<uint8_t> cb, header;
  void fit(int64_t G, int64_t D, int64_t C, int64_t TILE) {
    for (auto* v : {&qs, &x}) v->resize(std::max<size_t>(v->size(), G * std::max(D, TILE)));
    for (auto* v : {&qm, &msum}) v->resize(std::max<size_t>(v->size(), G));
    for (auto* v : {&kscale, &kmin}) v->resize(std::max<size_t>(v->size(), D));
    for (auto* v : {&kt, &vv}) v->resize(std::max<size_t>(v->size(), D * TILE));
    for (auto* v : {&vscale, &vmin}) v->resize(std::max<size_t>(v->size(), TILE));
    cb.resize(std::max<size_t>(cb.size(), C * TILE));
    header.resize(std::max<size_t>(header.size(), 4 * D));
  }
};

static Scratch& scratch() {
  thread_local Scratch buffers;
  return buffers;
}

template <int BITS, int DIM>  // DIM: the head size fixed at compile time (loops unrolled), 0 for any
static void attend_item(const Item& it, const Shape& s, const float* q, const uint8_t* pages, const int64_t* ids,
                        int64_t cached, int64_t quantized, const float* res, float* m, float* l, float* acc) {
  constexpr int PB = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  constexpr int64_t TILE = 64;
#ifdef __AVX512F__
  constexpr int64_t LG = 4;  // query heads per block of logits: 4 x 64 accumulators fit 32 vector registers
#else
  constexpr int64_t LG = 2;
#endif
  const int64_t H = s.H, G = s.G, D = DIM > 0 ? DIM : s.D, BS = s.BS, SLOT = s.SLOT, C = s.code_bytes;
  const int64_t J = D / PB;  // code bytes per token: planar index p * J + j is channel j * PB + p
  const int64_t start = C + s.value_bytes, tail = SLOT - start;
  const int64_t VG = D / s.group, seg = s.group / PB;  // value group vg covers planar j in [vg*seg, (vg+1)*seg)
  Scratch& sc = scratch();  // this thread's buffers, grown once: an item's fixed cost is not an allocation
  sc.fit(G, D, C, TILE);
  std::vector<float>&qs = sc.qs, &qm = sc.qm, &kscale = sc.kscale, &kmin = sc.kmin, &kt = sc.kt, &vv = sc.vv;
  std::vector<float>&x = sc.x, &vscale = sc.vscale, &vmin = sc.vmin, &msum = sc.msum;
  std::vector<uint8_t>&cb = sc.cb, &header = sc.header;  // cb: the tile's key code bytes, transposed
  std::fill(msum.begin(), msum.begin() + G, 0.f);
  for (int64_t g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t bi = it.b_first; bi < it.b_end; ++bi) {
    const uint8_t* block = pages + ((ids[bi] * H + it.head) * BS) * SLOT;
    for (int64_t t0 = 0; t0 < BS; t0 += std::min(TILE, s.key_group)) {
      const int64_t first_token = bi * BS + t0;
      if (first_token >= cached) break;
      const int64_t T = std::min({TILE, s.key_group - t0 % s.key_group, BS - t0, cached - first_token});
      const bool exact = first_token >= quantized;  // a key group is quantized whole or not at all
      const float* qeff = q;
      // keys channel-major, kt[d, t]: the logits of a query head are then vectorized over the tile's tokens
      if (exact) {
        for (int64_t t = 0; t < T; ++t) {
          const float* rk = res + (it.head * BS + t0 + t) * D;
          for (int64_t d = 0; d < D; ++d) kt[d * TILE + t] = rk[d];
        }
      } else {  // the group's (scale, minimum), folded into the query: bytes kg*4D.. of the block's tails
        const int64_t kg = t0 / s.key_group;
        for (int64_t done = 0; done < 4 * D;) {  // the header's 4D bytes, copied from the tails they span
          const int64_t at = kg * 4 * D + done, in_tail = at % tail;
          const int64_t piece = std::min(tail - in_tail, 4 * D - done);
          std::memcpy(header.data() + done, block + (at / tail) * SLOT + start + in_tail, piece);
          done += piece;
        }
        for (int64_t d = 0; d < D; ++d) {
          kscale[d] = half_at(header.data() + 2 * d);
          kmin[d] = half_at(header.data() + 2 * D + 2 * d);
        }
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            qs[g * D + d] = q[g * D + d] * kscale[d];
            dot += q[g * D + d] * kmin[d];
          }
          qm[g] = dot;
        }
        qeff = qs.data();
#ifdef KVW_AVX2
        if (DIM > 0 && C % 4 == 0) {
          unpack_keys_avx2<BITS, TILE>(block + t0 * SLOT, SLOT, T, C, kt.data());
        } else
#endif
        {
          for (int64_t t = 0; t < T; ++t) {
            const uint8_t* slot = block + (t0 + t) * SLOT;
            for (int64_t j = 0; j < C; ++j) cb[j * TILE + t] = slot[j];
          }
          for (int64_t j = 0; j < C; ++j) {
            const uint8_t* src = cb.data() + j * TILE;
            for (int p = 0; p < PB; ++p) {
              float* dst = kt.data() + (j * PB + p) * TILE;
#pragma omp simd
              for (int64_t t = 0; t < TILE; ++t) dst[t] = static_cast<float>((src[t] >> (p * BITS)) & MASK);
            }
          }
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        const uint8_t* slot = block + (t0 + t) * SLOT;
        const uint8_t* vcodes = slot + C;
        const uint8_t* vmeta = slot + 2 * C;
        float* value = vv.data() + t * D;
        if (VG == 1) {  // one (scale, minimum) per token: codes kept, the scale goes into the weights
          vscale[t] = half_at(vmeta), vmin[t] = half_at(vmeta + 2);
          for (int p = 0; p < PB; ++p) {
            float* out = value + p * J;
#pragma omp simd
            for (int64_t j = 0; j < J; ++j) out[j] = static_cast<float>((vcodes[j] >> (p * BITS)) & MASK);
          }
          continue;
        }
        for (int64_t vg = 0; vg < VG; ++vg) {  // one (scale, minimum) per value group: two float16 reads
          const float vs = half_at(vmeta + 2 * vg), vm = half_at(vmeta + 2 * (VG + vg));
          for (int p = 0; p < PB; ++p) {
            float* out = value + p * J;
#pragma omp simd
            for (int64_t j = vg * seg; j < (vg + 1) * seg; ++j)
              out[j] = static_cast<float>((vcodes[j] >> (p * BITS)) & MASK) * vs + vm;
          }
        }
      }
#ifdef KVW_AVX2
      if constexpr (DIM > 0) {  // logits [g, t] = q_eff[g] . kt[:, t], 32 tokens and two query heads at a time
        for (int64_t h = 0; h < T; h += 32) {
          int64_t g0 = 0;
          for (; g0 + 2 <= G; g0 += 2) logits_avx2<2, TILE>(qeff + g0 * D, kt.data(), D, h, x.data() + g0 * TILE);
          if (g0 < G) logits_avx2<1, TILE>(qeff + g0 * D, kt.data(), D, h, x.data() + g0 * TILE);
        }
        for (int64_t g = 0; g < G; ++g) {
          const float add = exact ? 0.f : qm[g];
          float* xg = x.data() + g * TILE;
#pragma omp simd
          for (int64_t t = 0; t < T; ++t) xg[t] = (xg[t] + add) * s.scale;
        }
      } else
#endif
      for (int64_t g0 = 0; g0 < G; g0 += LG) {  // logits [g, t] = q_eff[g] . kt[:, t] (+ the minima's dot)
        int64_t gs[LG];  // LG query heads share each row of kt (the last block repeats its last head)
        for (int64_t k = 0; k < LG; ++k) gs[k] = std::min(g0 + k, G - 1);
        float a[LG][TILE];
        for (int64_t k = 0; k < LG; ++k)
          for (int64_t t = 0; t < TILE; ++t) a[k][t] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          float w[LG];
          for (int64_t k = 0; k < LG; ++k) w[k] = qeff[gs[k] * D + d];
          const float* kd = kt.data() + d * TILE;
          for (int64_t k = 0; k < LG; ++k) {
#pragma omp simd
            for (int64_t t = 0; t < TILE; ++t) a[k][t] += w[k] * kd[t];
          }
        }
        for (int64_t k = 0; k < LG && g0 + k < G; ++k) {
          const float add = exact ? 0.f : qm[g0 + k];
          for (int64_t t = 0; t < T; ++t) x[(g0 + k) * TILE + t] = (a[k][t] + add) * s.scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* xg = x.data() + g * TILE;
        float top = m[g], sum = 0.f, low = 0.f;
        int64_t t = 0;
#ifdef KVW_AVX2
        {
          __m256 vtop = _mm256_set1_ps(top);
          for (; t + 8 <= T; t += 8) vtop = _mm256_max_ps(vtop, _mm256_loadu_ps(xg + t));
          top = hmax8(vtop);
        }
#endif
        for (; t < T; ++t) top = std::max(top, xg[t]);
        const float alpha = exp_neg(m[g] - top);  // ~0 when m was -inf, and l, acc are 0 then
        t = 0;
#ifdef KVW_AVX2
        {
          const __m256 vtop = _mm256_set1_ps(top);
          __m256 vsum = _mm256_setzero_ps(), vlow = _mm256_setzero_ps();
          for (; t + 8 <= T; t += 8) {
            __m256 p = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(xg + t), vtop));
            vsum = _mm256_add_ps(vsum, p);
            if (VG == 1) {  // sum of p * (code * scale + min): the minima's part apart, the scales into p
              vlow = _mm256_fmadd_ps(p, _mm256_loadu_ps(vmin.data() + t), vlow);
              p = _mm256_mul_ps(p, _mm256_loadu_ps(vscale.data() + t));
            }
            _mm256_storeu_ps(xg + t, p);
          }
          sum = hsum8(vsum), low = hsum8(vlow);
        }
#endif
        for (; t < T; ++t) {
          const float p = exp_neg(xg[t] - top);
          sum += p;
          if (VG == 1) low += p * vmin[t];
          xg[t] = VG == 1 ? p * vscale[t] : p;
        }
        if (VG == 1) msum[g] = msum[g] * alpha + low;
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) ag[i] *= alpha;
        l[g] = l[g] * alpha + sum;
        m[g] = top;
      }
      accumulate<DIM>(x.data(), TILE, vv.data(), acc, G, T, D);
    }
  }
  if (VG == 1)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < D; ++i) acc[g * D + i] += msum[g];
}

template <int BITS>
static void dispatch_dim(int64_t D, const Item& it, const Shape& s, const float* q, const uint8_t* pages,
                         const int64_t* ids, int64_t cached, int64_t quantized, const float* res, float* m, float* l,
                         float* acc) {
  if (D == 64)
    attend_item<BITS, 64>(it, s, q, pages, ids, cached, quantized, res, m, l, acc);
  else if (D == 128)
    attend_item<BITS, 128>(it, s, q, pages, ids, cached, quantized, res, m, l, acc);
  else
    attend_item<BITS, 0>(it, s, q, pages, ids, cached, quantized, res, m, l, acc);
}

static void dispatch(int bits, int64_t D, const Item& it, const Shape& s, const float* q, const uint8_t* pages,
                     const int64_t* ids, int64_t cached, int64_t quantized, const float* res, float* m, float* l,
                     float* acc) {
  if (bits == 2)
    dispatch_dim<2>(D, it, s, q, pages, ids, cached, quantized, res, m, l, acc);
  else if (bits == 4)
    dispatch_dim<4>(D, it, s, q, pages, ids, cached, quantized, res, m, l, acc);
  else
    dispatch_dim<8>(D, it, s, q, pages, ids, cached, quantized, res, m, l, acc);
}

std::vector<torch::Tensor> vllm_quant_decode_rows(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new,
                                                  torch::Tensor pages, torch::Tensor table,
                                                  const std::vector<int64_t>& cached,
                                                  const std::vector<int64_t>& quantized, torch::Tensor residual,
                                                  const std::vector<int64_t>& res_row, int64_t bits, int64_t group,
                                                  int64_t key_group, int64_t code_bytes, int64_t value_bytes,
                                                  double scaling, int64_t item_blocks) {
  const int64_t R = q.size(0);
  if (table.scalar_type() != at::kLong) table = table.to(at::kLong);  // vLLM's block tables are int32
  table = table.contiguous();
  Shape s{q.size(1), q.size(2),        q.size(3), pages.size(2),          pages.size(3),
          table.size(1), group,        key_group, code_bytes, value_bytes, static_cast<float>(scaling)};
  const int64_t H = s.H, G = s.G, D = s.D;
  TORCH_CHECK(pages.size(1) == H, "vllm_quant_decode_rows: pages hold ", pages.size(1), " heads, the query ", H);
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "vllm_quant_decode_rows: bits must be 2, 4 or 8");
  TORCH_CHECK(table.size(0) == R && static_cast<int64_t>(cached.size()) == R &&
                  static_cast<int64_t>(quantized.size()) == R && static_cast<int64_t>(res_row.size()) == R,
              "vllm_quant_decode_rows: table, cached, quantized and res_row need one entry per row");
  TORCH_CHECK(residual.numel() == 0 || (residual.scalar_type() == at::kFloat && residual.is_contiguous()),
              "vllm_quant_decode_rows: the residual rows must be contiguous float32");
  const bool with_new = k_new.numel() > 0;
  const int64_t* cp = cached.data();
  const int64_t* qz = quantized.data();
  const int64_t* rr = res_row.data();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK((cp[r] + s.BS - 1) / s.BS <= s.W, "vllm_quant_decode_rows: row ", r, " holds ", cp[r],
                " tokens, more than its block table's ", s.W, " blocks");
    TORCH_CHECK(qz[r] >= cp[r] || (rr[r] >= 0 && rr[r] < residual.size(0)),
                "vllm_quant_decode_rows: row ", r, "'s tokens past its quantized groups need a residual row");
  }
  // items of about `item_blocks` blocks: equal-sized work, so the threads' even split of them stays balanced
  std::vector<Item> items;
  std::vector<int64_t> first_item(R * H + 1, 0);
  const int64_t per = std::max<int64_t>(1, item_blocks);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t held = (cp[r] + s.BS - 1) / s.BS;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t b = 0; b < held; b += per) items.push_back({r, h, b, std::min(held, b + per)});
      first_item[r * H + h + 1] = static_cast<int64_t>(items.size());
    }
  }
  const int64_t N = static_cast<int64_t>(items.size());
  std::vector<float> m(N * G), l(N * G), acc(N * G * D);
  const float* qp = q.data_ptr<float>();
  const uint8_t* pp = pages.data_ptr<uint8_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const float* rp = residual.numel() > 0 ? residual.data_ptr<float>() : nullptr;
  const int64_t res_stride = H * s.BS * D;
  at::parallel_for(0, N, 1, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      const Item& it = items[n];
      const float* qrow = qp + (it.row * H + it.head) * G * D;
      const float* res = rr[it.row] >= 0 && rp != nullptr ? rp + rr[it.row] * res_stride : nullptr;
      const int64_t* ids = tp + it.row * s.W;
      float *mn = m.data() + n * G, *ln = l.data() + n * G, *an = acc.data() + n * G * D;
      dispatch(static_cast<int>(bits), D, it, s, qrow, pp, ids, cp[it.row], qz[it.row], res, mn, ln, an);
    }
  });
  auto out = torch::zeros({R, H, G, D}, q.options());
  auto lse = torch::full({R, H, G}, -std::numeric_limits<float>::infinity(), q.options());
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float* kp = with_new ? k_new.data_ptr<float>() : nullptr;
  const float* vp = with_new ? v_new.data_ptr<float>() : nullptr;
  const int PB = 8 / static_cast<int>(bits);
  const int64_t J = D / PB;
  at::parallel_for(0, R * H, 1, [&](int64_t first, int64_t last) {
    std::vector<float> sum(D);
    for (int64_t rh = first; rh < last; ++rh) {
      const float* qrow = qp + rh * G * D;
      for (int64_t g = 0; g < G; ++g) {
        float top = -std::numeric_limits<float>::infinity(), new_logit = 0.f;
        for (int64_t n = first_item[rh]; n < first_item[rh + 1]; ++n) top = std::max(top, m[n * G + g]);
        if (with_new) {
          const float* key = kp + rh * D;
          for (int64_t d = 0; d < D; ++d) new_logit += qrow[g * D + d] * key[d];
          new_logit *= s.scale;
          top = std::max(top, new_logit);
        }
        if (top == -std::numeric_limits<float>::infinity()) continue;  // nothing attended
        float total = 0.f;
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int64_t n = first_item[rh]; n < first_item[rh + 1]; ++n) {
          const float w = std::exp(m[n * G + g] - top);
          total += w * l[n * G + g];
          const float* an = acc.data() + (n * G + g) * D;
          for (int64_t d = 0; d < D; ++d) sum[d] += w * an[d];  // planar order
        }
        float* o = op + (rh * G + g) * D;
        for (int64_t p = 0; p < PB; ++p)
          for (int64_t j = 0; j < J; ++j) o[j * PB + p] = sum[p * J + j];
        if (with_new) {
          const float w = std::exp(new_logit - top);
          total += w;
          const float* value = vp + rh * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * value[d];
        }
        for (int64_t d = 0; d < D; ++d) o[d] /= total;
        lp[rh * G + g] = top + std::log(total);
      }
    }
  });
  return {out, lse};
}

// The write hook's value half: each token's value ``value: [N, H, D]`` (float32) quantized per token over groups
// of ``group`` channels (asymmetric min/max, the codes against the float16-rounded scale and minimum, as
// kvweave.ops.quantize.quantize computes them) and written into its slot (``blocks, offsets: [N]`` int64) of
// ``pages: [NB, H, BS, SLOT]`` at byte ``code_bytes``: the packed codes, then the groups' float16 scales, then
// their minima. Returns false (and writes nothing) if a value is NaN/Inf or its scale overflows float16.
static bool write_values(const torch::Tensor& value, torch::Tensor& pages, const int64_t* bp, const int64_t* op,
                         int64_t bits, int64_t group, int64_t code_bytes) {
  const int64_t N = value.size(0), H = value.size(1), D = value.size(2);
  TORCH_CHECK(value.scalar_type() == at::kFloat && value.is_contiguous() && pages.is_contiguous(),
              "vllm_quant_write: contiguous float32 values and contiguous pages");
  const int64_t BS = pages.size(2), SLOT = pages.size(3), VG = D / group, PB = 8 / bits;
  const int levels = (1 << bits) - 1;
  const float* vp = value.data_ptr<float>();
  uint8_t* pp = pages.data_ptr<uint8_t>();
  std::vector<uint8_t> out(N * H * (code_bytes + 4 * VG));
  std::vector<uint8_t> codes(D);
  const int64_t width = code_bytes + 4 * VG;
  for (int64_t nh = 0; nh < N * H; ++nh) {
    const float* x = vp + nh * D;
    uint8_t* o = out.data() + nh * width;
    for (int64_t vg = 0; vg < VG; ++vg) {
      const float* xg = x + vg * group;
      float low = xg[0], high = xg[0];
      for (int64_t d = 0; d < group; ++d) {
        if (!std::isfinite(xg[d])) return false;
        low = std::min(low, xg[d]), high = std::max(high, xg[d]);
      }
      const at::Half scale_h = static_cast<at::Half>((high - low) / static_cast<float>(levels));
      const at::Half min_h = static_cast<at::Half>(low);
      const float scale = static_cast<float>(scale_h), minimum = static_cast<float>(min_h);
      if (!std::isfinite(scale) || !std::isfinite(minimum)) return false;
      const float step = scale == 0.f ? 1.f : scale;
      for (int64_t d = 0; d < group; ++d) {
        const float c = std::nearbyint((xg[d] - minimum) / step);
        codes[vg * group + d] = static_cast<uint8_t>(std::min(std::max(c, 0.f), static_cast<float>(levels)));
      }
      std::memcpy(o + code_bytes + 2 * vg, &scale_h, 2);
      std::memcpy(o + code_bytes + 2 * (VG + vg), &min_h, 2);
    }
    for (int64_t j = 0; j < code_bytes; ++j) {
      int byte = 0;
      for (int64_t k = 0; k < PB; ++k) byte |= codes[j * PB + k] << (k * bits);
      o[j] = static_cast<uint8_t>(byte);
    }
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(pp + ((bp[n] * H + h) * BS + op[n]) * SLOT + code_bytes, out.data() + (n * H + h) * width,
                  width);
  return true;
}

bool vllm_quant_write_values(torch::Tensor value, torch::Tensor pages, torch::Tensor blocks, torch::Tensor offsets,
                             int64_t bits, int64_t group, int64_t code_bytes) {
  TORCH_CHECK(blocks.numel() == value.size(0) && offsets.numel() == value.size(0),
              "vllm_quant_write_values: one block and offset per token");
  return write_values(value, pages, blocks.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), bits, group,
                      code_bytes);
}

// A decode step's whole write hook in one call (a handful of tokens; the backend's few-token path): the values
// as vllm_quant_write_values, and each key whose ``rows[n]`` is not -1 copied, exact, into slot ``offsets[n]``
// of residual row ``rows[n]`` (``residual: [X, H, BS, D]``, the key's dtype). Returns false as
// vllm_quant_write_values does, before writing anything.
bool vllm_quant_write_step(torch::Tensor key, torch::Tensor value, torch::Tensor pages, torch::Tensor residual,
                           const std::vector<int64_t>& blocks, const std::vector<int64_t>& offsets,
                           const std::vector<int64_t>& rows, int64_t bits, int64_t group, int64_t code_bytes) {
  const int64_t N = value.size(0), H = value.size(1), D = value.size(2), BS = pages.size(2);
  TORCH_CHECK(static_cast<int64_t>(blocks.size()) == N && static_cast<int64_t>(offsets.size()) == N &&
                  static_cast<int64_t>(rows.size()) == N && key.size(0) == N,
              "vllm_quant_write_step: one key, block, offset and residual row per value");
  TORCH_CHECK(key.scalar_type() == residual.scalar_type() && key.is_contiguous() && residual.is_contiguous() &&
                  residual.size(1) == H && residual.size(2) == BS && residual.size(3) == D,
              "vllm_quant_write_step: contiguous keys of the residual's dtype and shape");
  if (!write_values(value, pages, blocks.data(), offsets.data(), bits, group, code_bytes)) return false;
  const int64_t width = D * key.element_size();
  const auto* kp = static_cast<const uint8_t*>(key.data_ptr());
  auto* rp = static_cast<uint8_t*>(residual.data_ptr());
  for (int64_t n = 0; n < N; ++n) {
    if (rows[n] < 0) continue;
    TORCH_CHECK(rows[n] < residual.size(0) && offsets[n] < BS, "vllm_quant_write_step: residual row out of range");
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(rp + ((rows[n] * H + h) * BS + offsets[n]) * width, kp + (n * H + h) * width, width);
  }
  return true;
}
