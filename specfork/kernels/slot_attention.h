// The slot-attention op's C++ entry, for other ops of the same library (layer_stack.cpp), and
// the row/head loop it shares with code_attention.cpp.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <vector>

at::Tensor slot_attention(at::Tensor q, const at::Tensor& k, const at::Tensor& v, at::Tensor idx,
                          at::Tensor offs, double scale);

// Row r's slot list: idx[a:b], then idx[c:d]. `offs` is either [R+1] (row r: idx[offs[r] :
// offs[r+1]]) or [R, 4] rows (a, b, c, d): rows may then share slots (a prompt chunk's rows all
// read one list, each a longer stretch of it; a tree's rows one prefix, then their ancestors).
struct RowSlots {
  int64_t a, b, c, d;
  int64_t size() const { return b - a + d - c; }
};

// Checks the slot lists and puts them in RowSlots form.
std::vector<RowSlots> row_slots(const at::Tensor& offs, int64_t R, int64_t numel);

// fn(r, h, s, joined) for every (row r, kv head h), threads taking items one at a time, longest
// rows first; s and joined are the thread's scratch. Which thread runs an item never changes
// its result.
template <class F>
void for_each_item(const std::vector<RowSlots>& rows, int64_t KVH, F fn) {
  const int64_t R = (int64_t)rows.size(), N = R * KVH;
  std::vector<int64_t> order((size_t)R);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return rows[x].size() > rows[y].size();
  });
  std::atomic<int64_t> next{0};
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N));
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    std::vector<float> s;
    std::vector<int64_t> joined;
    for (int64_t it; (it = next.fetch_add(1)) < N;) fn(order[it / KVH], it % KVH, s, joined);
  });
}

// Calls fn(r, h, ix, n, s) for every (query row r, kv head h), split over torch's threads:
// row r reads the n slots ix[0..n) (a row of two stretches gets them copied into one list), s
// is the thread's scratch. Threads take items one at a time, longest rows first, so a prompt
// chunk's causal rows (the last reads T times what the first does) keep both threads busy.
template <class F>
void each_row_head(int64_t KVH, const int64_t* ip, const std::vector<RowSlots>& rows, F fn) {
  for_each_item(rows, KVH, [&](int64_t r, int64_t h, std::vector<float>& s,
                               std::vector<int64_t>& joined) {
    const RowSlots& x = rows[r];
    if (x.d == x.c) return fn(r, h, ip + x.a, x.b - x.a, s);
    joined.assign(ip + x.a, ip + x.b);
    joined.insert(joined.end(), ip + x.c, ip + x.d);
    fn(r, h, joined.data(), (int64_t)joined.size(), s);
  });
}
