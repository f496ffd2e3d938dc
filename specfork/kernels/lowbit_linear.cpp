// Weight-only low-bit matmuls for few rows (CPU, int4 / int8 / bf16 weights): y = x @ dequant(w).T
// (+ bias) (+ residual).
//
// Why: a decode step reads every weight once, so its matmuls should run at the memory's read
// bandwidth. torch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` reach about 0.3 of
// it on one or a few rows here, and take bf16 activations (a cast each way per matmul). This
// kernel dequantizes each weight once per tile of rows to float32 and multiplies float32
// activations, 16 per instruction, tiles of up to 4 rows x 4 outputs sharing each dequantized
// vector; the residual add and the bias are fused. The block formats are GGUF's own: int4 is
// Q4_1 (w = q * d + m per 32 weights) and int8 is Q8_0 (w = q * d), d and m float16, so weights
// that came from such a file are held exactly. (bf16 dot products, `vdpbf16ps`, measured slower
// on the Sapphire Rapids here: one per ~3.5 cycles against a float32 FMA per cycle.)
//
// Every (row, output) is computed by the same instructions in the same order whatever the row
// count, the row's place in the call or the thread split (threads split the outputs), so a
// verify tree's row gets the bits the one-row decode step gets. Built where the compiler targets
// AVX-512 (`lowbit_native()`); elsewhere QuantLinear keeps torch's kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "lowbit_linear.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SPECFORK_LOWBIT 1
#endif

namespace {

constexpr int64_t GROUP = 32;   // inputs per scale (GGUF Q4_1 / Q8_0 blocks)

#ifdef SPECFORK_LOWBIT

// A product's value plus its bias and residual where given, in QuantLinear's order ((y + b) + x).
inline float finish(float v, const float* bias, const float* res, int64_t t, int64_t N,
                    int64_t n) {
  if (bias) v += bias[n];
  if (res) v += res[t * N + n];
  return v;
}

// Block formats, rows t0..t0+NT of outputs n..n+NO, groups of 32 inputs:
// - 4-bit (GGUF Q4_1): w [N, K/2] bytes, group g in bytes 16g..16g+15, byte j holding input
//   32g + j in its low nibble and 32g + 16 + j in its high one; sz [N, K/32, 2] float16 (scale d,
//   offset m): w = fma(q, d, m), the group's 16 values computed once and looked up by code;
// - 8-bit (GGUF Q8_0): w [N, K] int8, sz [N, K/32] float16 (scale d): w = q * d (exact in float32).
// Each weight is dequantized once per tile and shared by its rows; NT x NO accumulators keep the
// multiply-add units busy; the next tile's bytes are prefetched as this one's are read.
template <int NT, int NO, int BITS>
void group_tile(const float* x, int64_t t0, int64_t K, const uint8_t* w, const uint16_t* sz,
                const float* bias, const float* res, float* y, int64_t N, int64_t n) {
  constexpr int64_t PASS = 64;                      // groups whose scales are widened at once
  constexpr int64_t RB = BITS * GROUP / 8;          // bytes of a group's weights
  constexpr int64_t SV = BITS == 4 ? 2 : 1;         // scale values per group
  const int64_t G = K / GROUP;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const char* next = (const char*)(w + std::min(n + NO, N - 1) * RB * G);
  alignas(64) float sf[NO][SV * PASS];
  __m512 acc[NT][NO];
  for (int r = 0; r < NT; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < G; g0 += PASS) {
    const int64_t gn = std::min(PASS, G - g0);
    for (int o = 0; o < NO; ++o)
      for (int64_t i = 0; i < SV * gn; i += 16) {
        const __mmask16 m = SV * gn - i >= 16 ? (__mmask16)0xFFFF
                                              : (__mmask16)((1u << (SV * gn - i)) - 1);
        _mm512_store_ps(sf[o] + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
            m, sz + ((n + o) * G + g0) * SV + i)));
      }
    for (int64_t g = g0; g < g0 + gn; ++g) {
      if (t0 == 0)
        for (int64_t l = 0; l < RB * NO; l += 64) _mm_prefetch(next + RB * NO * g + l, _MM_HINT_T0);
      __m512 xa[NT], xb[NT];
      for (int r = 0; r < NT; ++r) {
        xa[r] = _mm512_loadu_ps(x + (t0 + r) * K + GROUP * g);
        xb[r] = _mm512_loadu_ps(x + (t0 + r) * K + GROUP * g + 16);
      }
      for (int o = 0; o < NO; ++o) {
        const uint8_t* wg = w + ((n + o) * G + g) * RB;
        const __m512 s = _mm512_set1_ps(sf[o][SV * (g - g0)]);
        __m512 wa, wb;
        if constexpr (BITS == 4) {
          const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)wg));
          // vpermps reads the low 4 bits of each lane: the low nibble as it is, the high one
          // shifted down
          const __m512 table = _mm512_fmadd_ps(iota, s, _mm512_set1_ps(sf[o][2 * (g - g0) + 1]));
          wa = _mm512_permutexvar_ps(codes, table);
          wb = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
        } else {
          wa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_loadu_si128((const __m128i*)wg))), s);
          wb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_loadu_si128((const __m128i*)(wg + 16)))), s);
        }
        for (int r = 0; r < NT; ++r) {
          acc[r][o] = _mm512_fmadd_ps(wa, xa[r], acc[r][o]);
          acc[r][o] = _mm512_fmadd_ps(wb, xb[r], acc[r][o]);
        }
      }
    }
  }
  for (int r = 0; r < NT; ++r)
    for (int o = 0; o < NO; ++o)
      y[(t0 + r) * N + n + o] = finish(_mm512_reduce_add_ps(acc[r][o]), bias, res, t0 + r, N,
                                       n + o);
}

