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
  const float multiplier = grad_multiplier != nullptr ? *grad_multiplier : 1.0f;
  // torch initialises the momentum buffer from the first step's update.
  const bool first_step = *step == 0.0f;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  const int64_t blocks = (n + kQBlock - 1) / kQBlock;
  // The bound is uniform within a warp, so every lane takes part in the shuffles.
  for (int64_t b = blockIdx.x * warps_per_block + threadIdx.x / 32; b < blocks;
       b += warp_stride) {
    const int64_t first = b * kQBlock;
    const float scale = absmax[b];
    float buf[kQPerLane];
    bool valid[kQPerLane];
#pragma unroll
    for (int k = 0; k < kQPerLane; ++k) {
      const int64_t i = first + lane + 32 * k;
      valid[k] = i < n;
      buf[k] = 0.0f;
      if (valid[k]) {
        buf[k] = dequantize(codes[i], scale);
        const float g = __fmul_rn(to_float(grads[i]), multiplier);
        const float w = sgd_element(master[i], buf[k], g, first_step, c);
        master[i] = w;
        if (params != nullptr) {
          params[i] = from_float<P>(w);
        }
      }
    }
    quantize_block(buf, valid, codes, absmax + b, first, lane);
  }
}

}  // namespace memkern::device
