// Weight-only low-bit matmuls for few rows (CPU, int4 / int8 / bf16 weights): y = x @ dequant(w).T
// (+ bias) (+ residual).
//
// Why: a decode step reads every weight once, so its matmuls should run at the memory's read
// bandwidth, and a verify tree's or a batch's 8-16 rows should cost little more than one.
// torch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` reach about 0.3 of the bandwidth
// on a few rows here. The block formats are GGUF's own: int4 is Q4_1 (w = q * d + m per 32
// weights) and int8 is Q8_0 (w = q * d), d and m float16, so weights that came from such a file
// are held exactly. As llama.cpp does, each row's activations are quantized to 8 bits per group
// of 32 (Q8_0-like, the offsets' term in float32) and the codes multiply them in integers with
// AVX512-VNNI's vpdpbusd: 64 products per instruction, four times a float32 FMA's 16, with no
// per-weight dequantization, so extra rows cost a fraction of the weights' read. From AMX_ROWS
// rows (a verify tree, a batch) AMX's tdpbusd multiplies 16 rows by a record at once (where the
// CPU and the kernel allow it; SPECFORK_AMX=0: off); its integers are vpdpbusd's, and every row
// then ends with the same float ops. Weights are held in panels of 16 outputs (weights.py's
// pack_q4 / pack_q8), one output per float32 lane, so no horizontal sum is left at the end.
// Residual add and bias are fused. (An earlier kernel here dequantized every weight to float32
// per tile of 4 rows: one row ran at 0.47 of the bandwidth.) bf16 weights take float32 FMAs
// over rows and outputs (bf16 dot products, `vdpbf16ps`, measured slower on the Sapphire Rapids
// here: one per ~3.5 cycles against a float32 FMA per cycle).
//
// Every (row, output) is computed by the same instructions in the same order whatever the row
// count, the row's place in the call or the thread split (threads split the outputs), so a
// verify tree's row gets the bits the one-row decode step gets. Built where the compiler targets
// AVX-512 with VNNI (`lowbit_native()`); elsewhere QuantLinear keeps torch's kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "lowbit_linear.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SPECFORK_LOWBIT 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define SPECFORK_AMX 1
#endif
#endif

namespace {

constexpr int64_t GROUP = 32;   // inputs per scale (GGUF Q4_1 / Q8_0 blocks)
constexpr int64_t LANES = 16;   // outputs per panel: one per float32 lane

#ifdef SPECFORK_LOWBIT

// A row's activations quantized as llama.cpp does before a Q4_1 / Q8_0 dot product: per group of
// 32 inputs a scale dx = max|x| / 127 and codes xq = round(x / dx) in -127..127, stored as
// xq + 128 (unsigned: vpdpbusd and AMX's tdpbusd take one operand unsigned, and the weights,
// signed, are the other); with them, per group, dx * sum(xq), which Q4_1's offsets multiply (the
// sum of the quantized row, not of x: the product is then w . x^ for the quantized x^, whose
// error sum(w (x - x^)) weighs by w, not by w - m, about twice as large). Each row on its own, so
// a row's values do not depend on the call. Rows are padded to a multiple of 16 (AMX tiles).
struct QuantRows {
  std::vector<uint8_t> u;       // [T16, K]: xq + 128
  std::vector<float> dx, xs;    // [T, G]
};

void quantize_rows(const float* x, int64_t T, int64_t K, QuantRows& a) {
  const int64_t G = K / GROUP;
  a.u.assign(((T + 15) / 16 * 16) * K, 128);
  a.dx.resize(T * G);
  a.xs.resize(T * G);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m128i off = _mm_set1_epi8((char)128);
  for (int64_t i = 0; i < T * G; ++i) {
    const float* xg = x + i * GROUP;                  // row i / G, group i % G
    const __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));   // to nearest, ties even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    _mm_storeu_si128((__m128i*)(a.u.data() + i * GROUP),
                     _mm_add_epi8(_mm512_cvtsepi32_epi8(q0), off));
    _mm_storeu_si128((__m128i*)(a.u.data() + i * GROUP + 16),
                     _mm_add_epi8(_mm512_cvtsepi32_epi8(q1), off));
    a.dx[i] = amax / 127.0f;
    a.xs[i] = a.dx[i] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// A (panel, group) record's weights in the layout both multiply instructions read, 8 vectors of
