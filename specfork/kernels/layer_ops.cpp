// The small ops of a decoder layer, fused (CPU, float32, AVX-512): RMSNorm, RoPE in place, and
// SiLU(gate) * up.
//
// Why: around its matmuls a decode step of the embedded target makes some 500 ATen calls per
// step for these alone (at::rms_norm is eight ops on a CPU), each a few microseconds of
// dispatch and allocation for a few hundred floats of work. Under the low-bit weight formats
// both the compiled layer loop (layer_stack.cpp) and Model.forward's Python loop call these, so
// the two stay bit-equal; float32 keeps torch's ops, whose bits match Hugging Face's.
//
// Every row is computed alone, in a fixed order, so a row's bits do not depend on the call.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <cmath>

#include "layer_ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_math.h"
#define SPECFORK_LAYER_OPS 1
#endif

#ifdef SPECFORK_LAYER_OPS
namespace {

inline __mmask16 tail(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

}  // namespace
#endif

// x [T, H] float32, w [H] -> (x * 1/sqrt(mean(x^2) + eps)) * w per row (HF's RMSNorm formula).
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
#ifndef SPECFORK_LAYER_OPS
  TORCH_CHECK(false, "fused_rms_norm: built without AVX-512");
#else
  RECORD_FUNCTION("specfork::rms_norm", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  w.numel() == x.size(1), "rms_norm: x [T, H] and w [H] float32");
  const auto xc = x.contiguous(), wc = w.contiguous();
  const int64_t T = x.size(0), H = x.size(1);
  auto y = at::empty_like(xc);
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = xp + t * H;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(tail(H - i), xr + i);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)H + (float)eps);
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 m = tail(H - i);
      _mm512_mask_storeu_ps(yp + t * H + i, m, _mm512_mul_ps(
          _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + i), rv), _mm512_maskz_loadu_ps(m, wp + i)));
    }
  }
  return y;
#endif
}

// In place on the first `heads` heads of qkv [T, >= heads * D] (q and k): x * cos + rot(x) * sin
// with rot swapping the halves of each head and sin = cat(-sin1, sin2) (Model.rope's tables,
// [T, 1, D] or [T, D]); HF's rotate_half. D a multiple of 32.
void fused_rope_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t heads, int64_t D) {
#ifndef SPECFORK_LAYER_OPS
  TORCH_CHECK(false, "fused_rope_: built without AVX-512");
#else
  RECORD_FUNCTION("specfork::rope_", std::vector<c10::IValue>());
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat &&
                  qkv.size(1) >= heads * D && D % 32 == 0,
              "rope_: qkv [T, >= heads * D] contiguous float32, D a multiple of 32");
  const int64_t T = qkv.size(0), C = qkv.size(1), h2 = D / 2;
  const auto cc = cos.reshape({T, D}).contiguous(), sc = sin.reshape({T, D}).contiguous();
  TORCH_CHECK(cc.scalar_type() == at::kFloat && sc.scalar_type() == at::kFloat,
              "rope_: float32 tables");
  float* p = qkv.data_ptr<float>();
  const float *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* x = p + t * C + h * D;
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t i = 0; i < h2; i += 16) {
        const __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + h2 + i);
        _mm512_storeu_ps(x + i, _mm512_fmadd_ps(hi, _mm512_loadu_ps(s + i),
                                                _mm512_mul_ps(lo, _mm512_loadu_ps(c + i))));
        _mm512_storeu_ps(x + h2 + i, _mm512_fmadd_ps(
            lo, _mm512_loadu_ps(s + h2 + i), _mm512_mul_ps(hi, _mm512_loadu_ps(c + h2 + i))));
      }
    }
#endif
}

// gu [T, 2I] (gate | up) -> silu(gate) * up [T, I], silu(g) = g / (1 + e^-g).
at::Tensor fused_silu_mul(const at::Tensor& gu) {
#ifndef SPECFORK_LAYER_OPS
  TORCH_CHECK(false, "fused_silu_mul: built without AVX-512");
#else
  RECORD_FUNCTION("specfork::silu_mul", std::vector<c10::IValue>());
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.scalar_type() == at::kFloat,
              "silu_mul: gu [T, 2I] float32");
  const auto g = gu.contiguous();
  const int64_t T = g.size(0), I = g.size(1) / 2;
  auto y = at::empty({T, I}, g.options());
  const float* gp = g.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = tail(I - i);
      const __m512 a = _mm512_maskz_loadu_ps(m, gp + t * 2 * I + i);
      const __m512 u = _mm512_maskz_loadu_ps(m, gp + t * 2 * I + I + i);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
      _mm512_mask_storeu_ps(yp + t * I + i, m,
                            _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(one, e)), u));
    }
  return y;
#endif
}

TORCH_LIBRARY_FRAGMENT(specfork, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &fused_rms_norm);
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int D) -> ()", &fused_rope_);
  m.def("silu_mul(Tensor gu) -> Tensor", &fused_silu_mul);
}
