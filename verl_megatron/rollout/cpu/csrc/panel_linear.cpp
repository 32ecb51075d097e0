// A linear layer at decoding size on CPU (float32): a few rows times a whole weight matrix.
//
// Why: a decoding step multiplies one row per sequence by every weight of the model, so the step
// is bound by reading the weights from memory, not by arithmetic. oneDNN's packed product reads
// them at about 70% of the memory bandwidth at 8-32 rows; this kernel streams each weight once,
// in order, with a software prefetch ahead of the read, and reaches about 95% of it (see
// packed_linear.py for the numbers).
//
// Layout: the weight [N, K] is stored as panels [ceil(N / 16), K, 16]: panel p holds columns
// 16p..16p+15 of W^T, one 64-byte line per k, so a panel is one contiguous stream. The last panel
// is zero-padded. A tile keeps 8 rows x 3 panels (48 columns) of sums in registers while it walks
// 3 panels side by side: 11 operand loads (3 weight lines, 8 broadcasts) per 24 multiply-adds,
// where one panel under 16 rows (the tile before, up to 16 rows) loads 17 per 16; and it reads 3
// streams at once. More rows take more passes over the same 3 panels (from the L2 cache after the
// first). Each thread takes its own contiguous stretch of panels (its last 1 or 2 in a narrower
// tile), so it reads its own stretch of memory.
//
// Measured on an AMD EPYC (Zen 4, AVX-512), 1 thread pinned, every linear of the Qwen2.5-0.5B
// shape (1.98 GB, streamed from memory), best of 5 interleaved, ms per decoding step, this tile
// vs one panel under up to 16 rows (vs 8 rows x 2 panels, the tile past 16 rows before): 1 row
// 85 vs 89, 4 rows 104 vs 114, 8 rows 106 vs 126, 9 rows 133 vs 140, 12 rows 153 vs 170 (163),
// 16 rows 189 vs 212 (194), 32 rows 326 (334), 64 rows 1271 (1282, a loaded hour). At 2 threads,
// quiet, with the prefetch distance below against the kernel before: 4 rows 62 vs 71 ms, 16 rows
// 94.5 vs 107.8, 64 rows 329 vs 329 (both at the matmul peak). The one-panel tile up to 16 rows
// had been chosen on an Intel Xeon, where a 16-row step was memory-bound at 2 threads; that
// machine could not be measured again.
//
// Summation order (the same for every target): each output is a sum over k of x[m, k] * w[k, n],
// accumulated in order within chunks of kChunk steps, the chunks' sums
// added in order; then the bias, then the epilogue. tests/test_panel_linear.py checks it against
// the rounding bound of exactly this order.
// ATen and the torch:: names only (decode_kernels.cpp includes this file and binds the module): a lighter parse
// than torch/extension.h, which would cost this file twice the compile time.
#include <torch/types.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;    // columns of a panel (one AVX-512 register)
constexpr int kTileRows = 8;      // rows of a register tile
constexpr int kTilePanels = 3;    // panels of a register tile (a stretch's last 1 or 2: fewer)
constexpr int64_t kChunk = 256;   // k steps summed in registers before joining the running sum
// Prefetch distance in floats along each panel: 4 KiB, 12 KiB for a tile's 3 streams (8 KiB a
// stream was 2% slower at 16 rows, 2 threads; 3 streams x 8 KiB ahead nearly fill the 32 KiB L1).
constexpr int64_t kAhead = 1024;

enum Epilogue : int64_t { kNone = 0, kSwish = 1, kMul = 2, kAdd = 3 };

// sums[j, m, 0:16] = sum over k of x[m, k] * panel_j[k, 0:16] for MB rows of x [MB, K]
// and PN consecutive panels (panel_j = panel + j * K * 16).
#if defined(__AVX512F__)
template <int MB, int PN>
void tile(const float* __restrict__ x, const float* __restrict__ panel, int64_t K, float* __restrict__ sums) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    __m512 acc[PN][MB];
    for (int j = 0; j < PN; ++j)
      for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      __m512 w[PN];
      for (int j = 0; j < PN; ++j) {
        const float* line = panel + j * K * kLanes + k * kLanes;
        // Past the tensor's end this names memory that is never read: prefetches do not fault.
        _mm_prefetch(reinterpret_cast<const char*>(line + kAhead), _MM_HINT_T0);
        w[j] = _mm512_loadu_ps(line);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * K + k]);
        for (int j = 0; j < PN; ++j) acc[j][m] = _mm512_fmadd_ps(xv, w[j], acc[j][m]);
      }
    }
    for (int j = 0; j < PN; ++j)
      for (int m = 0; m < MB; ++m) {
        float* s = sums + (j * MB + m) * kLanes;
        _mm512_storeu_ps(s, k0 == 0 ? acc[j][m] : _mm512_add_ps(_mm512_loadu_ps(s), acc[j][m]));
      }
  }
}
constexpr bool kStreams = true;
#else
// The same order in plain loops, for targets without AVX-512 (the compiler vectorizes the lanes;
// it fuses the multiply-add where the target has FMA).
template <int MB, int PN>
void tile(const float* __restrict__ x, const float* __restrict__ panel, int64_t K, float* __restrict__ sums) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    float acc[PN][MB][kLanes] = {};
    for (int64_t k = k0; k < k1; ++k) {
      for (int m = 0; m < MB; ++m) {
        const float xv = x[m * K + k];
        for (int j = 0; j < PN; ++j) {
          const float* w = panel + j * K * kLanes + k * kLanes;
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) acc[j][m][l] += xv * w[l];
        }
      }
    }
    for (int j = 0; j < PN; ++j)
      for (int m = 0; m < MB; ++m)
        for (int64_t l = 0; l < kLanes; ++l) {
          float* s = sums + (j * MB + m) * kLanes + l;
          *s = k0 == 0 ? acc[j][m][l] : *s + acc[j][m][l];
        }
  }
}
constexpr bool kStreams = false;
#endif