// bf16 weights widened to float32 by their bits, 16 at a time.
inline __m512 widen(const uint16_t* w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)w)), 16));
}

// bf16, rows t0..t0+NT of outputs n..n+NO: w [N, K]; prefetching as the block formats do.
template <int NT, int NO>
void bf16_tile(const float* x, int64_t t0, int64_t K, const uint16_t* w, const float* bias,
               const float* res, float* y, int64_t N, int64_t n) {
  __m512 acc[NT][NO];
  for (int r = 0; r < NT; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    if (t0 == 0 && k % 32 == 0)                       // the next tile's rows, a line at a time
      for (int o = 0; o < NO; ++o)
        _mm_prefetch((const char*)(w + std::min(n + NO + o, N - 1) * K + k), _MM_HINT_T0);
    __m512 xr[NT];
    for (int r = 0; r < NT; ++r) xr[r] = _mm512_loadu_ps(x + (t0 + r) * K + k);
    for (int o = 0; o < NO; ++o) {
      const __m512 wf = widen(w + (n + o) * K + k);
      for (int r = 0; r < NT; ++r) acc[r][o] = _mm512_fmadd_ps(wf, xr[r], acc[r][o]);
    }
  }
  for (int r = 0; r < NT; ++r)
    for (int o = 0; o < NO; ++o)
      y[(t0 + r) * N + n + o] = finish(_mm512_reduce_add_ps(acc[r][o]), bias, res, t0 + r, N,
                                       n + o);
}

// Outputs n0..n1 for all T rows in tiles of up to 4 rows x 4 outputs (a tail output alone):
// f.operator()<rows, outputs>(first row, first output).
template <class F>
void tiles(int64_t T, int64_t n0, int64_t n1, F f) {
  for (int64_t n = n0; n < n1;) {
    const bool four = n1 - n >= 4;
    for (int64_t t0 = 0; t0 < T;) {
      const int64_t nt = std::min<int64_t>(4, T - t0);
      switch (four ? nt : nt + 4) {
        case 1: f.template operator()<1, 4>(t0, n); break;
        case 2: f.template operator()<2, 4>(t0, n); break;
        case 3: f.template operator()<3, 4>(t0, n); break;
        case 4: f.template operator()<4, 4>(t0, n); break;
        case 5: f.template operator()<1, 1>(t0, n); break;
        case 6: f.template operator()<2, 1>(t0, n); break;
        case 7: f.template operator()<3, 1>(t0, n); break;
        default: f.template operator()<4, 1>(t0, n); break;
      }
      t0 += nt;
    }
    n += four ? 4 : 1;
  }
}

