// The slot-attention op's C++ entry, for other ops of the same library (layer_stack.cpp), and
// the row/head loop it shares with code_attention.cpp.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

at::Tensor slot_attention(at::Tensor q, const at::Tensor& k, const at::Tensor& v, at::Tensor idx,
                          at::Tensor offs, double scale);

// Checks the slot lists, then calls fn(r, h, ix, n, s) for every (query row r, kv head h),
// split over torch's threads: row r reads the n slots ix[0..n), s is the thread's scratch.
template <class F>
void each_row_head(int64_t R, int64_t KVH, const at::Tensor& idx, const int64_t* op, F fn) {
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(op[r + 1] > op[r] && op[r] >= 0 && op[r + 1] <= idx.numel(),
                "each row reads at least one slot, within idx");
  at::parallel_for(0, R * KVH, 1, [&](int64_t a, int64_t b) {
    std::vector<float> s;
    for (int64_t it = a; it < b; ++it) {
      const int64_t r = it / KVH;
      fn(r, it % KVH, ip + op[r], op[r + 1] - op[r], s);
    }
  });
}
