// float32 matmuls for few rows (decode steps, verify trees, a batch of requests): y = x @ w.T
// (+ bias) (+ residual), with w held in panels of 32 outputs, [N/32, K, 32].
//
// Why: at 1 to 64 rows a step streams every weight from memory once and multiplies it by each
// row. oneDNN's packed sgemm and F.linear there reach neither the read bandwidth nor the
// multiply-add peak (16 rows, Sapphire Rapids, 2 threads: 11 GB/s and 86 GFLOPS): they fetch
// weights, then compute on them. Here a panel's 32 outputs are 2 vectors per input k; each row
// of a tile of up to 8 multiplies them by its x[r, k] broadcast (16 independent accumulators
// keep both FMA units busy); a panel is read in blocks of KB inputs that stay in L1 while every
// row tile passes over them; and the next panel's cache lines are prefetched, spread evenly over
// the current panel's (block, tile) passes, so memory and arithmetic overlap. One forward's
// matmuls of the embedded target against the faster of F.linear and oneDNN's packed sgemm
// (results/linear_panels.json, eval/bench_linear.py): 1.13x at 1 row, 1.43x at 8, 1.46x at 16,
// 1.21x at 32, 1.01x at 64, 0.81x at 128, so `Linear` stops at 64 (MAX_PANEL_ROWS) unless rows
// must be exact.
//
// Each output is one FMA chain over k = 0..K-1 in order, whatever the row count, the row's
// tile or the thread split (threads split the panels): a verify tree's row gets the bits a
// one-row decode step gets. Built where the compiler targets AVX-512 (`panel_native()`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "panel_linear.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SPECFORK_PANEL 1
#endif

namespace {

constexpr int64_t PANEL = 32;      // outputs per panel: 2 vectors
constexpr int64_t MAX_TILE = 8;    // rows per tile: 2 x 8 accumulators
constexpr int64_t KB = 128;        // inputs per block: a panel's block is 16 KB, in L1

#ifdef SPECFORK_PANEL

// Rows t0..t0+NT of one panel over inputs k0..k1: each output's FMA chain starts at 0 (k0 = 0)
// or goes on from the partial sum stored in y, and ends with the bias and residual (k1 = K).
// Meanwhile it prefetches lines pf0..pf1 of panel `next` (a panel's input k is 128 bytes,
// lines 2k and 2k + 1), spread over its inputs.
template <int NT>
void panel_tile(const float* x, int64_t t0, int64_t K, int64_t k0, int64_t k1,
                const float* panel, const float* next, int64_t pf0, int64_t pf1,
                const float* bias, const float* res, float* y, int64_t N, int64_t n) {
  __m512 lo[NT], hi[NT];
  for (int r = 0; r < NT; ++r) {
    float* yr = y + (t0 + r) * N + n;
    lo[r] = k0 ? _mm512_loadu_ps(yr) : _mm512_setzero_ps();
    hi[r] = k0 ? _mm512_loadu_ps(yr + 16) : _mm512_setzero_ps();
  }
  const float* xr = x + t0 * K;
  int64_t line = pf0, due = 0;                       // due / (k1 - k0): lines owed so far
  for (int64_t k = k0; k < k1; ++k) {
    if (next)
      for (due += pf1 - pf0; due >= k1 - k0; due -= k1 - k0, ++line)
        _mm_prefetch((const char*)(next + line * 16), _MM_HINT_T1);
    const __m512 wl = _mm512_loadu_ps(panel + k * PANEL);
    const __m512 wh = _mm512_loadu_ps(panel + k * PANEL + 16);
    for (int r = 0; r < NT; ++r) {
      const __m512 xv = _mm512_set1_ps(xr[r * K + k]);
      lo[r] = _mm512_fmadd_ps(xv, wl, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, wh, hi[r]);
    }
  }
  for (int r = 0; r < NT; ++r) {
    float* yr = y + (t0 + r) * N + n;
    __m512 a = lo[r], b = hi[r];
    if (k1 == K && bias) {                           // QuantLinear's order: (y + b) + x
      a = _mm512_add_ps(a, _mm512_loadu_ps(bias + n));
      b = _mm512_add_ps(b, _mm512_loadu_ps(bias + n + 16));
    }
    if (k1 == K && res) {
      a = _mm512_add_ps(a, _mm512_loadu_ps(res + (t0 + r) * N + n));
      b = _mm512_add_ps(b, _mm512_loadu_ps(res + (t0 + r) * N + n + 16));
    }
    _mm512_storeu_ps(yr, a);
    _mm512_storeu_ps(yr + 16, b);
  }
}

// Panels p0..p1: per block of KB inputs (a panel's block stays in L1 while every row tile
// reads it), per row tile; the next panel is prefetched over the current one's tiles.
void panels(const float* x, int64_t T, int64_t K, const float* w, const float* bias,
            const float* res, int64_t p0, int64_t p1, float* y, int64_t N) {
  const int64_t tiles = (T + MAX_TILE - 1) / MAX_TILE, blocks = (K + KB - 1) / KB;
  const int64_t units = tiles * blocks;
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = w + p * K * PANEL;
    const float* next = p + 1 < p1 ? panel + K * PANEL : nullptr;
    int64_t u = 0;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t k1 = std::min(K, k0 + KB);
      for (int64_t t0 = 0; t0 < T; ++u) {
        const int64_t nt = std::min(MAX_TILE, T - t0);
        const int64_t pf0 = 2 * K * u / units, pf1 = 2 * K * (u + 1) / units;
        switch (nt) {
#define TILE(R) case R: panel_tile<R>(x, t0, K, k0, k1, panel, next, pf0, pf1, bias, res, y, N, \
                                      p * PANEL); break;
          TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
        }
        t0 += nt;
      }
    }
  }
}