// 64 bytes: vector c (0..7), lane j holds output j's signed weights of inputs 4c..4c+3 (an AMX B
// tile of 8 rows). In memory (weights.py's pack_q4 / pack_q8):
// - 4-bit (GGUF Q4_1, w = q * d + m): 4 chunks; in chunk c, lane j's 4 bytes hold output j's codes
//   of inputs 4c..4c+3 in their low nibbles and 16+4c..16+4c+3 in their high ones: vectors c and
//   4 + c once split;
// - 8-bit (GGUF Q8_0, w = q * d): the 8 vectors as they are.
// Also -128 * sum(w) per lane, which takes the activations' +128 back out of the integer sum.
template <int BITS>
inline __m512i record(const uint8_t* wg, __m512i v[8]) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i sum = _mm512_setzero_si512();
  if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i bytes = _mm512_setzero_si512();         // per byte at most 4 x 2 x 15: no overflow
    for (int c = 0; c < 4; ++c) {
      const __m512i x = _mm512_loadu_si512(wg + 64 * c);
      v[c] = _mm512_and_si512(x, low);
      v[4 + c] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
      bytes = _mm512_add_epi8(bytes, _mm512_add_epi8(v[c], v[4 + c]));
    }
    sum = _mm512_dpbusd_epi32(sum, ones, bytes);
  } else {
    for (int c = 0; c < 8; ++c) {
      v[c] = _mm512_loadu_si512(wg + 64 * c);
      sum = _mm512_dpbusd_epi32(sum, ones, v[c]);
    }
  }
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
}

// One row's integer dot product of a group with a panel, corrected, into its float32 accumulator
// (one lane per output): acc = fma(float(isum) * dx, d, acc), and for 4 bits
// acc = fma(m, dx * sum(xq), acc). Both kernels end every (row, group) with exactly these ops.
template <int BITS>
inline __m512 scale_add(__m512i isum, float dx, float xs, __m512 d, __m512 m, __m512 acc) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dx)), d, acc);
  if constexpr (BITS == 4) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(xs), acc);
  return acc;
}

inline void store_row(__m512 v, const float* bias, const float* res, float* y, int64_t N,
                      int64_t t, int64_t n) {   // (y + b) + x, as QuantLinear adds them
  if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
  if (res) v = _mm512_add_ps(v, _mm512_loadu_ps(res + t * N + n));
  _mm512_storeu_ps(y + t * N + n, v);
}

constexpr int64_t SV_OF(int bits) { return bits == 4 ? 2 : 1; }   // scale vectors per record

// VNNI, rows t0..t0+NT of one panel (16 outputs), all groups: vpdpbusd sums 4 activation x weight
// products per lane, so a group of 16 outputs takes 8 per row, exact in int32.
template <int NT, int BITS>
void vnni_tile(const QuantRows& a, int64_t t0, int64_t K, const uint8_t* w, const uint16_t* sp,
               const float* bias, const float* res, float* y, int64_t N, int64_t n,
               bool prefetch) {
  constexpr int64_t RB = BITS * GROUP * LANES / 8;  // bytes of a record's weights
  constexpr int64_t SV = SV_OF(BITS);
  const int64_t G = K / GROUP;
  __m512 acc[NT];
  for (int r = 0; r < NT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * RB;
    if (prefetch)                                   // 8 groups ahead in the panel stream
      for (int64_t l = 0; l < RB; l += 64)
        _mm_prefetch((const char*)(wg + 8 * RB + l), _MM_HINT_T0);
    __m512i v[8];
    const __m512i corr = record<BITS>(wg, v);
    __m512i is[NT];
    for (int r = 0; r < NT; ++r) is[r] = corr;
    for (int c = 0; c < 8; ++c)
      for (int r = 0; r < NT; ++r) {
        const uint8_t* xu = a.u.data() + (t0 + r) * K + g * GROUP + 4 * c;   // 4 activations
        is[r] = _mm512_dpbusd_epi32(is[r], _mm512_set1_epi32(*(const int32_t*)xu), v[c]);
      }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + g * SV * LANES)));
    const __m512 m = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                     (const __m256i*)(sp + (g * SV + 1) * LANES)))
                               : d;
    for (int r = 0; r < NT; ++r) {
      const int64_t i = (t0 + r) * G + g;
      acc[r] = scale_add<BITS>(is[r], a.dx[i], a.xs[i], d, m, acc[r]);
    }
  }
  for (int r = 0; r < NT; ++r) store_row(acc[r], bias, res, y, N, t0 + r, n);
}

