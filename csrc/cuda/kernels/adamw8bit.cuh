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
  // update_qblocks hands over gradients already multiplied
  const math::AdamWCoefficients s = adamw_block_coefficients(step, 1.0f, c);
  update_qblocks(n, master, grads, params, grad_multiplier_value(grad_multiplier),
                 [&](float w, float g, float& m, float& v) {
                   return math::adamw_element(w, m, v, g, s);
                 },
                 QMoment<int8_t>{m_codes, m_absmax}, QMoment<uint8_t>{v_codes, v_absmax});
}

}  // namespace memkern::device
