// memkern::sgd8bit_step_ — the SGD step of sgd.cuh with a block-wise 8-bit momentum buffer:
// dequantize, update, absmax, requantize, master and params write-back in one pass. Contract:
// memkern/ops/sgd8bit.py; quantization map: memkern/ops/adamw8bit.py; the element math of the
// format: csrc/math/state8bit.h (the CPU kernel's).
#pragma once

#include "../../math/state8bit.h"
#include "common.cuh"
#include "sgd.cuh"
#include "state8bit.cuh"

namespace memkern::device {

// `params` may be null; G and P are the dtypes of grads and params; c.use_momentum is set.
// Launched with kThreadsPerBlock threads (a multiple of 32); warps stride over the blocks.
template <typename G, typename P, bool kVector>
__global__ void __launch_bounds__(kThreadsPerBlock)
    sgd8bit_step_kernel(float* __restrict__ master, QMoment<int8_t> momentum,
                        const G* __restrict__ grads, P* __restrict__ params, int64_t n,
                        const float* step, const float* grad_multiplier,
                        const float* found_inf, math::SgdCoefficients c) {
  if (step_skipped(found_inf)) {
    return;
  }
  const float multiplier = grad_multiplier_value(grad_multiplier);
  const bool first_step = is_first_step(step);
  for_each_lane_block<kVector>(n, [&](int64_t b, int64_t i0, int count, int lane, auto width) {
    constexpr bool kWhole = decltype(width)::value == kQPerLane;
    Vec<float, kQPerLane> w = load_lane<kWhole>(master, i0, count);
    const Vec<G, kQPerLane> g = load_lane<kWhole>(grads, i0, count);
    const Vec<int8_t, kQPerLane> codes = load_lane<kWhole>(momentum.codes, i0, count);
    const float factor = math::signed_value_factor(momentum.absmax[b]);
    float buf[kQPerLane];
    uint32_t bits = 0;
#pragma unroll
    for (int k = 0; k < kQPerLane; ++k) {
      buf[k] = math::dequantize(codes.v[k], factor);
      w.v[k] = math::sgd_element(w.v[k], buf[k], __fmul_rn(to_float(g.v[k]), multiplier),
                                 first_step, c);
      if (kWhole || k < count) {
        bits = max(bits, math::abs_bits(buf[k]));
      }
    }
    store_weights<kWhole>(master, params, i0, w, count);
    quantize_lane<kWhole>(buf, bits, momentum, b, i0, count, lane);
  });
}

}  // namespace memkern::device