#ifdef SPECFORK_AMX
// AMX: one tdpbusd per (record, block of 16 rows) multiplies the block's activations (tile A,
// 16 rows x 32 bytes, read in place at stride K) by the record's weights (tile B, 8 x 64 bytes:
// the 8 vectors above) into C [16 rows x 16 outputs] int32 - the very integers vpdpbusd sums -
// then each row ends as the VNNI kernel's rows do. Tiles: 0 = C, 1 = A, 2 = B.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 32, 64, 64, 32, 64};
  uint8_t rows[16] = {16, 16, 8, 16, 16, 8};
};

bool amx_ready() {                      // Linux gives a process AMX state only when it asks
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

template <int BITS>
void amx_panel(const QuantRows& a, int64_t T, int64_t K, const uint8_t* w, const uint16_t* sp,
               const float* bias, const float* res, float* y, int64_t N, int64_t n,
               bool prefetch) {
  constexpr int64_t RB = BITS * GROUP * LANES / 8;
  constexpr int64_t SV = SV_OF(BITS);
  const int64_t G = K / GROUP;
  alignas(64) int32_t cbuf[2][16 * LANES];
  alignas(64) uint8_t bbuf[2][8 * 64];
  for (int64_t t0 = 0; t0 < T; t0 += 16) {
    const int64_t nt = std::min<int64_t>(16, T - t0);
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < G; g0 += 2) {      // two groups in flight: tiles 0-2 and 3-5
      const int64_t ng = std::min<int64_t>(2, G - g0);
      __m512i corr[2];
      for (int64_t h = 0; h < ng; ++h) {
        const uint8_t* wg = w + (g0 + h) * RB;
        if (prefetch && t0 == 0)
          for (int64_t l = 0; l < RB; l += 64)
            _mm_prefetch((const char*)(wg + 8 * RB + l), _MM_HINT_T0);
        __m512i v[8];
        corr[h] = record<BITS>(wg, v);
        if constexpr (BITS == 4)
          for (int c = 0; c < 8; ++c) _mm512_store_si512(bbuf[h] + 64 * c, v[c]);
      }
      const uint8_t* b0 = BITS == 4 ? bbuf[0] : w + g0 * RB;
      const uint8_t* b1 = BITS == 4 ? bbuf[1] : w + (g0 + 1) * RB;
      _tile_zero(0);
      _tile_loadd(1, a.u.data() + t0 * K + g0 * GROUP, K);
      _tile_loadd(2, b0, 64);
      _tile_dpbusd(0, 1, 2);
      if (ng == 2) {
        _tile_zero(3);
        _tile_loadd(4, a.u.data() + t0 * K + (g0 + 1) * GROUP, K);
        _tile_loadd(5, b1, 64);
        _tile_dpbusd(3, 4, 5);
      }
      _tile_stored(0, cbuf[0], 64);
      if (ng == 2) _tile_stored(3, cbuf[1], 64);
      for (int64_t h = 0; h < ng; ++h) {
        const int64_t g = g0 + h;
        const __m512 d = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i*)(sp + g * SV * LANES)));
        const __m512 m = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                         (const __m256i*)(sp + (g * SV + 1) * LANES)))
                                   : d;
        for (int r = 0; r < nt; ++r) {
          const int64_t i = (t0 + r) * G + g;
          acc[r] = scale_add<BITS>(_mm512_add_epi32(_mm512_load_si512(cbuf[h] + 16 * r), corr[h]),
                                   a.dx[i], a.xs[i], d, m, acc[r]);
        }
      }
    }
    for (int r = 0; r < nt; ++r) store_row(acc[r], bias, res, y, N, t0 + r, n);
  }
}
#endif

// Rows from which AMX multiplies (below, vpdpbusd); both give every row the same bits. Scratch
// timing of the embedded target's layer matmuls, int4, interleaved runs: 8 rows 7.9 / 7.6 ms
// (AMX / vpdpbusd), 10 rows 9.1 / 10.0, 12 rows 9.9 / 11.4, 16 rows 11.1 / 13.6; a record's
// tile round trip (loads, tdpbusd, store, reload) costs more than 8 rows of vpdpbusd.
constexpr int64_t AMX_ROWS = 10;

