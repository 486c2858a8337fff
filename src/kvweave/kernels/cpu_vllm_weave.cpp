#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

// Decode attention of a layer's decode rows straight from kvweave's vLLM `depthweave` blocks (WeaveSlot layout):
// per slot [key codes (KB bytes) | value codes | key scale, value scale (float16) | tail]; the codes are the
// token's coordinates on its request's bases, each KV head's slot holding its share (rank / H consecutive
// coordinates), symmetric integers offset by 2^(bits-1), packed 8 / bits per byte, the first in the lowest bits.
// The tails of a block's slots, read in slot order, hold per KV head its exact rows: offsets int16 [E] | errors
// float16 [E] | keys float16 [E, D] | values float16 [E, D] (offset -1: empty).
//
// A token's key is rebuilt from all heads' shares of its key coordinates (kb: the basis rows times their scales,
// [rank_k, H*D]; plus the mean), rotated to its position (cos, sin: [T, D], rotate_half convention) and scored;
// its value is never rebuilt: the attention weights weight its value coordinates, and one projection through the
// value basis per query head closes the row. What overrides the stored form, by precedence: the newest partial
// block (recent_k / recent_v [H, BS, D] from recent_first on), the sinks (sink_k / sink_v [S, H, D], the first S
// tokens), the block's exact rows. One item per (row, KV head), an online softmax over its blocks, then the row's
// new token (exact) merged. With `chosen` ([R, H, K] int64, -1 padding; empty: every block) an item reads only the
// blocks its row and head chose (indices into the row's table; selective decode): the tokens of the others get
// no weight this step.
//
// q: [R, H, G, D] f32; k_new, v_new: [R, H, D] f32; pages: [NB, H, BS, SLOT] uint8; table: [R, W] block ids
// (int32 or int64); chosen: [R, H, K] int64 or empty; cached, recent_first: one int per row; per row: kb
// [rank_k, H*D], kmean [H*D], vb [rank_v, H*D], vmean [H*D], sink_k, sink_v [S, H, D], recent_k, recent_v [H, BS, D] or empty, all f32 contiguous.
// Returns out [R, H, G, D] f32.

static inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

struct WeaveShape {
  int64_t H, G, D, BS, SLOT, W, bits, rank_k, rank_v, E, scale_end, k_bytes, code_end;
  float scale;
};

// The coordinates `out[rank]` of a token (slot `off` of block `block`, which starts at byte offset 0 of head 0):
// every head's share, from byte `first` of its slot, scaled by the float16 at byte `scale_at`.
template <int BITS>
static inline void coords_of(const uint8_t* block, int64_t off, const WeaveShape& s, int64_t rank, int64_t first,
                             int64_t scale_at, float* out) {
  constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1, OFFSET = 1 << (BITS - 1);
  const int64_t share = rank / s.H;
  for (int64_t h = 0; h < s.H; ++h) {
    const uint8_t* slot = block + (h * s.BS + off) * s.SLOT;
    const float scale = half_at(slot + scale_at);
    const uint8_t* codes = slot + first;
    float* o = out + h * share;
    for (int64_t b = 0; b < share / PER; ++b) {
      const int byte = codes[b];
      for (int p = 0; p < PER; ++p) o[b * PER + p] = static_cast<float>(((byte >> (p * BITS)) & MASK) - OFFSET) * scale;
    }
  }
}

// key[0:DD] = mean[0:DD] + sum_j coords[j] * R[j * stride + 0:DD]: the accumulators stay in registers (a fixed
// width the compiler unrolls: 64 floats = 8 AVX2 registers), as in kernels/cpu_factor.cpp.
// Always inlined: left out of line (the compiler's size heuristics, once attend_row_head grew), its accumulators
// went to memory and the kernel ran ~3.5x slower.
template <int DD>
static inline __attribute__((always_inline)) void rebuild_span(const float* coords, const float* R,
                                                               const float* mean, int64_t w, int64_t stride,
                                float* key) {
  float acc[DD];
  for (int d = 0; d < DD; ++d) acc[d] = mean[d];
  for (int64_t j = 0; j < w; ++j) {
    const float cj = coords[j];
    const float* rj = R + j * stride;
#pragma GCC unroll 64
    for (int d = 0; d < DD; ++d) acc[d] += cj * rj[d];
  }
  for (int d = 0; d < DD; ++d) key[d] = acc[d];
}

