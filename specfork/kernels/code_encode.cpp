// TurboQuant encoding of K/V rows on the CPU: x `[N, D]` (keys already centred and scaled)
// -> the stored rows `[N, nbytes]` uint8 and their decode `[N, D]` float32 (rotated space).
//
// The same steps as TurboCodec._encode / _code_rows in specfork/kv_quant.py: norm, rotation
// of the unit vector, nearest centroid per coordinate (its group's codebook), the scale
// |x| / (u . c) as fp16, the codes into their bit planes. In torch that is some forty small
// ops per layer and step; here one call. Each row is computed on its own (the rotation as a
// sum over its coordinates in a fixed order), so a row's codes never depend on how many rows
// share the call: a verify tree stores what the decode steps would.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// cinfo [3, D]: per coordinate, its table offset, its edges' offset and how many edges;
// layout [P, 5, D] as TurboCodec.kernel_layout (byte, shift, mask, low bit, table offset).
std::tuple<at::Tensor, at::Tensor> code_encode(at::Tensor x, at::Tensor rt, at::Tensor table,
                                               at::Tensor edges, at::Tensor cinfo,
                                               at::Tensor layout, int64_t nbytes) {
  RECORD_FUNCTION("specfork::code_encode", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x [N, D] float32");
  const int64_t N = x.size(0), D = x.size(1);
  TORCH_CHECK(rt.sizes() == at::IntArrayRef({D, D}) && rt.scalar_type() == at::kFloat,
              "rotation [D, D] float32");
  TORCH_CHECK(cinfo.scalar_type() == at::kInt && cinfo.size(0) == 3 && cinfo.size(1) == D &&
              layout.scalar_type() == at::kInt && layout.dim() == 3 && layout.size(1) == 5 &&
              layout.size(2) == D, "cinfo [3, D], layout [P, 5, D] int32");
  TORCH_CHECK(table.scalar_type() == at::kFloat && edges.scalar_type() == at::kFloat,
              "float codebooks");
  x = x.contiguous();
  rt = rt.contiguous();
  table = table.contiguous();
  edges = edges.contiguous();
  cinfo = cinfo.contiguous();
  layout = layout.contiguous();
  auto rows = at::zeros({N, nbytes}, x.options().dtype(at::kByte));
  auto dec = at::empty({N, D}, x.options());
  const float *xp = x.data_ptr<float>(), *rp = rt.data_ptr<float>();
  const float *tp = table.data_ptr<float>(), *ep = edges.data_ptr<float>();
  const int32_t *ci = cinfo.data_ptr<int32_t>(), *lay = layout.data_ptr<int32_t>();
  uint8_t* rowp = rows.data_ptr<uint8_t>();
  float* dp = dec.data_ptr<float>();
  const int64_t P = layout.size(0);
  at::parallel_for(0, N, 16, [&](int64_t a, int64_t b) {
    std::vector<float> y((size_t)D), c((size_t)D);
    std::vector<int32_t> code((size_t)D);
    for (int64_t n = a; n < b; ++n) {
      const float* xr = xp + n * D;
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
      const float norm = std::sqrt(ss);
      const float inv = 1.0f / std::max(norm, 1e-30f);
      std::fill(y.begin(), y.end(), 0.f);
      for (int64_t i = 0; i < D; ++i) {          // y = (x / |x|) @ rt, a row at a time
        const float u = xr[i] * inv;
        const float* rr = rp + i * D;
        int64_t d = 0;
#if defined(__AVX512F__)
        const __m512 uv = _mm512_set1_ps(u);
        for (; d + 16 <= D; d += 16)
          _mm512_storeu_ps(y.data() + d, _mm512_fmadd_ps(uv, _mm512_loadu_ps(rr + d),
                                                         _mm512_loadu_ps(y.data() + d)));
#endif
        for (; d < D; ++d) y[d] = std::fma(u, rr[d], y[d]);
      }
      float yc = 0.f;
      for (int64_t d = 0; d < D; ++d) {          // bucketize: how many edges lie below y
        const float* e = ep + ci[D + d];
        const int32_t ne = ci[2 * D + d];
        const int32_t k = (int32_t)(std::lower_bound(e, e + ne, y[d]) - e);
        code[d] = k;
        c[d] = tp[ci[d] + k];
        yc += y[d] * c[d];
      }
      const c10::Half h(norm / std::max(yc, 1e-6f));
      const float sc = static_cast<float>(h);
      uint8_t* row = rowp + n * nbytes;
      const uint16_t bits = h.x;
      std::memcpy(row, &bits, 2);
      float* dr = dp + n * D;
      for (int64_t d = 0; d < D; ++d) {
        dr[d] = c[d] * sc;
        for (int64_t p = 0; p < P; ++p) {
          const int32_t* L = lay + p * 5 * D;
          row[L[d]] |= (uint8_t)(((code[d] >> L[3 * D + d]) & L[2 * D + d]) << L[D + d]);
        }
      }
    }
  });
  return {rows, dec};
}

TORCH_LIBRARY_FRAGMENT(specfork, m) {
  m.def("code_encode(Tensor x, Tensor rt, Tensor table, Tensor edges, Tensor cinfo, "
        "Tensor layout, int nbytes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specfork, CPU, m) { m.impl("code_encode", &code_encode); }
