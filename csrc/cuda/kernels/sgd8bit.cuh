// memkern::sgd8bit_step_ — the SGD step of sgd.cuh with a block-wise 8-bit momentum buffer:
// dequantize, update, absmax, requantize, master and params write-back in one pass. Contract:
// memkern/ops/sgd8bit.py (the format: memkern/ops/adamw8bit.py, state8bit.cuh).
//
// One warp per quantization block of kQBlock elements, as adamw8bit.cuh: the block's absmax is
// a warp reduction, so nothing goes through shared memory.
#pragma once

#include "common.cuh"
#include "sgd.cuh"
#include "state8bit.cuh"

namespace memkern::device {

// `params` may be null; G and P are the dtypes of grads and params; c.use_momentum is set.
// Launched with kThreadsPerBlock threads (a multiple of 32); warps stride over the blocks.
template <typename G, typename P>
__global__ void sgd8bit_step_kernel(float* master, int8_t* codes, float* absmax, const G* grads,
                                    P* params, int64_t n, const float* step,
                                    const float* grad_multiplier, const float* found_inf,
                                    SGDConstants c) {
  if (step_skipped(found_inf)) {
    return;
  }
  const bool first_step = is_first_step(step);
  update_qblocks(n, master, grads, params, grad_multiplier_value(grad_multiplier),
                 [&](float w, float g, float& buf) {
                   return sgd_element(w, buf, g, first_step, c);
                 },
                 QMoment<int8_t>{codes, absmax});
}

}  // namespace memkern::device