template <int BITS>
void group_rows(const float* x, int64_t T, int64_t K, const uint8_t* w, const uint16_t* sz,
                const float* bias, const float* res, int64_t n0, int64_t n1, float* y,
                int64_t N) {
  tiles(T, n0, n1, [&]<int NT, int NO>(int64_t t0, int64_t n) {
    group_tile<NT, NO, BITS>(x, t0, K, w, sz, bias, res, y, N, n);
  });
}

void bf16_rows(const float* x, int64_t T, int64_t K, const uint16_t* w, const float* bias,
               const float* res, int64_t n0, int64_t n1, float* y, int64_t N) {
  tiles(T, n0, n1, [&]<int NT, int NO>(int64_t t0, int64_t n) {
    bf16_tile<NT, NO>(x, t0, K, w, bias, res, y, N, n);
  });
}

#endif  // SPECFORK_LOWBIT

}  // namespace

bool lowbit_native() {
#ifdef SPECFORK_LOWBIT
  return true;
#else
  return false;
#endif
}

// x [T, K] float32; bits 4: w uint8 [N, K/2], s float16 [N, K/32, 2] (scale, offset per group);
// bits 8: w int8 [N, K], s float16 [N, K/32]; bits 16: w bfloat16 [N, K], s unused. Returns
// [T, N] float32, plus bias [N] and residual [T, N] where given (in that order: (y + b) + x).
at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                         int64_t bits, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual) {
#ifndef SPECFORK_LOWBIT
  TORCH_CHECK(false, "lowbit_linear: built without AVX-512");
#else
  // profilers see it under its own name when layer_stack.cpp calls it directly
  RECORD_FUNCTION("specfork::lowbit_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "lowbit_linear: x [T, K] float32");
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 16, "lowbit_linear: bits 4, 8 or 16");
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % GROUP == 0, "lowbit_linear: inputs a multiple of ", GROUP);
  TORCH_CHECK(w.is_contiguous() && (bits == 16 || s.is_contiguous()),
              "lowbit_linear: contiguous weights, scales");
  if (bits == 4) {
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) == K / 2 && s.dim() == 3 &&
                    s.scalar_type() == at::kHalf &&
                    s.size(0) == N && s.size(1) == K / GROUP && s.size(2) == 2,
                "lowbit_linear: 4-bit weights [N, K/2] uint8, scales [N, K/32, 2] float16");
  } else if (bits == 8) {
    TORCH_CHECK(w.scalar_type() == at::kChar && w.size(1) == K && s.dim() == 2 &&
                    s.scalar_type() == at::kHalf && s.size(0) == N && s.size(1) == K / GROUP,
                "lowbit_linear: 8-bit weights [N, K] int8, scales [N, K/32] float16");
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == K,
                "lowbit_linear: 16-bit weights [N, K] bfloat16");
  }
  const auto xc = x.contiguous();
  at::Tensor bc, rc;
  if (bias) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, "lowbit_linear: bias [N]");
  }
  if (residual) {
    rc = residual->contiguous();
    TORCH_CHECK(rc.scalar_type() == at::kFloat && rc.dim() == 2 && rc.size(0) == T &&
                    rc.size(1) == N, "lowbit_linear: residual [T, N] float32");
  }
  auto y = at::empty({T, N}, x.options());
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (N + threads - 1) / threads);
  const float* xp = xc.data_ptr<float>();
  const float* bp = bias ? bc.data_ptr<float>() : nullptr;
  const float* rp = residual ? rc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (bits == 4)
      group_rows<4>(xp, T, K, w.data_ptr<uint8_t>(), (const uint16_t*)s.data_ptr<at::Half>(), bp,
                    rp, n0, n1, yp, N);
    else if (bits == 8)
      group_rows<8>(xp, T, K, (const uint8_t*)w.data_ptr<int8_t>(),
                    (const uint16_t*)s.data_ptr<at::Half>(), bp, rp, n0, n1, yp, N);
    else
      bf16_rows(xp, T, K, (const uint16_t*)w.data_ptr<at::BFloat16>(), bp, rp, n0, n1, yp, N);
  });
  return y;
#endif
}

TORCH_LIBRARY_FRAGMENT(specfork, m) {
  m.def("lowbit_linear(Tensor x, Tensor w, Tensor s, int bits, Tensor? bias, Tensor? residual) "
        "-> Tensor", &lowbit_linear);
  m.def("lowbit_native() -> bool", &lowbit_native);
}