using TileFn = void (*)(const float*, const float*, int64_t, float*);

template <int PN, int... MB>
constexpr std::array<TileFn, sizeof...(MB)> tiles(std::integer_sequence<int, MB...>) {
  return {&tile<MB + 1, PN>...};
}
// kTiles[j - 1][r - 1]: the tile for r rows of j panels.
constexpr std::array<std::array<TileFn, kTileRows>, kTilePanels> kTiles = {
    tiles<1>(std::make_integer_sequence<int, kTileRows>{}), tiles<2>(std::make_integer_sequence<int, kTileRows>{}),
    tiles<3>(std::make_integer_sequence<int, kTileRows>{})};

// out[m, n0:n1] = epilogue(sums[m, :] + bias[n0:n1]) for the rows of one tile.
void finish(const float* sums, int64_t rows, int64_t n0, int64_t n1, const float* bias, int64_t epilogue,
            const float* other, float* out, int64_t N) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t n = n0; n < n1; ++n) {
      float v = sums[m * kLanes + (n - n0)];
      if (bias) v += bias[n];
      if (epilogue == kSwish) {
        v = v / (1.f + std::exp(-v));
      } else if (epilogue == kMul) {
        v = other[m * N + n] * v;
      } else if (epilogue == kAdd) {
        v = other[m * N + n] + v;
      }
      out[m * N + n] = v;
    }
  }
}

}  // namespace

// Whether this build has the streaming (AVX-512) tile; without it the kernel is correct but not
// faster than oneDNN, and the decoder keeps oneDNN's product.
bool panel_linear_streams() { return kStreams; }

// x [M, K] times a weight in panels [ceil(N / 16), K, 16] (see above) -> [M, N], then
// + bias [N] (optional), then the epilogue: 0 none, 1 swish (x * sigmoid(x)), 2 times ``other``
// [M, N], 3 plus ``other`` [M, N].
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias,
                           int64_t epilogue, c10::optional<torch::Tensor> other) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kLanes, "panel_linear: x [M, K], panels [P, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K && N > 0 && (N + kLanes - 1) / kLanes == P, "panel_linear: shapes do not match");
  TORCH_CHECK(K > 0, "panel_linear: K must be at least 1 (no k step would write the tile's sums)");
  TORCH_CHECK(epilogue >= kNone && epilogue <= kAdd, "panel_linear: epilogue must be 0..3");
  TORCH_CHECK((epilogue == kMul || epilogue == kAdd) == other.has_value(), "panel_linear: `other` goes with epilogues 2 and 3");
  std::vector<torch::Tensor> inputs = {x, panels};
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "panel_linear: bias [N]");
    inputs.push_back(*bias);
  }
  if (other) {
    TORCH_CHECK(other->dim() == 2 && other->size(0) == M && other->size(1) == N, "panel_linear: other [M, N]");
    inputs.push_back(*other);
  }
  for (const auto& t : inputs) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
                "panel_linear: contiguous float32 CPU tensors only");
  }
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* opp = other ? other->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, kTilePanels, [&](int64_t begin, int64_t end) {
    float sums[kTilePanels * kTileRows * kLanes];  // one tile's sums
    for (int64_t p = begin; p < end; p += kTilePanels) {
      const int64_t panels_here = std::min<int64_t>(kTilePanels, end - p);
      const float* panel = wp + p * K * kLanes;
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, M - m);
        kTiles[panels_here - 1][rows - 1](xp + m * K, panel, K, sums);
        for (int64_t j = 0; j < panels_here; ++j) {
          const int64_t n0 = (p + j) * kLanes, n1 = std::min(N, n0 + kLanes);
          finish(sums + j * rows * kLanes, rows, n0, n1, bp, epilogue, opp ? opp + m * N : nullptr, op + m * N, N);
        }
      }
    }
  });
  return out;
}
