// Vector math shared by the CPU ops (AVX-512, float32).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2, |r| <= ln2/2,
// degree-6 Taylor polynomial (relative error < 2e-7, about one float ulp). Above 0 it holds to
// the float range and gives inf beyond it (SiLU's e^-g for very negative g).
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));        // below: the result is 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// s <- exp(s - max s), returns the sum (in 16 lanes, then across them); the max in *max_out.
static inline float softmax_unnormed(float* s, int64_t n, float* max_out = nullptr) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  float m = _mm512_reduce_max_ps(mx);
  for (; j < n; ++j) m = std::max(m, s[j]);
  if (max_out) *max_out = m;
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mv));
    _mm512_mask_storeu_ps(s + j, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
  }
  return _mm512_reduce_add_ps(sum);
}
