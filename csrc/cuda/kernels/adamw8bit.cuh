// memkern::adamw8bit_step_ — the AdamW step of adamw.cuh with block-wise 8-bit moments:
// dequantize, update, absmax, requantize, master and params write-back in one pass. Contract
// and quantization map: memkern/ops/adamw8bit.py (constants: memkern/kernels/state8bit.py).
//
// One warp per quantization block of kQBlock elements (state8bit.cuh): the block's absmax is a
// warp reduction, so nothing goes through shared memory.
#pragma once

#include "adamw.cuh"
#include "common.cuh"
#include "state8bit.cuh"

namespace memkern::device {

// `params` may be null; G and P are the dtypes of grads and params. Launched with
// kThreadsPerBlock threads (a multiple of 32); warps stride over the quantization blocks.
template <typename G, typename P>
__global__ void adamw8bit_step_kernel(float* master, int8_t* m_codes, float* m_absmax,
                                      uint8_t* v_codes, float* v_absmax, const G* grads,
                                      P* params, int64_t n, const float* step,
                                      const float* grad_multiplier, const float* found_inf,
                                      AdamWConstants c) {
  if (step_skipped(found_inf)) {
    return;
  }
  // update_lane_elements hands over gradients already multiplied
  const math::AdamWCoefficients s = adamw_block_coefficients(step, 1.0f, c);
  const float multiplier = grad_multiplier_value(grad_multiplier);
  for_each_warp_qblock(n, [&](int64_t b, int64_t first, int lane) {
    const float m_scale = m_absmax[b];
    const float v_scale = v_absmax[b];
    float m[kQPerLane] = {};
    float v[kQPerLane] = {};
    bool valid[kQPerLane];
    update_lane_elements(first, lane, n, master, grads, params, multiplier, valid,
                         [&](int64_t i, int k, float w, float g) {
                           m[k] = dequantize(m_codes[i], m_scale);
                           v[k] = dequantize(v_codes[i], v_scale);
                           return math::adamw_element(w, m[k], v[k], g, s);
                         });
    quantize_block(m, valid, m_codes, m_absmax + b, first, lane);
    quantize_block(v, valid, v_codes, v_absmax + b, first, lane);
  });
}

}  // namespace memkern::device