// Panels p0..p1 for all T rows. VNNI: tiles of up to 8 rows, the first streaming a panel from
// memory, later ones finding it in L1 (a panel is 16 x K/2 bytes at 4 bits). AMX: all rows at once.
template <int BITS>
void panel_rows(const QuantRows& a, int64_t T, int64_t K, const uint8_t* w, const uint16_t* s,
                const float* bias, const float* res, int64_t p0, int64_t p1, float* y,
                int64_t N, bool amx) {
  constexpr int64_t SV = SV_OF(BITS);
  const int64_t G = K / GROUP, PB = BITS * GROUP * LANES / 8 * G;   // bytes per panel
#ifdef SPECFORK_AMX
  if (amx) {
    const TileConfig cfg;
    _tile_loadconfig(&cfg);
    for (int64_t p = p0; p < p1; ++p)
      amx_panel<BITS>(a, T, K, w + p * PB, s + p * G * SV * LANES, bias, res, y, N, p * LANES,
                      p + 1 < p1);
    _tile_release();
    return;
  }
#endif
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* wp = w + p * PB;
    const uint16_t* sp = s + p * G * SV * LANES;
    for (int64_t t0 = 0; t0 < T; t0 += 8) {
      const bool pf = t0 == 0 && p + 1 < p1;
      switch (std::min<int64_t>(8, T - t0)) {
#define SPECFORK_TILE(R) \
        case R: vnni_tile<R, BITS>(a, t0, K, wp, sp, bias, res, y, N, p * LANES, pf); break;
        SPECFORK_TILE(1) SPECFORK_TILE(2) SPECFORK_TILE(3) SPECFORK_TILE(4)
        SPECFORK_TILE(5) SPECFORK_TILE(6) SPECFORK_TILE(7) SPECFORK_TILE(8)
#undef SPECFORK_TILE
      }
    }
  }
}

// A product's value plus its bias and residual where given, in QuantLinear's order ((y + b) + x).
inline float finish(float v, const float* bias, const float* res, int64_t t, int64_t N,
                    int64_t n) {
  if (bias) v += bias[n];
  if (res) v += res[t * N + n];
  return v;
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
  TORCH_CHECK(false, "lowbit_linear: built without AVX-512 VNNI");
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
                "lowbit_linear: 4-bit panels [N, K/2] uint8, scales [N, K/32, 2] float16");
  } else if (bits == 8) {
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) == K && s.dim() == 2 &&
                    s.scalar_type() == at::kHalf && s.size(0) == N && s.size(1) == K / GROUP,
                "lowbit_linear: 8-bit panels [N, K] uint8, scales [N, K/32] float16");
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == K,
                "lowbit_linear: 16-bit weights [N, K] bfloat16");
  }
  TORCH_CHECK(bits == 16 || N % LANES == 0, "lowbit_linear: outputs a multiple of ", LANES);
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
  if (bits == 16) {
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      bf16_rows(xp, T, K, (const uint16_t*)w.data_ptr<at::BFloat16>(), bp, rp, n0, n1, yp, N);
    });
    return y;
  }
  QuantRows a;                       // every row's activations, quantized once for all panels
  quantize_rows(xp, T, K, a);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = (const uint16_t*)s.data_ptr<at::Half>();
  const int64_t P = N / LANES;
#ifdef SPECFORK_AMX
  const char* env = std::getenv("SPECFORK_AMX");            // SPECFORK_AMX=0: vpdpbusd only
  const bool amx = T >= AMX_ROWS && !(env && env[0] == '0') && amx_ready();
#else
  const bool amx = false;
#endif
  at::parallel_for(0, P, (P + threads - 1) / threads, [&](int64_t p0, int64_t p1) {
    if (bits == 4)
      panel_rows<4>(a, T, K, wp, sp, bp, rp, p0, p1, yp, N, amx);
    else
      panel_rows<8>(a, T, K, wp, sp, bp, rp, p0, p1, yp, N, amx);
  });
  return y;
#endif
}

TORCH_LIBRARY_FRAGMENT(specfork, m) {
  m.def("lowbit_linear(Tensor x, Tensor w, Tensor s, int bits, Tensor? bias, Tensor? residual) "
        "-> Tensor", &lowbit_linear);
  m.def("lowbit_native() -> bool", &lowbit_native);
}