#endif  // SPECFORK_PANEL

}  // namespace

bool panel_native() {
#ifdef SPECFORK_PANEL
  return true;
#else
  return false;
#endif
}

// w [N, K] float32 -> panels [N/32, K, 32] (N a multiple of 32).
at::Tensor panel_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) % PANEL == 0,
              "panel_pack: w [N, K] float32, N a multiple of ", PANEL);
  return w.view({w.size(0) / PANEL, PANEL, w.size(1)}).transpose(1, 2).contiguous();
}

// x [T, K] float32, w the panels of [N, K] -> [T, N] float32, plus bias [N] and residual
// [T, N] where given (in that order: (y + b) + x).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
#ifndef SPECFORK_PANEL
  TORCH_CHECK(false, "panel_linear: built without AVX-512");
#else
  RECORD_FUNCTION("specfork::panel_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_linear: x [T, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kFloat && w.size(2) == PANEL &&
                  w.size(1) == x.size(1) && w.is_contiguous(),
              "panel_linear: w [N/32, K, 32] float32 (panel_pack)");
  const int64_t T = x.size(0), K = x.size(1), P = w.size(0), N = P * PANEL;
  const auto xc = x.contiguous();
  at::Tensor bc, rc;
  if (bias) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, "panel_linear: bias [N]");
  }
  if (residual) {
    rc = residual->contiguous();
    TORCH_CHECK(rc.scalar_type() == at::kFloat && rc.dim() == 2 && rc.size(0) == T &&
                    rc.size(1) == N, "panel_linear: residual [T, N] float32");
  }
  auto y = at::empty({T, N}, x.options());
  if (T == 0) return y;
  const int64_t threads = at::get_num_threads();
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias ? bc.data_ptr<float>() : nullptr;
  const float* rp = residual ? rc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, (P + threads - 1) / threads, [&](int64_t p0, int64_t p1) {
    panels(xp, T, K, wp, bp, rp, p0, p1, yp, N);
  });
  return y;
#endif
}

TORCH_LIBRARY_FRAGMENT(specfork, m) {
  m.def("panel_linear(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor",
        &panel_linear);
  m.def("panel_pack(Tensor w) -> Tensor", &panel_pack);
  m.def("panel_native() -> bool", &panel_native);
}
