// One new token's attention over a KV cache on CPU (float32): see cpu_kernels.py for why.
//
// For each (row b, key/value group g) the group's P query heads read the cached keys once
// (scores), take a softmax per head, then read the cached values once (context). The rows and
// groups are independent, so they are split across torch's intra-op threads.
// torch/types.h (ATen and the torch:: names) and the pybind11 glue, not torch/extension.h: that
// also parses the whole C++ frontend (nn, optim, data), 32 s of compiler CPU per file against 16.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <cfloat>
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kMaxHeadsPerGroup = 64;
constexpr int64_t kMaxHeadDim = 256;

// P_ / D_: compile-time heads per group / head dim for the common shapes (the loops then unroll
// with the query and the accumulators in registers); 0 = read them at run time.
template <int64_t P_, int64_t D_>
void attend_one(const float* q, const float* k, const float* v, const float* mask, float* out,
                int64_t P, int64_t D, int64_t L, int64_t k_row, int64_t v_row, float scale,
                float* scores) {
  const int64_t heads = P_ ? P_ : P, dim = D_ ? D_ : D;
  for (int64_t l = 0; l < L; ++l) {
    const float* key = k + l * k_row;
    // -ffast-math assumes finite values: the mask's -inf becomes the lowest float, whose
    // exponential below still underflows to exactly 0.
    const float bias = std::fmax(mask[l], -FLT_MAX);
    for (int64_t p = 0; p < heads; ++p) {
      const float* query = q + p * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += query[d] * key[d];
      scores[p * L + l] = std::fmax(dot * scale + bias, -FLT_MAX);
    }
  }
  for (int64_t p = 0; p < heads; ++p) {
    float* row = scores + p * L;
    float peak = -FLT_MAX;
    for (int64_t l = 0; l < L; ++l) peak = std::fmax(peak, row[l]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t l = 0; l < L; ++l) {
      const float e = std::exp(row[l] - peak);
      row[l] = e;
      total += e;
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) row[l] *= inv;
  }
  float acc[(P_ ? P_ : kMaxHeadsPerGroup) * (D_ ? D_ : kMaxHeadDim)];
  for (int64_t j = 0; j < heads * dim; ++j) acc[j] = 0.f;
  for (int64_t l = 0; l < L; ++l) {
    const float* value = v + l * v_row;
    for (int64_t p = 0; p < heads; ++p) {
      const float w = scores[p * L + l];
      float* __restrict__ o = acc + p * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] += w * value[d];
    }
  }
  for (int64_t j = 0; j < heads * dim; ++j) out[j] = acc[j];
}

// attend_one with the common shapes unrolled.
void attend(const float* q, const float* k, const float* v, const float* mask, float* out, int64_t P, int64_t D,
            int64_t L, int64_t k_row, int64_t v_row, float scale, float* scores) {
  if (P == 4 && D == 64) {
    attend_one<4, 64>(q, k, v, mask, out, P, D, L, k_row, v_row, scale, scores);
  } else if (P == 4 && D == 128) {
    attend_one<4, 128>(q, k, v, mask, out, P, D, L, k_row, v_row, scale, scores);
  } else {
    attend_one<0, 0>(q, k, v, mask, out, P, D, L, k_row, v_row, scale, scores);
  }
}

}  // namespace

// q [B, G, P, D]; k, v [B, G, >= L, D] (e.g. the first L columns of a longer cache, unit stride
// along D); mask [B, L] additive (0 or -inf). Returns the context [B, G, P, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 2,
              "decode_attention: q, k, v must be 4-d and mask 2-d");
  for (const auto& t : {q, k, v, mask}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32,
                "decode_attention: float32 CPU tensors only");
  }
  q = q.contiguous();
  const int64_t B = q.size(0), G = q.size(1), P = q.size(2), D = q.size(3), L = mask.size(1);
  TORCH_CHECK(P <= kMaxHeadsPerGroup && D <= kMaxHeadDim, "decode_attention: at most ",
              kMaxHeadsPerGroup, " heads per group and head dim ", kMaxHeadDim);
  TORCH_CHECK(k.size(0) == B && k.size(1) == G && k.size(2) >= L && k.size(3) == D &&
                  v.sizes() == k.sizes() && mask.size(0) == B,
              "decode_attention: shapes do not match");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && mask.stride(1) == 1,
              "decode_attention: k, v and mask need unit stride in their last dim");
  auto out = torch::empty({B, G, P, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* mp = mask.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(P * L);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / G, g = i % G;
      const float* qi = qp + i * P * D;
      const float* ki = kp + b * k.stride(0) + g * k.stride(1);
      const float* vi = vp + b * v.stride(0) + g * v.stride(1);
      const float* mi = mp + b * mask.stride(0);
      float* oi = op + i * P * D;
      attend(qi, ki, vi, mi, oi, P, D, L, k.stride(2), v.stride(2), s, scores.data());
    }
  });
  return out;
}

