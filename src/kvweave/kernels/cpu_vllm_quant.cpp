#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// Decode attention of one request straight from kvweave's packed vLLM blocks (QuantSlot layout): per slot
// [key codes (C bytes) | value codes (C) | value scale, min (float16, VG each) | tail]; a block's tails, read
// in slot order from byte `start`, begin with its key groups' headers (float16 scale [D], minimum [D] each).
// Keys are per channel over key groups, values per token over channel groups; codes are packed along the
// channels, 8 / bits per byte, the first channel in the lowest bits. Tokens from `quantized` on take their
// keys from `residual` ([H, block_size, D] float32, the exact keys of the last, unfinished group).
//
// q: [H, G, D] f32 (the request's query heads, packed per KV head); pages: [NB, H, BS, SLOT] uint8;
// ids: [held] int64 block ids in order. Returns out [S, H, G, D] f32 (normalised per split) and
// lse [S, H, G] f32 (natural log of the scaled logits' sum; -inf where a split saw no token).

static inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// One (split, KV head): the online softmax over the split's blocks, a tile of tokens (at most one key group,
// at most 64 tokens) at a time: keys decoded and scored for the whole tile, then one rescale of the running sums.
template <int BITS>
static void attend_split(const float* qp, const uint8_t* pp, const int64_t* idp, const float* rp, int64_t h,
                         int64_t H, int64_t G, int64_t D, int64_t BS, int64_t SLOT, int64_t b_first, int64_t b_end,
                         int64_t cached, int64_t quantized, int64_t group, int64_t key_group, int64_t code_bytes,
                         int64_t value_bytes, float scale, float* out, float* lse) {
  constexpr int PER_BYTE = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  constexpr int64_t TILE = 64;
  const int64_t start = code_bytes + value_bytes;  // where the tail (header bytes) starts in each slot
  const int64_t tail = SLOT - start;
  const int64_t VG = D / group;
  std::vector<float> keys(TILE * D), values(TILE * D), kscale(D), kmin(D);
  std::vector<float> m(G, -std::numeric_limits<float>::infinity()), l(G, 0.f), acc(G * D, 0.f), logit(G * TILE);
  std::vector<uint8_t> codes(D);
  for (int64_t bi = b_first; bi < b_end; ++bi) {
    const uint8_t* block = pp + ((idp[bi] * H + h) * BS) * SLOT;
    for (int64_t t0 = 0; t0 < BS; t0 += std::min(TILE, key_group)) {
      const int64_t first_token = bi * BS + t0;
      if (first_token >= cached) break;
      const int64_t T = std::min({TILE, key_group - t0 % key_group, BS - t0, cached - first_token});
      const bool exact = first_token >= quantized;  // a key group is quantized whole or not at all
      if (!exact) {  // the group's (scale, minimum): bytes kg*4D.. of the block's tails
        const int64_t kg = t0 / key_group;
        for (int64_t d = 0; d < D; ++d) {
          const int64_t i_s = kg * 4 * D + 2 * d, i_m = kg * 4 * D + 2 * D + 2 * d;
          kscale[d] = half_at(block + (i_s / tail) * SLOT + start + i_s % tail);
          kmin[d] = half_at(block + (i_m / tail) * SLOT + start + i_m % tail);
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        const uint8_t* slot = block + (t0 + t) * SLOT;
        float* key = keys.data() + t * D;
        if (exact) {
          const float* rk = rp + (h * BS + t0 + t) * D;
          std::copy(rk, rk + D, key);
        } else {
          for (int64_t d = 0; d < D; ++d) codes[d] = (slot[d / PER_BYTE] >> ((d % PER_BYTE) * BITS)) & MASK;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) key[d] = codes[d] * kscale[d] + kmin[d];
        }
        const uint8_t* vmeta = slot + 2 * code_bytes;
        for (int64_t d = 0; d < D; ++d) codes[d] = (slot[code_bytes + d / PER_BYTE] >> ((d % PER_BYTE) * BITS)) & MASK;
        float* value = values.data() + t * D;
        for (int64_t vg = 0; vg < VG; ++vg) {  // one (scale, minimum) per value group: two float16 reads
          const float vs = half_at(vmeta + 2 * vg), vm = half_at(vmeta + 2 * (VG + vg));
          const int64_t d0 = vg * group, d1 = d0 + group;
#pragma omp simd
          for (int64_t d = d0; d < d1; ++d) value[d] = codes[d] * vs + vm;
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qp + (h * G + g) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * key[d];
          logit[g * TILE + t] = dot * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* x = logit.data() + g * TILE;
        float top = m[g];
        for (int64_t t = 0; t < T; ++t) top = std::max(top, x[t]);
        const float alpha = std::exp(m[g] - top);  // 0 when m was -inf
        float* ag = acc.data() + g * D;
        float sum = l[g] * alpha;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
        for (int64_t t = 0; t < T; ++t) {
          const float p = std::exp(x[t] - top);
          sum += p;
          const float* v = values.data() + t * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
        }
        l[g] = sum;
        m[g] = top;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    if (l[g] <= 0.f) continue;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] / l[g];
    lse[g] = m[g] + std::log(l[g]);
  }
}

std::vector<torch::Tensor> vllm_quant_decode(torch::Tensor q, torch::Tensor pages, torch::Tensor ids,
                                             torch::Tensor residual, int64_t cached, int64_t quantized,
                                             int64_t bits, int64_t group, int64_t key_group, int64_t code_bytes,
                                             int64_t value_bytes, double scaling, int64_t splits) {
  const int64_t H = q.size(0), G = q.size(1), D = q.size(2);
  const int64_t BS = pages.size(2), SLOT = pages.size(3);
  const int64_t held = ids.size(0);
  TORCH_CHECK(pages.size(1) == H, "vllm_quant_decode: pages hold ", pages.size(1), " heads, the query ", H);
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "vllm_quant_decode: bits must be 2, 4 or 8");
  TORCH_CHECK(quantized >= cached || residual.numel() > 0,
              "vllm_quant_decode: tokens past the quantized groups need the residual");
  const int64_t S = std::max<int64_t>(1, std::min<int64_t>(splits, held));
  const int64_t per_split = (held + S - 1) / S;
  auto out = torch::zeros({S, H, G, D}, q.options());
  auto lse = torch::full({S, H, G}, -std::numeric_limits<float>::infinity(), q.options());
  const float* qp = q.data_ptr<float>();
  const uint8_t* pp = pages.data_ptr<uint8_t>();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* rp = residual.numel() > 0 ? residual.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, S * H, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t s = item / H, h = item % H;
      const int64_t b_first = s * per_split, b_end = std::min(held, (s + 1) * per_split);
      float* o = op + (s * H + h) * G * D;
      float* e = lp + (s * H + h) * G;
      if (bits == 2)
        attend_split<2>(qp, pp, idp, rp, h, H, G, D, BS, SLOT, b_first, b_end, cached, quantized, group,
                        key_group, code_bytes, value_bytes, scale, o, e);
      else if (bits == 4)
        attend_split<4>(qp, pp, idp, rp, h, H, G, D, BS, SLOT, b_first, b_end, cached, quantized, group,
                        key_group, code_bytes, value_bytes, scale, o, e);
      else
        attend_split<8>(qp, pp, idp, rp, h, H, G, D, BS, SLOT, b_first, b_end, cached, quantized, group,
                        key_group, code_bytes, value_bytes, scale, o, e);
    }
  });
  return {out, lse};
}
