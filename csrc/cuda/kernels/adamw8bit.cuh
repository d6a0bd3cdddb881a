// memkern::adamw8bit_step_ — the AdamW step of adamw.cuh with block-wise 8-bit moments:
// dequantize, update, absmax, requantize, master and params write-back in one pass. Contract
// and quantization map: memkern/ops/adamw8bit.py (constants: memkern/kernels/state8bit.py).
//
// The AdamW math (csrc/math/adamw.h) and the 8-bit element math (csrc/math/state8bit.h) are
// the CPU kernel's: the same bits. m is quantized from its new value, v from the square root
// the update divides by (one root per element for both).
#pragma once

#include "../../math/adamw.h"
#include "../../math/state8bit.h"
#include "adamw.cuh"
#include "common.cuh"
#include "state8bit.cuh"

namespace memkern::device {

// `params` may be null; G and P are the dtypes of grads and params; kVector: every buffer is
// aligned for vector accesses (for_each_lane_block). Launched with
// kThreadsPerBlock threads (a multiple of 32); warps stride over the quantization blocks.
template <typename G, typename P, bool kVector>
__global__ void __launch_bounds__(kThreadsPerBlock)
    adamw8bit_step_kernel(float* __restrict__ master, QMoment<int8_t> m, QMoment<uint8_t> v,
                          const G* __restrict__ grads, P* __restrict__ params, int64_t n,
                          const float* step, const float* grad_multiplier,
                          const float* found_inf, AdamWConstants constants) {
  if (step_skipped(found_inf)) {
    return;
  }
  const math::AdamWCoefficients c =
      adamw_block_coefficients(step, grad_multiplier_value(grad_multiplier), constants);
  for_each_lane_block<kVector>(n, [&](int64_t b, int64_t i0, int count, int lane, auto width) {
    constexpr bool kWhole = decltype(width)::value == kQPerLane;
    Vec<float, kQPerLane> w = load_lane<kWhole>(master, i0, count);
    const Vec<G, kQPerLane> g = load_lane<kWhole>(grads, i0, count);
    const Vec<int8_t, kQPerLane> m_codes = load_lane<kWhole>(m.codes, i0, count);
    const Vec<uint8_t, kQPerLane> v_codes = load_lane<kWhole>(v.codes, i0, count);
    const float m_factor = math::signed_value_factor(m.absmax[b]);
    const float v_factor = math::unsigned_value_factor(v.absmax[b]);
    float new_m[kQPerLane];
    float root_v[kQPerLane];
    uint32_t m_bits = 0;
    uint32_t v_bits = 0;
#pragma unroll
    for (int k = 0; k < kQPerLane; ++k) {
      float mk = math::dequantize(m_codes.v[k], m_factor);
      float vk = math::dequantize(v_codes.v[k], v_factor);
      math::adamw_moments(mk, vk, to_float(g.v[k]), c);
      root_v[k] = math::sqrt_rn(vk);
      w.v[k] = math::adamw_master(w.v[k], mk, root_v[k], c);
      new_m[k] = mk;
      if (kWhole || k < count) {
        m_bits = max(m_bits, math::abs_bits(mk));
        v_bits = max(v_bits, math::abs_bits(vk));
      }
    }
    store_weights<kWhole>(master, params, i0, w, count);
    quantize_lane<kWhole>(new_m, m_bits, m, b, i0, count, lane);
    quantize_lane<kWhole>(root_v, v_bits, v, b, i0, count, lane);
  });
}

}  // namespace memkern::device
