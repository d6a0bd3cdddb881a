// memkern::unscale_ on CPU: grads *= inv_scale in place, found_inf = 1 if any input is
// non-finite. Contract: memkern/ops/unscale.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>

#include "../checks.h"
#include "flat_math.h"

namespace memkern::cpu {
namespace {

// Returns whether any of the n input elements was inf or NaN.
template <typename grad_t>
MEMKERN_VECTOR_CLONES bool unscale_block(grad_t* __restrict grads, float inv_scale, int64_t n) {
  uint32_t any_non_finite = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_float(grads[i]);
    any_non_finite |= is_non_finite(g);
    grads[i] = from_float<grad_t>(g * inv_scale);
  }
  return any_non_finite != 0;
}

void unscale_cpu(at::Tensor& grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_flat("unscale_", "grads", grads, grads);
  check_float_kind("unscale_", "grads", grads);
  check_scalar("unscale_", "found_inf", found_inf, grads);
  check_scalar("unscale_", "inv_scale", inv_scale, grads);
  const float scale = read_scalar(inv_scale);
  std::atomic<bool> any_non_finite{false};
  dispatch_float_kind(grads.scalar_type(), [&](auto tag) {
    using grad_t = decltype(tag);
    auto* data = static_cast<grad_t*>(grads.data_ptr());
    parallel_blocks(grads.numel(), [&](int64_t begin, int64_t end) {
      if (unscale_block(data + begin, scale, end - begin)) any_non_finite = true;
    });
  });
  if (any_non_finite) *found_inf.data_ptr<float>() = 1.0f;
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("unscale_", &unscale_cpu); }

}  // namespace memkern::cpu
