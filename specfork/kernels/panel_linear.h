// The float32 panel matmul's C++ entry, for other ops of the same library (layer_stack.cpp).
#pragma once
#include <ATen/ATen.h>

#include <optional>

// Whether this build has the AVX-512 kernel (elsewhere `panel_linear` refuses).
bool panel_native();

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual);