// key[0:D] = mean[0:D] + coords[0:w] @ R[0:w] (rows `stride` floats apart): spans of 64 channels in registers
// where the head size allows, the general loop elsewhere.
static inline void rebuild_key(const float* coords, const float* R, const float* mean, int64_t w, int64_t stride,
                               int64_t D, float* key) {
  if (D % 64 == 0) {
    for (int64_t at = 0; at < D; at += 64) rebuild_span<64>(coords, R + at, mean + at, w, stride, key + at);
    return;
  }
  for (int64_t d = 0; d < D; ++d) key[d] = mean[d];
  for (int64_t j = 0; j < w; ++j) {
    const float cj = coords[j];
    const float* rj = R + j * stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) key[d] += cj * rj[d];
  }
}

template <int BITS>
static void attend_row_head(int64_t h, const WeaveShape& s, const float* q, const uint8_t* pages,
                            const int64_t* ids, const int64_t* chosen, int64_t n_chosen, int64_t cached,
                            int64_t recent_first, const float* kb,
                            const float* kmean, const float* vb, const float* vmean, const float* sink_k,
                            const float* sink_v, int64_t sinks, const float* recent_k, const float* recent_v,
                            const float* cos, const float* sin, const float* k_new, const float* v_new, float* out) {
  const int64_t G = s.G, D = s.D, BS = s.BS, H = s.H, RK = s.rank_k, RV = s.rank_v, E = s.E, half = D / 2;
  const int64_t tail = s.SLOT - s.scale_end, exact_bytes = E * (4 + 4 * D);
  std::vector<float> keys(BS * D), cv(BS * RV), vx(BS * D), x(G * BS), ck(RK), pre(D);
  std::vector<int8_t> kind(BS);  // 0: value from coordinates, 1: exact value in vx
  std::vector<int64_t> exact_at(BS);
  std::vector<uint8_t> tails(exact_bytes);
  std::vector<float> m(G, -std::numeric_limits<float>::infinity()), l(G, 0.f), pc(G, 0.f);
  std::vector<float> acc_c(G * RV, 0.f), acc_x(G * D, 0.f);
  const int64_t held = (cached + BS - 1) / BS;
  std::vector<uint8_t> skip(held, chosen ? 1 : 0);  // selective decode: the blocks not chosen
  for (int64_t i = 0; chosen && i < n_chosen; ++i)
    if (chosen[i] >= 0 && chosen[i] < held) skip[chosen[i]] = 0;
  for (int64_t bi = 0; bi < held; ++bi) {
    if (skip[bi]) continue;
    const uint8_t* block = pages + ids[bi] * H * BS * s.SLOT;
    const uint8_t* block_h = block + h * BS * s.SLOT;
    const int64_t t0 = bi * BS, T = std::min(BS, cached - t0);
    std::fill(exact_at.begin(), exact_at.end(), -1);
    if (E > 0) {  // this head's exact rows: the tails' first exact_bytes bytes, in slot order
      for (int64_t done = 0; done < exact_bytes;) {
        const int64_t in_tail = done % tail, piece = std::min(tail - in_tail, exact_bytes - done);
        std::memcpy(tails.data() + done, block_h + (done / tail) * s.SLOT + s.scale_end + in_tail, piece);
        done += piece;
      }
      for (int64_t e = 0; e < E; ++e) {
        int16_t off;
        std::memcpy(&off, tails.data() + 2 * e, 2);
        if (off >= 0 && off < T) exact_at[off] = e;
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = t0 + t;
      float* key = keys.data() + t * D;
      float* value = vx.data() + t * D;
      if (pos >= recent_first) {
        const int64_t off = pos - recent_first;
        std::memcpy(key, recent_k + (h * BS + off) * D, D * sizeof(float));
        std::memcpy(value, recent_v + (h * BS + off) * D, D * sizeof(float));
        kind[t] = 1;
      } else if (pos < sinks) {
        std::memcpy(key, sink_k + (pos * H + h) * D, D * sizeof(float));
        std::memcpy(value, sink_v + (pos * H + h) * D, D * sizeof(float));
        kind[t] = 1;
      } else if (exact_at[t] >= 0) {
        const uint8_t* rows = tails.data() + 4 * E;
        for (int64_t d = 0; d < D; ++d) {
          key[d] = half_at(rows + 2 * (exact_at[t] * D + d));
          value[d] = half_at(rows + 2 * ((E + exact_at[t]) * D + d));
        }
        kind[t] = 1;
      } else {
        coords_of<BITS>(block, t, s, RK, 0, s.code_end, ck.data());
        rebuild_key(ck.data(), kb + h * D, kmean + h * D, RK, H * D, D, pre.data());
        const float* cs = cos + pos * D;
        const float* sn = sin + pos * D;
        for (int64_t d = 0; d < half; ++d) key[d] = pre[d] * cs[d] - pre[d + half] * sn[d];
        for (int64_t d = half; d < D; ++d) key[d] = pre[d] * cs[d] + pre[d - half] * sn[d];
        coords_of<BITS>(block, t, s, RV, s.k_bytes, s.code_end + 2, cv.data() + t * RV);
        kind[t] = 0;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float* xg = x.data() + g * BS;
      float top = m[g];
      for (int64_t t = 0; t < T; ++t) {
        const float* key = keys.data() + t * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * key[d];
        xg[t] = dot * s.scale;
        top = std::max(top, xg[t]);
      }
      const float alpha = std::exp(m[g] - top);  // 0 when m was -inf (l and the sums are 0 then)
      float* ac = acc_c.data() + g * RV;
      float* ax = acc_x.data() + g * D;
      for (int64_t j = 0; j < RV; ++j) ac[j] *= alpha;
      for (int64_t d = 0; d < D; ++d) ax[d] *= alpha;
      float sum = 0.f, coord_sum = 0.f;
      for (int64_t t = 0; t < T; ++t) {
        const float p = std::exp(xg[t] - top);
        sum += p;
        if (kind[t] == 0) {
          coord_sum += p;
          const float* c = cv.data() + t * RV;
#pragma omp simd
          for (int64_t j = 0; j < RV; ++j) ac[j] += p * c[j];
        } else {
          const float* v = vx.data() + t * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ax[d] += p * v[d];
        }
      }
      l[g] = l[g] * alpha + sum;
      pc[g] = pc[g] * alpha + coord_sum;
      m[g] = top;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // the new token, then the value basis once per query head
    const float* qg = q + g * D;
    float logit = 0.f;
    for (int64_t d = 0; d < D; ++d) logit += qg[d] * k_new[d];
    logit *= s.scale;
    const float top = std::max(m[g], logit);
    const float alpha = std::exp(m[g] - top), p_new = std::exp(logit - top);
    const float total = l[g] * alpha + p_new;
    float* o = out + g * D;
    const float* ac = acc_c.data() + g * RV;
    const float* ax = acc_x.data() + g * D;
    for (int64_t d = 0; d < D; ++d) o[d] = pc[g] * vmean[h * D + d] + ax[d];
    for (int64_t j = 0; j < RV; ++j) {
      const float w = ac[j];
      const float* row = vb + j * H * D + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * row[d];
    }
    for (int64_t d = 0; d < D; ++d) o[d] = (o[d] * alpha + p_new * v_new[d]) / total;
  }
}

static const float* f32_or_null(const torch::Tensor& t, const char* what) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "vllm_weave_decode_rows: ", what,
              " must be contiguous float32");
  return t.data_ptr<float>();
}

torch::Tensor vllm_weave_decode_rows(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor pages,
                                     torch::Tensor table, torch::Tensor chosen, const std::vector<int64_t>& cached,
                                     const std::vector<int64_t>& recent_first, const std::vector<torch::Tensor>& kb,
                                     const std::vector<torch::Tensor>& kmean, const std::vector<torch::Tensor>& vb,
                                     const std::vector<torch::Tensor>& vmean,
                                     const std::vector<torch::Tensor>& sink_k,
                                     const std::vector<torch::Tensor>& sink_v,
                                     const std::vector<torch::Tensor>& recent_k,
                                     const std::vector<torch::Tensor>& recent_v, torch::Tensor cos, torch::Tensor sin,
                                     int64_t bits, int64_t rank_k, int64_t rank_v, int64_t exact, int64_t scale_end,
                                     int64_t k_bytes, int64_t code_end, double scaling) {
  const int64_t R = q.size(0);
  if (table.scalar_type() != at::kLong) table = table.to(at::kLong);
  table = table.contiguous();
  WeaveShape s{q.size(1), q.size(2), q.size(3), pages.size(2), pages.size(3), table.size(1), bits, rank_k, rank_v,
               exact, scale_end, k_bytes, code_end, static_cast<float>(scaling)};
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "vllm_weave_decode_rows: bits must be 2, 4 or 8");
  TORCH_CHECK(pages.scalar_type() == at::kByte && pages.is_contiguous() && pages.size(1) == s.H,
              "vllm_weave_decode_rows: contiguous uint8 pages with the query's KV heads");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && k_new.is_contiguous() && v_new.is_contiguous(),
              "vllm_weave_decode_rows: contiguous float32 queries and new tokens");
  TORCH_CHECK(s.D % 2 == 0 && rank_k % (s.H * (8 / bits)) == 0 && rank_v % (s.H * (8 / bits)) == 0,
              "vllm_weave_decode_rows: an even head size and ranks that are multiples of the KV heads times the "
              "codes per byte");
  const size_t n = static_cast<size_t>(R);
  TORCH_CHECK(table.size(0) == R && cached.size() == n && recent_first.size() == n && kb.size() == n &&
                  kmean.size() == n && vb.size() == n && vmean.size() == n && sink_k.size() == n &&
                  sink_v.size() == n && recent_k.size() == n && recent_v.size() == n,
              "vllm_weave_decode_rows: one entry per row in every per-row argument");
  int64_t longest = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK((cached[r] + s.BS - 1) / s.BS <= s.W, "vllm_weave_decode_rows: row ", r, " holds ", cached[r],
                " tokens, more than its block table's ", s.W, " blocks");
    TORCH_CHECK(kb[r].size(0) >= rank_k && vb[r].size(0) >= rank_v && kb[r].size(1) == s.H * s.D,
                "vllm_weave_decode_rows: row ", r, "'s bases are too small");
    TORCH_CHECK(recent_first[r] >= cached[r] || recent_k[r].numel() == s.H * s.BS * s.D,
                "vllm_weave_decode_rows: row ", r, " has tokens from its newest block but no exact rows for them");
    longest = std::max(longest, cached[r]);
  }
  TORCH_CHECK(cos.size(0) >= longest && cos.size(1) == s.D && sin.sizes() == cos.sizes(),
              "vllm_weave_decode_rows: cos and sin must cover every stored position");
  auto out = torch::zeros({R, s.H, s.G, s.D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kn = k_new.data_ptr<float>();
  const float* vn = v_new.data_ptr<float>();
  const uint8_t* pp = pages.data_ptr<uint8_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t K = chosen.numel() ? chosen.size(2) : 0;
  if (K) {
    TORCH_CHECK(chosen.scalar_type() == at::kLong && chosen.is_contiguous() && chosen.dim() == 3 &&
                    chosen.size(0) == R && chosen.size(1) == s.H,
                "vllm_weave_decode_rows: chosen must be contiguous int64 [rows, KV heads, K]");
  }
  const int64_t* chp = K ? chosen.data_ptr<int64_t>() : nullptr;
  const float* cp = f32_or_null(cos, "cos");
  const float* sp = f32_or_null(sin, "sin");
  float* op = out.data_ptr<float>();
  std::vector<const float*> ptrs(R * 8);
  std::vector<int64_t> sinks_held(R);
  for (int64_t r = 0; r < R; ++r) {
    const torch::Tensor* each[] = {&kb[r], &kmean[r], &vb[r], &vmean[r], &sink_k[r], &sink_v[r], &recent_k[r],
                                   &recent_v[r]};
    for (int i = 0; i < 8; ++i) ptrs[r * 8 + i] = f32_or_null(*each[i], "a row's bases, sinks and newest rows");
    sinks_held[r] = sink_k[r].numel() / (s.H * s.D);
    TORCH_CHECK(sink_v[r].numel() == sink_k[r].numel(), "vllm_weave_decode_rows: row ", r,
                "'s sink keys and values differ in count");
  }
  at::parallel_for(0, R * s.H, 1, [&](int64_t first, int64_t last) {
    for (int64_t rh = first; rh < last; ++rh) {
      const int64_t r = rh / s.H, h = rh % s.H;
      const float* const* p = ptrs.data() + r * 8;
      const int64_t sinks = std::min(sinks_held[r], cached[r]);
      auto attend = s.bits == 8 ? attend_row_head<8> : s.bits == 4 ? attend_row_head<4> : attend_row_head<2>;
      attend(h, s, qp + rh * s.G * s.D, pp, tp + r * s.W, chp ? chp + rh * K : nullptr, K, cached[r],
                      std::min(recent_first[r], cached[r]),
                      p[0], p[1], p[2], p[3], p[4], p[5], sinks, p[6], p[7], cp, sp, kn + rh * s.D, vn + rh * s.D,
                      op + rh * s.G * s.D);
    }
  });
  return out;
}

// The write hook for a step's decode rows (one new token each, in distinct blocks), what WeaveSlot.store does in
// torch, bit for bit but for the order of float sums: each token's coordinates on its request's bases (k_rows,
// v_rows: [r, H*D] float16; means [H*D] and scales [r] float32; k_pre: the de-rotated key, v_flat: the value, both
// [R, H*D] float32), quantized per KV head's share (symmetric, the scale max|c| / qmax clamped to [1e-8, 6e4] and
// rounded to float16), packed into slot `offsets[n]` of block `blocks[n]`; then per KV head the block's exact rows
// kept as the `exact` of largest relative error among those already there (a block started at offset 0 drops
// them, a token written again replaces its own) and this token's (the error of its stored form rebuilt on the
// bases: squared distance over squared norm, keys' plus values'), sorted by error, empty entries zeroed, the rest
// of the tails zeroed. Each token's exact key and value (`k_exact`, `v_exact`: [R, H, D] of the residuals' dtype)
// also go to slot `offsets[n]` of its rows `k_res_rows[n]`, `v_res_rows[n]` of the residuals ([X, H, BS, D]);
// -1: not kept.
static inline float as_float(const void* base, at::ScalarType type, int64_t i) {
  switch (type) {
    case at::kFloat: return static_cast<const float*>(base)[i];
    case at::kHalf: return static_cast<float>(static_cast<const at::Half*>(base)[i]);
    case at::kBFloat16: return static_cast<float>(static_cast<const at::BFloat16*>(base)[i]);
    default: TORCH_CHECK(false, "vllm_weave_store_rows: exact rows must be float32, float16 or bfloat16");
  }
  return 0.f;
}

static inline void put_half(uint8_t* p, float x) {
  const at::Half h = static_cast<at::Half>(x);
  std::memcpy(p, &h, 2);
}

// coords[j] = rows[j] . (x - mean) / scale[j]; then stored[j]: the coordinate as its quantized form gives it back.
static void encode_quantize(const at::Half* rows, const float* mean, const float* scale, const float* x, int64_t r,
                            int64_t HD, int64_t H, int64_t bits, uint8_t* codes, at::Half* head_scale,
                            float* stored) {
  std::vector<float> centred(HD), c(r);
  for (int64_t i = 0; i < HD; ++i) centred[i] = x[i] - mean[i];
  for (int64_t j = 0; j < r; ++j) {
    const at::Half* row = rows + j * HD;
    float acc = 0.f;
    for (int64_t i = 0; i < HD; ++i) acc += static_cast<float>(row[i]) * centred[i];
    c[j] = acc / scale[j];
  }
  const int64_t share = r / H;
  const float qmax = static_cast<float>((1 << (bits - 1)) - 1), offset = qmax + 1.f;
  for (int64_t h = 0; h < H; ++h) {
    float top = 0.f;
    for (int64_t j = h * share; j < (h + 1) * share; ++j) top = std::max(top, std::fabs(c[j]));
    head_scale[h] = static_cast<at::Half>(std::min(std::max(top / qmax, 1e-8f), 6e4f));
    const float sf = static_cast<float>(head_scale[h]);
    for (int64_t j = h * share; j < (h + 1) * share; ++j) {
      const float q = std::min(std::max(std::nearbyint(c[j] / sf), -qmax), qmax);
      codes[j] = static_cast<uint8_t>(q + offset);
      stored[j] = q * sf;
    }
  }
}

// Per KV head: squared error of rows . (stored * scale) + mean against x, over x's squared norm.
static void add_error(const at::Half* rows, const float* mean, const float* scale, const float* stored,
                      const float* x, int64_t r, int64_t H, int64_t D, float* error) {
  const int64_t HD = H * D;
  std::vector<float> rebuilt(mean, mean + HD);
  for (int64_t j = 0; j < r; ++j) {
    const float w = stored[j] * scale[j];
    const at::Half* row = rows + j * HD;
    for (int64_t i = 0; i < HD; ++i) rebuilt[i] += w * static_cast<float>(row[i]);
  }
  for (int64_t h = 0; h < H; ++h) {
    float err = 0.f, norm = 0.f;
    for (int64_t d = h * D; d < (h + 1) * D; ++d) {
      const float e = rebuilt[d] - x[d];
      err += e * e, norm += x[d] * x[d];
    }
    error[h] += err / std::max(norm, 1e-12f);
  }
}

static void pack_share(const uint8_t* codes, int64_t count, int64_t bits, uint8_t* out) {
  const int64_t per = 8 / bits;
  for (int64_t b = 0; b < count / per; ++b) {
    int byte = 0;
    for (int64_t k = 0; k < per; ++k) byte |= codes[b * per + k] << (k * bits);
    out[b] = static_cast<uint8_t>(byte);
  }
}

void vllm_weave_store_rows(torch::Tensor k_pre, torch::Tensor v_flat, torch::Tensor k_exact, torch::Tensor v_exact,
                           torch::Tensor pages, const std::vector<int64_t>& blocks,
                           const std::vector<int64_t>& offsets, const std::vector<torch::Tensor>& k_rows,
                           const std::vector<torch::Tensor>& k_mean, const std::vector<torch::Tensor>& k_scale,
                           const std::vector<torch::Tensor>& v_rows, const std::vector<torch::Tensor>& v_mean,
                           const std::vector<torch::Tensor>& v_scale, torch::Tensor k_res, torch::Tensor v_res,
                           const std::vector<int64_t>& k_res_rows, const std::vector<int64_t>& v_res_rows,
                           int64_t bits, int64_t rank_k, int64_t rank_v, int64_t exact, int64_t k_bytes,
                           int64_t code_end, int64_t scale_end, int64_t exact_bytes) {
  const int64_t R = k_pre.size(0), H = k_exact.size(1), D = k_exact.size(2), HD = H * D;
  TORCH_CHECK(pages.scalar_type() == at::kByte && pages.is_contiguous() && pages.dim() == 4 && pages.size(1) == H,
              "vllm_weave_store_rows: contiguous uint8 pages [blocks, KV heads, block size, slot bytes]");
  TORCH_CHECK(k_pre.scalar_type() == at::kFloat && v_flat.scalar_type() == at::kFloat && k_pre.is_contiguous() &&
                  v_flat.is_contiguous() && k_pre.size(1) == HD && v_flat.size(0) == R && v_flat.size(1) == HD,
              "vllm_weave_store_rows: contiguous float32 k_pre and v_flat [rows, KV heads x head size]");
  TORCH_CHECK(k_exact.is_contiguous() && v_exact.is_contiguous() && k_exact.size(0) == R &&
                  v_exact.sizes() == k_exact.sizes(),
              "vllm_weave_store_rows: contiguous exact keys and values [rows, KV heads, head size]");
  TORCH_CHECK(static_cast<int64_t>(blocks.size()) == R && static_cast<int64_t>(offsets.size()) == R &&
                  static_cast<int64_t>(k_rows.size()) == R && static_cast<int64_t>(v_rows.size()) == R &&
                  static_cast<int64_t>(k_mean.size()) == R && static_cast<int64_t>(v_mean.size()) == R &&
                  static_cast<int64_t>(k_scale.size()) == R && static_cast<int64_t>(v_scale.size()) == R &&
                  static_cast<int64_t>(k_res_rows.size()) == R && static_cast<int64_t>(v_res_rows.size()) == R,
              "vllm_weave_store_rows: one block, offset, basis and residual row per row");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "vllm_weave_store_rows: bits must be 2, 4 or 8");
  const int64_t NB = pages.size(0), BS = pages.size(2), SLOT = pages.size(3), TB = SLOT - scale_end;
  TORCH_CHECK(exact_bytes == exact * (4 + 4 * D) && exact_bytes <= BS * TB,
              "vllm_weave_store_rows: the tails cannot hold the exact rows");
  for (const auto* res : {&k_res, &v_res})
    TORCH_CHECK(res->scalar_type() == k_exact.scalar_type() && res->is_contiguous() && res->dim() == 4 &&
                    res->size(1) == H && res->size(2) == BS && res->size(3) == D,
                "vllm_weave_store_rows: contiguous residuals [rows, KV heads, block size, head size] of the exact "
                "rows' dtype");
  uint8_t* pp = pages.data_ptr<uint8_t>();
  const float *kp = k_pre.data_ptr<float>(), *vp = v_flat.data_ptr<float>();
  const auto type = k_exact.scalar_type();
  const void *ke = k_exact.data_ptr(), *ve = v_exact.data_ptr();
  std::vector<uint8_t> codes_k(rank_k), codes_v(rank_v), stream(BS * TB);
  std::vector<at::Half> scale_k(H), scale_v(H);
  std::vector<float> stored_k(rank_k), stored_v(rank_v), error(H);
  for (int64_t n = 0; n < R; ++n) {
    const int64_t b = blocks[n], o = offsets[n];
    TORCH_CHECK(b >= 0 && b < NB && o >= 0 && o < BS, "vllm_weave_store_rows: row ", n, "'s slot is out of range");
    for (const auto* t : {&k_rows[n], &v_rows[n]})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->size(1) == HD,
                  "vllm_weave_store_rows: a basis' rows must be contiguous float16 [rank, KV heads x head size]");
    TORCH_CHECK(k_rows[n].size(0) == rank_k && v_rows[n].size(0) == rank_v && k_scale[n].numel() == rank_k &&
                    v_scale[n].numel() == rank_v && k_mean[n].numel() == HD && v_mean[n].numel() == HD &&
                    k_mean[n].scalar_type() == at::kFloat && v_mean[n].scalar_type() == at::kFloat &&
                    k_scale[n].scalar_type() == at::kFloat && v_scale[n].scalar_type() == at::kFloat,
                "vllm_weave_store_rows: row ", n, "'s bases do not match the ranks");
    const at::Half *krows = k_rows[n].data_ptr<at::Half>(), *vrows = v_rows[n].data_ptr<at::Half>();
    const float *kmean = k_mean[n].data_ptr<float>(), *vmean = v_mean[n].data_ptr<float>();
    const float *kscale = k_scale[n].data_ptr<float>(), *vscale = v_scale[n].data_ptr<float>();
    encode_quantize(krows, kmean, kscale, kp + n * HD, rank_k, HD, H, bits, codes_k.data(), scale_k.data(),
                    stored_k.data());
    encode_quantize(vrows, vmean, vscale, vp + n * HD, rank_v, HD, H, bits, codes_v.data(), scale_v.data(),
                    stored_v.data());
    const int64_t sk = rank_k / H, sv = rank_v / H;
    for (int64_t h = 0; h < H; ++h) {
      uint8_t* slot = pp + ((b * H + h) * BS + o) * SLOT;
      pack_share(codes_k.data() + h * sk, sk, bits, slot);
      pack_share(codes_v.data() + h * sv, sv, bits, slot + k_bytes);
      std::memcpy(slot + code_end, &scale_k[h], 2);
      std::memcpy(slot + code_end + 2, &scale_v[h], 2);
    }
    if (exact > 0) {
      std::fill(error.begin(), error.end(), 0.f);
      add_error(krows, kmean, kscale, stored_k.data(), kp + n * HD, rank_k, H, D, error.data());
      add_error(vrows, vmean, vscale, stored_v.data(), vp + n * HD, rank_v, H, D, error.data());
      for (int64_t h = 0; h < H; ++h) {
        uint8_t* first = pp + (b * H + h) * BS * SLOT + scale_end;  // slot 0's tail of this head
        for (int64_t s = 0; s < BS; ++s) std::memcpy(stream.data() + s * TB, first + s * SLOT, TB);
        const int16_t* old_off = reinterpret_cast<const int16_t*>(stream.data());
        const uint8_t* old_err = stream.data() + 2 * exact;
        const uint8_t* old_rows = stream.data() + 4 * exact;  // keys [E, D] then values [E, D], float16
        // candidates: (error, offset, source): source < exact an old entry, -1 this token
        std::vector<std::tuple<float, int64_t, int64_t>> keep;
        if (o != 0)
          for (int64_t e = 0; e < exact; ++e)
            if (old_off[e] >= 0 && old_off[e] != o) keep.emplace_back(half_at(old_err + 2 * e), old_off[e], e);
        keep.emplace_back(error[h], o, -1);
        std::stable_sort(keep.begin(), keep.end(),
                         [](const auto& x, const auto& y) { return std::get<0>(x) > std::get<0>(y); });
        std::vector<uint8_t> out(BS * TB, 0);
        for (int64_t e = 0; e < exact && e < static_cast<int64_t>(keep.size()); ++e) {
          const auto& [err, off, source] = keep[e];
          const int16_t off16 = static_cast<int16_t>(off);
          std::memcpy(out.data() + 2 * e, &off16, 2);
          put_half(out.data() + 2 * exact + 2 * e, std::min(std::max(err, -6e4f), 6e4f));
          uint8_t* key_out = out.data() + 4 * exact + 2 * e * D;
          uint8_t* value_out = key_out + 2 * exact * D;
          if (source >= 0) {
            std::memcpy(key_out, old_rows + 2 * source * D, 2 * D);
            std::memcpy(value_out, old_rows + 2 * (exact + source) * D, 2 * D);
          } else {
            for (int64_t d = 0; d < D; ++d) {
              put_half(key_out + 2 * d, as_float(ke, type, (n * H + h) * D + d));
              put_half(value_out + 2 * d, as_float(ve, type, (n * H + h) * D + d));
            }
          }
        }
        for (int64_t e = static_cast<int64_t>(keep.size()); e < exact; ++e) {  // empty entries
          const int16_t none = -1;
          std::memcpy(out.data() + 2 * e, &none, 2);
          put_half(out.data() + 2 * exact + 2 * e, -6e4f);
        }
        for (int64_t s = 0; s < BS; ++s) std::memcpy(first + s * SLOT, out.data() + s * TB, TB);
      }
    }
    const int64_t width = D * k_exact.element_size();
    for (int side = 0; side < 2; ++side) {
      const int64_t row = side == 0 ? k_res_rows[n] : v_res_rows[n];
      if (row < 0) continue;
      const torch::Tensor& res = side == 0 ? k_res : v_res;
      TORCH_CHECK(row < res.size(0), "vllm_weave_store_rows: residual row out of range");
      auto* rp = static_cast<uint8_t*>(res.data_ptr());
      const auto* src = static_cast<const uint8_t*>(side == 0 ? ke : ve);
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(rp + ((row * H + h) * BS + o) * width, src + (n * H + h) * width, width);
    }
  }
}

