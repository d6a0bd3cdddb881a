// memkern::adamw8bit_step_ — the AdamW step of adamw.cuh with block-wise 8-bit moments:
// dequantize, update, absmax, requantize, master and params write-back in one pass. Contract
// and quantization map: memkern/ops/adamw8bit.py (constants: memkern/kernels/state8bit.py).
//
// One warp per quantization block of kQBlock = 64 elements (two per lane): the block's absmax
// is a warp reduction, so nothing goes through shared memory. Each rounding follows the
// reference's separate torch ops (_rn intrinsics, never contracted into an FMA).
#pragma once

#include <cfloat>

#include "adamw.cuh"
#include "common.cuh"

namespace memkern::device {

constexpr int64_t kQBlock = 64;
constexpr int kQPerLane = kQBlock / 32;
constexpr float kSignedCodes = 127.0f;    // m: sign(c) * (|c| / 127)^2 * absmax
constexpr float kUnsignedCodes = 255.0f;  // v: (c / 255)^4 * absmax

__device__ __forceinline__ float dequantize_m(int8_t code, float absmax) {
  const float q = __fdiv_rn(fabsf(static_cast<float>(code)), kSignedCodes);
  const float x = __fmul_rn(__fmul_rn(q, q), absmax);
  return code < 0 ? -x : x;
}

__device__ __forceinline__ float dequantize_v(uint8_t code, float absmax) {
  const float q = __fdiv_rn(static_cast<float>(code), kUnsignedCodes);
  const float q2 = __fmul_rn(q, q);
  return __fmul_rn(__fmul_rn(q2, q2), absmax);
}

// Codes of the warp's block (x[k] of element `first + lane + 32 k`, `valid[k]` when it exists)
// and its absmax: NaN and zero codes when a value is not finite, zero codes when all are 0.
template <bool kSigned, typename code_t>
__device__ __forceinline__ void quantize_block(const float (&x)[kQPerLane],
                                               const bool (&valid)[kQPerLane], code_t* codes,
                                               float* absmax, int64_t first, int lane) {
  float amax = 0.0f;
  bool bad = false;
#pragma unroll
  for (int k = 0; k < kQPerLane; ++k) {
    const float a = valid[k] ? fabsf(x[k]) : 0.0f;
    const bool finite = a <= FLT_MAX;
    bad |= !finite;
    amax = finite ? fmaxf(amax, a) : amax;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  bad = __any_sync(0xffffffffu, bad);
  const bool usable = !bad && amax > 0.0f;
  const float divisor = usable ? amax : 1.0f;
#pragma unroll
  for (int k = 0; k < kQPerLane; ++k) {
    if (!valid[k]) {
      continue;
    }
    float r = __fsqrt_rn(__fdiv_rn(fabsf(x[k]), divisor));
    if constexpr (!kSigned) {
      r = __fsqrt_rn(r);
    }
    float c = floorf(__fadd_rn(__fmul_rn(r, kSigned ? kSignedCodes : kUnsignedCodes), 0.5f));
    c = usable ? c : 0.0f;
    if constexpr (kSigned) {
      c = x[k] < 0.0f ? -c : c;
    }
    codes[first + lane + 32 * k] = static_cast<code_t>(static_cast<int>(c));
  }
  if (lane == 0) {
    *absmax = bad ? __int_as_float(0x7fc00000) : amax;
  }
}

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
  __shared__ AdamWStepScalars s;
  adamw_step_scalars(step, c, &s);
  const float multiplier = grad_multiplier != nullptr ? *grad_multiplier : 1.0f;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  const int64_t blocks = (n + kQBlock - 1) / kQBlock;
  // The bound is uniform within a warp, so every lane takes part in the shuffles.
  for (int64_t b = blockIdx.x * warps_per_block + threadIdx.x / 32; b < blocks;
       b += warp_stride) {
    const int64_t first = b * kQBlock;
    const float m_scale = m_absmax[b];
    const float v_scale = v_absmax[b];
    float m[kQPerLane];
    float v[kQPerLane];
    bool valid[kQPerLane];
#pragma unroll
    for (int k = 0; k < kQPerLane; ++k) {
      const int64_t i = first + lane + 32 * k;
      valid[k] = i < n;
      m[k] = 0.0f;
      v[k] = 0.0f;
      if (valid[k]) {
        m[k] = dequantize_m(m_codes[i], m_scale);
        v[k] = dequantize_v(v_codes[i], v_scale);
        const float g = __fmul_rn(to_float(grads[i]), multiplier);
        const float w = adamw_element(master[i], m[k], v[k], g, s, c);
        master[i] = w;
        if (params != nullptr) {
          params[i] = from_float<P>(w);
        }
      }
    }
    quantize_block<true>(m, valid, m_codes, m_absmax + b, first, lane);
    quantize_block<false>(v, valid, v_codes, v_absmax + b, first, lane);
  }
}

}  // namespace memkern::device
