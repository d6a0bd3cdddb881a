// The block-wise 8-bit optimizer-state format on the CUDA backend, shared by every 8-bit
// optimizer kernel (adamw8bit.cuh, sgd8bit.cuh): the block size, the two code maps, the
// quantizer of one block held by one warp and the kernels' loop over the blocks. Format and
// map, defined and justified: memkern/ops/adamw8bit.py; constants: memkern/kernels/state8bit.py.
//
// Each rounding follows the reference's separate torch ops (_rn intrinsics, never contracted
// into an FMA).
#pragma once

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace memkern::device {

constexpr int64_t kQBlock = 256;
constexpr int kQPerLane = kQBlock / 32;   // elements of a block per lane of its warp
constexpr float kSignedCodes = 127.0f;    // int8:  sign(c) * (|c| / 127)^2 * absmax
constexpr float kUnsignedCodes = 255.0f;  // uint8: (c / 255)^4 * absmax

// (|c| / C)^2 for a float code c: the quantity a code is the nearest of (|m| / absmax, or
// sqrt(v / absmax)).
template <bool kSigned>
__device__ __forceinline__ float code_square(float c) {
  const float q = __fdiv_rn(fabsf(c), kSigned ? kSignedCodes : kUnsignedCodes);
  return __fmul_rn(q, q);
}

// A code's value over its block's absmax, (|c| / C)^p, for a float code c.
template <bool kSigned>
__device__ __forceinline__ float relative_value(float c) {
  const float q2 = code_square<kSigned>(c);
  return kSigned ? q2 : __fmul_rn(q2, q2);
}

// The value of a signed code (first moments, momentum).
__device__ __forceinline__ float dequantize(int8_t code, float absmax) {
  const float x = __fmul_rn(relative_value<true>(static_cast<float>(code)), absmax);
  return code < 0 ? -x : x;
}

// The value of an unsigned code (second moments, >= 0).
__device__ __forceinline__ float dequantize(uint8_t code, float absmax) {
  return __fmul_rn(relative_value<false>(static_cast<float>(code)), absmax);
}

// Codes of the warp's block (x[k] of element `first + lane + 32 k`, `valid[k]` when it exists)
// and its absmax (int8 codes: any sign; uint8: >= 0): NaN and zero codes when a value is not
// finite, zero codes when all are 0. Every lane of the warp must call it.
template <typename code_t>
__device__ __forceinline__ void quantize_block(const float (&x)[kQPerLane],
                                               const bool (&valid)[kQPerLane], code_t* codes,
                                               float* absmax, int64_t first, int lane) {
  constexpr bool kSigned = std::is_same<code_t, int8_t>::value;
  static_assert(kSigned || std::is_same<code_t, uint8_t>::value, "codes are int8 or uint8");
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
    // The code nearest in (|c| / C)^2 to |m| / absmax, or to sqrt(v / absmax) (the root the
    // update divides by): lo, the code below (C for the absmax), or lo + 1 (where the root
    // rounds across an integer lo is one off, and the comparison still holds).
    const float rel = __fdiv_rn(fabsf(x[k]), divisor);
    const float rounded = kSigned ? rel : __fsqrt_rn(rel);
    const float lo =
        floorf(__fmul_rn(__fsqrt_rn(rounded), kSigned ? kSignedCodes : kUnsignedCodes));
    const bool above = __fsub_rn(rounded, code_square<kSigned>(lo)) >
                       __fsub_rn(code_square<kSigned>(__fadd_rn(lo, 1.0f)), rounded);
    float c = usable ? (above ? __fadd_rn(lo, 1.0f) : lo) : 0.0f;
    if constexpr (kSigned) {
      c = x[k] < 0.0f ? -c : c;
    }
    codes[first + lane + 32 * k] = static_cast<code_t>(static_cast<int>(c));
  }
  if (lane == 0) {
    *absmax = bad ? __int_as_float(0x7fc00000) : amax;
  }
}

// The loop of the 8-bit optimizer kernels: one warp per quantization block of kQBlock elements,
// the warps of the grid striding over the blocks; block_update(b, first, lane) for each block b
// of this warp (elements from `first`; the caller's lane in its warp). Launched with
// kThreadsPerBlock threads (a multiple of 32). The bound is uniform within a warp, so every
// lane takes part in block_update's shuffles.
template <typename BlockUpdate>
__device__ __forceinline__ void for_each_warp_qblock(int64_t n, const BlockUpdate& block_update) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  const int64_t blocks = (n + kQBlock - 1) / kQBlock;
  for (int64_t b = blockIdx.x * warps_per_block + threadIdx.x / 32; b < blocks;
       b += warp_stride) {
    block_update(b, b * kQBlock, lane);
  }
}

// The elements of a warp's block that this lane holds, i = first + lane + 32 k (valid[k]: it
// exists): master[i] = update(i, k, master[i], g) with g the gradient times `multiplier`, and
// params[i] (when not null) = round(master[i]).
template <typename G, typename P, typename ElementUpdate>
__device__ __forceinline__ void update_lane_elements(int64_t first, int lane, int64_t n,
                                                     float* master, const G* grads, P* params,
                                                     float multiplier,
                                                     bool (&valid)[kQPerLane],
                                                     const ElementUpdate& update) {
#pragma unroll
  for (int k = 0; k < kQPerLane; ++k) {
    const int64_t i = first + lane + 32 * k;
    valid[k] = i < n;
    if (valid[k]) {
      const float w = update(i, k, master[i], __fmul_rn(to_float(grads[i]), multiplier));
      master[i] = w;
      if (params != nullptr) {
        params[i] = from_float<P>(w);
      }
    }
  }
}

}  // namespace memkern::device