// Selective decode's block choice for a step's decode rows (the backend's _weave_choose_rows, in one call): per row
// r (queries q[r]: [H, G, D] float32, its blocks table[r], cached[r] stored tokens) and KV head, the indices into
// the row's table of the blocks it reads: the first `first` (the sinks'), the newest full and the partial one, and
// the `budget` others whose key bounds (float16 minimum and maximum per channel, at byte `exact_bytes` of each
// block's tail stream) give the largest Quest bound max over the head's query group of sum_d max(q*lo, q*hi),
// sorted, -1 padding to the widest row. A row with no more candidates than the budget reads every block (all
// its indices). Returns chosen [R, H, K] int64.
torch::Tensor vllm_weave_choose_rows(torch::Tensor q, torch::Tensor pages, torch::Tensor table,
                                     const std::vector<int64_t>& cached, int64_t budget, int64_t sink_blocks,
                                     int64_t scale_end, int64_t exact_bytes) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4,
              "vllm_weave_choose_rows: contiguous float32 queries [rows, KV heads, group, head size]");
  TORCH_CHECK(pages.scalar_type() == at::kByte && pages.is_contiguous() && pages.size(1) == q.size(1),
              "vllm_weave_choose_rows: contiguous uint8 pages with the queries' KV heads");
  TORCH_CHECK((table.scalar_type() == at::kInt || table.scalar_type() == at::kLong) && table.is_contiguous() &&
                  table.size(0) == q.size(0) && static_cast<int64_t>(cached.size()) == q.size(0),
              "vllm_weave_choose_rows: one table row and one cached count per query row");
  TORCH_CHECK(budget >= 1 && sink_blocks >= 1, "vllm_weave_choose_rows: budget and sink_blocks must be positive");
  const int64_t R = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t NB = pages.size(0), BS = pages.size(2), SLOT = pages.size(3), TB = SLOT - scale_end;
  const int64_t W = table.size(1);
  TORCH_CHECK(exact_bytes + 4 * D <= BS * TB, "vllm_weave_choose_rows: the tails hold no key bounds");
  std::vector<int64_t> held(R), first(R), end(R);
  int64_t width = 0;
  for (int64_t r = 0; r < R; ++r) {
    held[r] = (cached[r] + BS - 1) / BS;
    TORCH_CHECK(held[r] <= W, "vllm_weave_choose_rows: row ", r, " holds more blocks than its table");
    const int64_t full = cached[r] / BS;
    first[r] = std::min(sink_blocks, full);
    end[r] = std::max(full - 1, first[r]);
    const bool choosing = end[r] - first[r] > budget;
    width = std::max(width, choosing ? first[r] + (held[r] - end[r]) + budget : held[r]);
  }
  auto out = torch::full({R, H, width}, -1, torch::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const uint8_t* pp = pages.data_ptr<uint8_t>();
  const bool wide = table.scalar_type() == at::kLong;
  at::parallel_for(0, R * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> plus(G * D), minus(G * D), low(D), high(D);
    std::vector<std::pair<float, int64_t>> scored;
    for (int64_t rh = lo; rh < hi; ++rh) {
      const int64_t r = rh / H, h = rh % H;
      int64_t* o = op + rh * width;
      if (end[r] - first[r] <= budget) {
        for (int64_t b = 0; b < held[r]; ++b) o[b] = b;
        continue;
      }
      const float* qh = qp + rh * G * D;
      for (int64_t i = 0; i < G * D; ++i) plus[i] = std::max(qh[i], 0.f), minus[i] = std::min(qh[i], 0.f);
      scored.clear();
      for (int64_t b = first[r]; b < end[r]; ++b) {
        const int64_t id = wide ? table.data_ptr<int64_t>()[r * W + b] : table.data_ptr<int32_t>()[r * W + b];
        TORCH_CHECK(id >= 0 && id < NB, "vllm_weave_choose_rows: block id out of range");
        const uint8_t* tail = pp + (id * H + h) * BS * SLOT + scale_end;
        for (int64_t d = 0; d < 2 * D; ++d) {
          const int64_t at = exact_bytes + 2 * d;  // byte of the tail stream: slot at / TB, byte at % TB
          const float value = half_at(tail + (at / TB) * SLOT + at % TB);
          (d < D ? low[d] : high[d - D]) = value;
        }
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t g = 0; g < G; ++g) {
          float bound = 0.f;
          for (int64_t d = 0; d < D; ++d) bound += plus[g * D + d] * high[d] + minus[g * D + d] * low[d];
          best = std::max(best, bound);
        }
        scored.emplace_back(best, b);
      }
      std::partial_sort(scored.begin(), scored.begin() + budget, scored.end(),
                        [](const auto& x, const auto& y) { return x.first > y.first; });
      std::vector<int64_t> pick;
      for (int64_t b = 0; b < first[r]; ++b) pick.push_back(b);
      for (int64_t b = end[r]; b < held[r]; ++b) pick.push_back(b);
      for (int64_t i = 0; i < budget; ++i) pick.push_back(scored[i].second);
      std::sort(pick.begin(), pick.end());
      std::copy(pick.begin(), pick.end(), o);
    }
  });
  return out;
}
