// The decoder-layer loop of one forward as one op (CPU, float32 activations), for forwards whose
// attention all goes through the slot op: decode steps, ROWS verify trees, batches of them.
//
// Why: in a decode step of a small model the matmuls are a third of the time; the rest is some
// 700 small torch calls (norms, RoPE, casts, K/V writes, residual adds) and the Python between
// them. Here the same ATen calls run in the same order on the same tensors, so every result is
// bit for bit what `Model.forward`'s Python loop computes (tests check this), and only the
// interpreter and Python argument parsing drop out.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "layer_ops.h"
#include "lowbit_linear.h"
#include "panel_linear.h"
#include "slot_attention.h"

namespace {

// How a matmul runs; `specfork/model.py: _stack_kind` picks one per matmul kind for the forward's
// row count, the choice `Linear` / `QuantLinear` would make (the same numbers there).
enum Kind : int64_t {
  LINEAR = 0,         // F.linear, float32
  PACKED = 1,         // oneDNN-packed float32
  PACKED_BLOCKS = 2,  // the same in calls of EXACT_ROWS rows (row-invariant bits)
  BF16_LINEAR = 3,    // bf16 weights, F.linear on bf16 rows
  BF16_PACKED = 4,    // bf16 weights packed, in calls of EXACT_ROWS rows
  INT8 = 5,           // _weight_int8pack_mm
  INT4 = 6,           // _weight_int4pack_mm_for_cpu, groups of 32
  LOWBIT4 = 7,        // lowbit_linear.cpp, 4-bit
  LOWBIT8 = 8,        // lowbit_linear.cpp, 8-bit
  LOWBIT16 = 9,       // lowbit_linear.cpp, bf16
  PANEL = 10,         // panel_linear.cpp, float32 (row-invariant bits)
};
constexpr int64_t EXACT_ROWS = 8;   // specfork/weights.py
constexpr int64_t GROUP = 32;

struct Lin {
  int64_t kind;
  const at::Tensor& w;
  const std::optional<at::Tensor>& s;
  const std::optional<at::Tensor>& b;
};

c10::OperatorHandle op_handle(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

at::Tensor pointwise(const at::Tensor& x, const at::Tensor& packed,
                     const std::optional<at::Tensor>& b) {
  static const c10::OperatorHandle op = op_handle("mkldnn::_linear_pointwise", "");
  torch::jit::Stack st{x, packed, b ? c10::IValue(*b) : c10::IValue(), c10::IValue("none"),
                       c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  op.callBoxed(&st);
  return st[0].toTensor();
}

at::Tensor pointwise_add(const at::Tensor& a, const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& b) {
  static const c10::OperatorHandle op = op_handle("mkldnn::_linear_pointwise", "binary");
  torch::jit::Stack st{a, x, packed, b ? c10::IValue(*b) : c10::IValue(), c10::IValue("add")};
  op.callBoxed(&st);
  return st[0].toTensor();
}

// weights.row_blocks: fn over x's rows (and res's) in calls of exactly EXACT_ROWS rows, the last
// padded with zeros.
template <class F>
at::Tensor row_blocks(F fn, at::Tensor x, at::Tensor res = at::Tensor()) {
  const int64_t T = x.size(0), pad = (EXACT_ROWS - T % EXACT_ROWS) % EXACT_ROWS;
  if (pad) {
    x = at::cat({x, at::zeros({pad, x.size(1)}, x.options())});
    if (res.defined()) res = at::cat({res, at::zeros({pad, res.size(1)}, res.options())});
  }
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < T + pad; i += EXACT_ROWS) {
    auto xi = x.slice(0, i, i + EXACT_ROWS);
    outs.push_back(res.defined() ? fn(xi, res.slice(0, i, i + EXACT_ROWS)) : fn(xi, xi));
  }
  auto y = outs.size() == 1 ? outs[0] : at::cat(outs);
  return y.slice(0, 0, T);
}

// lowbit_linear.cpp's product for a LOWBIT kind, plus `res` where given
at::Tensor lowbit(const Lin& l, const at::Tensor& x, const std::optional<at::Tensor>& res) {
  const int64_t bits = l.kind == LOWBIT4 ? 4 : l.kind == LOWBIT8 ? 8 : 16;
  return lowbit_linear(x, l.w, bits == 16 ? at::Tensor() : *l.s, bits, l.b, res);
}

// Linear.__call__ / QuantLinear.__call__ (never bulk: prompt rows do not come here)
at::Tensor apply(const Lin& l, const at::Tensor& x) {
  switch (l.kind) {
    case LINEAR: return at::linear(x, l.w, l.b);
    case PACKED: return pointwise(x, l.w, l.b);
    case PACKED_BLOCKS:
      return row_blocks([&](const at::Tensor& a, const at::Tensor&) {
        return pointwise(a, l.w, l.b); }, x);
    case LOWBIT4: case LOWBIT8: case LOWBIT16: return lowbit(l, x, std::nullopt);
    case PANEL: return panel_linear(x, l.w, l.b, std::nullopt);
    default: break;
  }
  const auto xb = x.to(at::kBFloat16);
  at::Tensor y;
  switch (l.kind) {
    case BF16_LINEAR: y = at::linear(xb, l.w); break;
    case BF16_PACKED:
      y = row_blocks([&](const at::Tensor& a, const at::Tensor&) {
        return pointwise(a, l.w, std::nullopt); }, xb);
      break;
    case INT8: y = at::_weight_int8pack_mm(xb, l.w, *l.s); break;
    case INT4: y = at::_weight_int4pack_mm_for_cpu(xb, l.w, GROUP, *l.s); break;
    default: TORCH_CHECK(false, "layer_stack: unknown matmul kind ", l.kind);
  }
  y = y.to(x.scalar_type());
  return l.b ? y.add_(*l.b) : y;
}

// Linear.add_to / QuantLinear.add_to: x + l(a)
at::Tensor add_to(const Lin& l, const at::Tensor& x, const at::Tensor& a) {
  switch (l.kind) {
    case LINEAR: return l.b ? x + at::linear(a, l.w, l.b) : at::addmm(x, a, l.w.t());
    case PACKED: return pointwise_add(a, x, l.w, l.b);
    case PACKED_BLOCKS:
      return row_blocks([&](const at::Tensor& ai, const at::Tensor& xi) {
        return pointwise_add(ai, xi, l.w, l.b); }, a, x);
    case LOWBIT4: case LOWBIT8: case LOWBIT16: return lowbit(l, a, x);
    case PANEL: return panel_linear(a, l.w, l.b, x);
    default: return apply(l, a).add_(x);
  }
}

}  // namespace

// x [T, hidden] through every decoder layer. Per layer i: norms[2i], norms[2i+1] (input and
// post-attention RMSNorm weights); w/s/b[4i + j] for j = qkv, o, gate_up, down (weights or
// their packed/quantized form, scales, biases) run as kinds[j]; the new K/V go to slots `write`
// (rows write_src, where given) of k_pool/v_pool [layers, blocks, block, KVH, D]; row r attends
// over idx[offs[r]:offs[r+1]] (or two stretches of it, slot_attention.h). dims = (heads, kv heads,
// head dim). `fused`: norms, RoPE and SiLU-mul through layer_ops.cpp (Model.fused_ops, which
// the Python loop follows too). Returns x after the last layer and, for each layer in
// `capture`, the residual stream entering it.
std::tuple<at::Tensor, std::vector<at::Tensor>> layer_stack(
    at::Tensor x, at::TensorList norms, at::TensorList w,
    const c10::List<std::optional<at::Tensor>>& s, const c10::List<std::optional<at::Tensor>>& b,
    at::IntArrayRef kinds, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
    const at::Tensor& v_pool, const at::Tensor& write, const std::optional<at::Tensor>& write_src,
    const at::Tensor& idx, const at::Tensor& offs, at::IntArrayRef dims, double eps,
    double scale, at::IntArrayRef capture, bool fused) {
  const int64_t L = (int64_t)norms.size() / 2;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "layer_stack: x [T, hidden] float32");
  TORCH_CHECK((int64_t)w.size() == 4 * L && (int64_t)s.size() == 4 * L &&
              (int64_t)b.size() == 4 * L && kinds.size() == 4 && dims.size() == 3,
              "layer_stack: 2 norms and 4 matmuls per layer, 4 kinds, 3 dims");
  TORCH_CHECK(k_pool.dim() == 5 && k_pool.size(0) == L && v_pool.sizes() == k_pool.sizes(),
              "layer_stack: pools [layers, blocks, block, KVH, D]");
  const int64_t T = x.size(0), H = dims[0], KVH = dims[1], D = dims[2];
  const int64_t nq = H * D, nqk = (H + KVH) * D, n = H + KVH;
  const std::vector<int64_t> hidden{x.size(1)};
  const auto norm = [&](const at::Tensor& a, const at::Tensor& w) {
    return fused ? fused_rms_norm(a, w, eps) : at::rms_norm(a, hidden, w, eps);
  };
  std::vector<at::Tensor> kept;
  for (int64_t i = 0; i < L; ++i) {
    for (auto c : capture)
      if (c == i) kept.push_back(x);
    const std::optional<at::Tensor> s0 = s[4 * i], s1 = s[4 * i + 1], s2 = s[4 * i + 2],
                                    s3 = s[4 * i + 3];
    const std::optional<at::Tensor> b0 = b[4 * i], b1 = b[4 * i + 1], b2 = b[4 * i + 2],
                                    b3 = b[4 * i + 3];
    const Lin qkv_l{kinds[0], w[4 * i], s0, b0}, o_l{kinds[1], w[4 * i + 1], s1, b1},
        gu_l{kinds[2], w[4 * i + 2], s2, b2}, down_l{kinds[3], w[4 * i + 3], s3, b3};
    auto qkv = apply(qkv_l, norm(x, norms[2 * i]));              // [T, (H + 2 KVH) D]
    at::Tensor q, k;
    if (fused) {
      fused_rope_(qkv, cos, sin, n, D);
      q = qkv.slice(1, 0, nq).view({T, H, D});
      k = qkv.slice(1, nq, nqk).view({T, KVH, D});
    } else {
      // apply_rope: x * cos + flip_halves(x) * sin_signed
      auto qk_in = qkv.slice(1, 0, nqk).view({T, n, D});
      auto rot = qk_in.view({T, n, 2, D / 2}).flip({2}).view({T, n, D});
      auto qk = at::addcmul(qk_in * cos, rot, sin);
      q = qk.slice(1, 0, H);
      k = qk.slice(1, H, n);
    }
    auto v = qkv.slice(1, nqk, qkv.size(1)).view({T, KVH, D});
    auto kf = k_pool.select(0, i).view({-1, KVH, D}), vf = v_pool.select(0, i).view({-1, KVH, D});
    // a float16 pool stores the rows rounded (as FloatCodec.encode), and every read sees that
    const auto kw = write_src ? k.index_select(0, *write_src) : k;
    const auto vw = write_src ? v.index_select(0, *write_src) : v;
    kf.index_copy_(0, write, kw.to(kf.scalar_type()));
    vf.index_copy_(0, write, vw.to(vf.scalar_type()));
    auto a = slot_attention(q, kf, vf, idx, offs, scale);
    x = add_to(o_l, x, a.reshape({T, nq}));
    auto gu = apply(gu_l, norm(x, norms[2 * i + 1]));
    if (fused) {
      x = add_to(down_l, x, fused_silu_mul(gu));
    } else {
      auto parts = gu.chunk(2, -1);
      x = add_to(down_l, x, at::silu(parts[0]) * parts[1]);
    }
  }
  return {x, kept};
}

TORCH_LIBRARY_FRAGMENT(specfork, m) {
  m.def("layer_stack(Tensor x, Tensor[] norms, Tensor[] w, Tensor?[] s, Tensor?[] b, int[] kinds, "
        "Tensor cos, Tensor sin, Tensor k_pool, Tensor v_pool, Tensor write, Tensor? write_src, "
        "Tensor idx, Tensor offs, int[] dims, float eps, float scale, int[] capture, bool fused) "
        "-> (Tensor, Tensor[])",
        &layer_stack);    // any backend key: packed bf16 weights are MkldnnCPU tensors
}