// x [D] -> out [D] with its first R dims turned by the rotary embedding in the fused form of
// decode.py's _rotate_fused: out = x * cos + roll(x, R / 2) * signed_sin (signed_sin: sin with its
// first half negated); dims past R are copied.
inline void rotate(const float* x, const float* cos, const float* signed_sin, float* out, int64_t R, int64_t D) {
  const int64_t half = R / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * signed_sin[d];
  for (int64_t d = half; d < R; ++d) out[d] = x[d] * cos[d] + x[d - half] * signed_sin[d];
  for (int64_t d = R; d < D; ++d) out[d] = x[d];
}

// A lean layer's whole attention for one new token (decode.py's _attend_qkv at s = 1):
// qkv [B, G, P + 2, D] (each group's P query heads, then its key, then its value); cos and
// signed_sin [B, R] for each row's position; the caches [B, G, T, D] get the turned key and the
// value at column ``start``; the queries, turned, attend over columns < start + 1 under mask [B, start + 1].
// Returns the context [B, G, P, D].
torch::Tensor decode_step_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor signed_sin,
                                    torch::Tensor k_cache, torch::Tensor v_cache, int64_t start,
                                    torch::Tensor mask, double scale) {
  TORCH_CHECK(qkv.dim() == 4 && cos.dim() == 2 && signed_sin.sizes() == cos.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && mask.dim() == 2,
              "decode_step_attention: shapes do not match");
  for (const auto& t : {qkv, cos, signed_sin, k_cache, v_cache, mask}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32,
                "decode_step_attention: float32 CPU tensors only");
  }
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  signed_sin = signed_sin.contiguous();
  mask = mask.contiguous();
  const int64_t B = qkv.size(0), G = qkv.size(1), P = qkv.size(2) - 2, D = qkv.size(3), R = cos.size(1);
  const int64_t L = start + 1;
  TORCH_CHECK(P >= 1 && P <= kMaxHeadsPerGroup && D <= kMaxHeadDim && R <= D && R % 2 == 0,
              "decode_step_attention: at most ", kMaxHeadsPerGroup, " heads per group, head dim ",
              kMaxHeadDim, ", an even number of rotary dims <= head dim");
  TORCH_CHECK(cos.size(0) == B && k_cache.size(0) == B && k_cache.size(1) == G && k_cache.size(3) == D &&
                  start >= 0 && start < k_cache.size(2) && mask.size(0) == B && mask.size(1) == L,
              "decode_step_attention: shapes do not match");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_step_attention: contiguous caches only");
  auto out = torch::empty({B, G, P, D}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = signed_sin.data_ptr<float>();
  const float* mp = mask.data_ptr<float>();
  float* kp = k_cache.data_ptr<float>();
  float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t T = k_cache.size(2);
  const float s = static_cast<float>(scale);
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(P * L), queries(P * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / G;
      const float* x = xp + i * (P + 2) * D;
      const float* c = cp + b * R;
      const float* sn = sp + b * R;
      float* ki = kp + i * T * D;
      float* vi = vp + i * T * D;
      for (int64_t p = 0; p < P; ++p) rotate(x + p * D, c, sn, queries.data() + p * D, R, D);
      rotate(x + P * D, c, sn, ki + start * D, R, D);
      for (int64_t d = 0; d < D; ++d) vi[start * D + d] = x[(P + 1) * D + d];
      const float* mi = mp + b * L;
      float* oi = op + i * P * D;
      attend(queries.data(), ki, vi, mi, oi, P, D, L, D, D, s, scores.data());
    }
  });
  return out;
}

