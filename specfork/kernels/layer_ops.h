// The fused small ops' C++ entries (layer_ops.cpp), for layer_stack.cpp.
#pragma once
#include <ATen/ATen.h>

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
void fused_rope_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t heads, int64_t D);
at::Tensor fused_silu_mul(const at::Tensor& gu);
