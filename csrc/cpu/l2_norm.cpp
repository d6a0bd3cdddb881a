// memkern::l2_norm on CPU: sqrt(sum(float(x)^2)). Contract: memkern/ops/l2_norm.py.
//
// The buffer is cut into fixed blocks, one parallel task each. Inside a block, squares are
// accumulated in float32 over 16 independent lanes (so the loop vectorises without
// reassociating one sum), and the lanes are folded into a double every kFoldEvery elements so
// float32 rounding never builds up over long runs. Block sums are added in block order: the
// result does not depend on the number of threads.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../checks.h"
#include "flat_math.h"

namespace memkern::cpu {
namespace {

constexpr int64_t kNormBlock = 1 << 16;
constexpr int kLanes = 16;
constexpr int64_t kFoldEvery = 1024;

// n <= kFoldEvery. The elements are first widened into an L1-resident float array (a plain
// conversion loop vectorises far better than converting inside the lane reduction).
template <typename grad_t>
MEMKERN_VECTOR_CLONES double short_sum_of_squares(const grad_t* __restrict x, int64_t n) {
  float widened[kFoldEvery];
  for (int64_t i = 0; i < n; ++i) widened[i] = to_float(x[i]);
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += widened[i + j] * widened[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) lanes[j] += widened[i] * widened[i];
  double total = 0.0;
  for (float lane : lanes) total += lane;
  return total;
}

template <typename grad_t>
double block_sum_of_squares(const grad_t* x, int64_t n) {
  double total = 0.0;
  for (int64_t i = 0; i < n; i += kFoldEvery) {
    total += short_sum_of_squares(x + i, std::min(kFoldEvery, n - i));
  }
  return total;
}

at::Tensor l2_norm_cpu(const at::Tensor& grads) {
  check_flat("l2_norm", "grads", grads, grads);
  check_float_kind("l2_norm", "grads", grads);
  const int64_t n = grads.numel();
  const int64_t blocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> block_sums(blocks, 0.0);
  dispatch_float_kind(grads.scalar_type(), [&](auto tag) {
    using grad_t = decltype(tag);
    const auto* data = static_cast<const grad_t*>(grads.const_data_ptr());
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int64_t begin = b * kNormBlock;
        block_sums[b] = block_sum_of_squares(data + begin, std::min(kNormBlock, n - begin));
      }
    });
  });
  double total = 0.0;
  for (double s : block_sums) total += s;
  at::Tensor norm = at::empty({}, grads.options().dtype(at::kFloat));
  *norm.data_ptr<float>() = static_cast<float>(std::sqrt(total));
  return norm;
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("l2_norm", &l2_norm_cpu); }

}  // namespace memkern::cpu