// One token per row of temperature-scaled logits [B, V] for uniforms u [B] in [0, 1), as
// sampling.py's _inverse_cdf_blocked draws it from softmax(logits): the first block of ``block``
// entries whose running sum of exp(logit - max) exceeds u * total, then the first entry inside
// it whose running sum exceeds what is left. Returns (tokens [B] int64, log-probabilities
// [B] float32 of the drawn tokens under the softmax): one pass for the maximum and one for the
// exponentials instead of a softmax, block sums, two cumulative sums and two searches.
std::tuple<torch::Tensor, torch::Tensor> sample_softmax(torch::Tensor logits, torch::Tensor u, int64_t block) {
  TORCH_CHECK(logits.dim() == 2 && u.dim() == 1 && u.size(0) == logits.size(0) && block > 0,
              "sample_softmax: logits [B, V], uniforms [B]");
  for (const auto& t : {logits, u}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, "sample_softmax: float32 CPU tensors only");
  }
  logits = logits.contiguous();
  u = u.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1), blocks = (V + block - 1) / block;
  auto tokens = torch::empty({B}, logits.options().dtype(torch::kInt64));
  auto log_probs = torch::empty({B}, logits.options());
  const float* xp = logits.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = log_probs.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(V), sums(blocks);
    for (int64_t b = begin; b < end; ++b) {
      const float* x = xp + b * V;
      float peak = -FLT_MAX;
#pragma omp simd reduction(max : peak)
      for (int64_t j = 0; j < V; ++j) peak = std::fmax(peak, x[j]);
      for (int64_t k = 0; k < blocks; ++k) {
        const int64_t lo = k * block, hi = std::min(V, lo + block);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = lo; j < hi; ++j) {
          const float v = std::exp(std::fmax(x[j], -FLT_MAX) - peak);
          e[j] = v;
          sum += v;
        }
        sums[k] = sum;
      }
      float total = 0.f;
      for (int64_t k = 0; k < blocks; ++k) total += sums[k];
      const float target = up[b] * total;
      // The first block whose running sum exceeds the target; if rounding runs past them all,
      // the last block of positive sum (and ``before`` the sum of those ahead of it).
      int64_t chosen = -1, last = 0;
      float before = 0.f, before_last = 0.f;
      for (int64_t k = 0; k < blocks; ++k) {
        if (before + sums[k] > target) {
          chosen = k;
          break;
        }
        if (sums[k] > 0.f) {
          last = k;
          before_last = before;
        }
        before += sums[k];
      }
      if (chosen < 0) {
        chosen = last;
        before = before_last;
      }
      const float offset = target - before;
      const int64_t lo = chosen * block, hi = std::min(V, lo + block);
      // The block's sum and this running sum add in different orders: an offset a few ulps below
      // the sum can lie past the running sum. Then take the block's last entry of positive weight
      // (those after it weigh 0 and must never be drawn).
      int64_t token = -1, positive = lo;
      float running = 0.f;
      for (int64_t j = lo; j < hi; ++j) {
        running += e[j];
        if (e[j] > 0.f) positive = j;
        if (running > offset) {
          token = j;
          break;
        }
      }
      if (token < 0) token = positive;
      tp[b] = token;
      lp[b] = std::log(e[token] / total);
    }
  });
  return {tokens, log_probs};
}

// torch.nn.RMSNorm's forward on x [M, H] with weight [H], up to float32 rounding (the sum of
// squares is vectorized): out = x * (1 / sqrt(mean(x^2) + eps)) * weight. Why: at a decoding
// step's size ([16, 896]) torch's norm is about ten dispatched ops: 82 us a call with the caches
// flushed (as the weights' stream flushes them in a real step; 1 thread, AMD EPYC), this one
// pass over the rows 24 us, 48 calls a step at Qwen2.5-0.5B's shape.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x [M, H], weight [H]");
  for (const auto& t : {x, weight}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
                "rms_norm: contiguous float32 CPU tensors only");
  }
  const int64_t M = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // Rows are split across threads only in a prefill's hundreds of rows.
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xp + m * H;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t h = 0; h < H; ++h) squares += row[h] * row[h];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(H) + e);
      float* o = op + m * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) o[h] = (row[h] * inv) * wp[h];
    }
  });
  return out;
}

// One translation unit: the compiler parses torch's headers once per build instead of once per
// file (about 14 CPU seconds of a cold build, twice on a fresh machine: native and generic).
#include "panel_linear.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one new token's attention over a KV cache (CPU, float32)");
  m.def("decode_step_attention", &decode_step_attention,
        "a lean layer's rotary, cache write and attention for one new token (CPU, float32)");
  m.def("sample_softmax", &sample_softmax, "inverse-CDF draw from softmax(logits) per row (CPU, float32)");
  m.def("rms_norm", &rms_norm, "torch.nn.RMSNorm's forward on [M, H] rows (CPU, float32)");
  m.def("panel_linear", &panel_linear, "a few rows times a weight stored in 16-column panels (CPU, float32)");
  m.def("panel_linear_streams", &panel_linear_streams, "whether this build has the streaming AVX-512 tile");
}
