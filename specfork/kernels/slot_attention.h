// The slot-attention op's C++ entry, for other ops of the same library (layer_stack.cpp).
#pragma once
#include <ATen/ATen.h>

at::Tensor slot_attention(at::Tensor q, const at::Tensor& k, const at::Tensor& v, at::Tensor idx,
                          at::Tensor offs, double scale);
