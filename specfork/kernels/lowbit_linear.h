// The low-bit matmul op's C++ entry, for other ops of the same library (layer_stack.cpp).
#pragma once
#include <ATen/ATen.h>

#include <optional>

// Whether this build has the AVX-512 (VNNI) kernels (elsewhere `lowbit_linear` refuses).
bool lowbit_native();

at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                         int64_t bits, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual);
