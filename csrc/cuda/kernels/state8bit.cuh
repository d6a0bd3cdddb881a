// The block-wise 8-bit optimizer-state format on the CUDA backend, shared by every 8-bit
// optimizer kernel (adamw8bit.cuh, sgd8bit.cuh): the block size, the two code maps, the
// quantizer of one block held by one warp, and the kernels' loop over the blocks with its
// per-block part (update_qblocks: dequantize, the optimizer's element update, requantize). Format and
// map, defined and justified: memkern/ops/adamw8bit.py; constants: memkern/kernels/state8bit.py.
#pragma once

#include <cfloat>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "common.cuh"

namespace memkern::device {

constexpr int64_t kQBlock = 256;
constexpr int kQPerLane = kQBlock / 32;   // elements of a block per lane of its warp
constexpr float kSignedCodes = 127.0f;    // int8:  sign(c) * (|c| / 127)^2 * absmax
constexpr float kUnsignedCodes = 255.0f;  // uint8: (c / 255)^4 * absmax

// Both directions as the CPU kernel computes them (csrc/cpu/state8bit.h, where the closed
// form is derived): products by per-block factors and one square root per code, no division
// per element. The reference's order of roundings (a division by C per code value; per code a
// division by the absmax, two roots and two code values to compare) took 14 correctly rounded
// divisions per element: the AdamW block loop compiled to 444 SASS instructions per element
// for sm_90, now 290 (benchmarks/step_kernel_sass.py), against a budget of ~200 at 80% of an
// H100's copy bandwidth. Values agree with the reference's to a few ulp, codes but for a value
// within an ulp of a code boundary (the oracle tests' tolerance). Products that feed an
// addition use __fmul_rn, which nvcc never contracts.

// The value of a signed code (first moments, momentum): sign(c) * (|c| / 127)^2 * absmax as
// (c |c| 2^-14) (exact) times absmax 2^14 / 127^2.
__device__ __forceinline__ float dequantize(int8_t code, float absmax) {
  const float c = static_cast<float>(code);
  constexpr float kFactor = 0x1p14f / (kSignedCodes * kSignedCodes);
  return ((c * fabsf(c)) * 0x1p-14f) * (absmax * kFactor);
}

// The value of an unsigned code (second moments, >= 0): (c / 255)^4 * absmax as
// ((c / 256)^2)^2 (the square exact) times absmax (256 / 255)^4.
__device__ __forceinline__ float dequantize(uint8_t code, float absmax) {
  const float q = static_cast<float>(code) * 0x1p-8f;
  const float q2 = q * q;
  constexpr float kFactor = static_cast<float>(0x1p32 / (255.0 * 255.0 * 255.0 * 255.0));
  return (q2 * q2) * (absmax * kFactor);
}

// The code k in [0, C] whose k^2 is nearest to y in [0, C^2] (y = C^2 |m| / absmax, or
// C^2 sqrt(v / absmax)): round(sqrt(y - 1/4)), to the even code on an exact midpoint.
__device__ __forceinline__ float nearest_square_code(float y) {
  return rintf(__fsqrt_rn(fabsf(__fadd_rn(y, -0.25f))));
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
  // y = C^2 |m| / absmax (below 2^-100 C^2 / absmax could overflow: |m| and absmax are scaled
  // by 2^64 first, which is exact), or y = C^2 sqrt(v) / sqrt(absmax), the root the update
  // divides by; one division per lane and block.
  const float pre = kSigned && amax < 0x1p-100f ? 0x1p64f : 1.0f;
  const float factor = usable ? (kSigned ? kSignedCodes * kSignedCodes / (amax * pre)
                                         : kUnsignedCodes * kUnsignedCodes / __fsqrt_rn(amax))
                              : 0.0f;
#pragma unroll
  for (int k = 0; k < kQPerLane; ++k) {
    if (!valid[k]) {
      continue;
    }
    const float a = kSigned ? fabsf(x[k]) * pre : __fsqrt_rn(x[k]);
    float c = usable ? nearest_square_code(__fmul_rn(a, factor)) : 0.0f;
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

// One moment of an 8-bit optimizer state: its codes (int8: the signed map; uint8: the unsigned
// one) and the absmax of each block.
template <typename code_t>
struct QMoment {
  code_t* codes;
  float* absmax;
};

// update_qblocks, with k... the indices of the moments.
template <size_t... k, typename G, typename P, typename ElementUpdate, typename... code_t>
__device__ __forceinline__ void update_qblocks(std::index_sequence<k...>, int64_t n,
                                               float* master, const G* grads, P* params,
                                               float multiplier, const ElementUpdate& update,
                                               QMoment<code_t>... moments) {
  for_each_warp_qblock(n, [&](int64_t b, int64_t first, int lane) {
    const float scales[] = {moments.absmax[b]...};
    float x[sizeof...(k)][kQPerLane] = {};
    bool valid[kQPerLane];
    update_lane_elements(first, lane, n, master, grads, params, multiplier, valid,
                         [&](int64_t i, int j, float w, float g) {
                           ((x[k][j] = dequantize(moments.codes[i], scales[k])), ...);
                           return update(w, g, x[k][j]...);
                         });
    (quantize_block(x[k], valid, moments.codes, moments.absmax + b, first, lane), ...);
  });
}

// The body of an 8-bit optimizer kernel after its skip check: for each quantization block of
// this warp, its moments dequantized (into registers, 8 elements per lane), then for each
// element master[i] = update(master[i], g, moment values...) with g the gradient times
// `multiplier` and the moments updated in place, params[i] (when not null) = round(master[i]),
// then each moment's codes and absmax. Every lane of the warp must call it.
template <typename G, typename P, typename ElementUpdate, typename... code_t>
__device__ __forceinline__ void update_qblocks(int64_t n, float* master, const G* grads,
                                               P* params, float multiplier,
                                               const ElementUpdate& update,
                                               QMoment<code_t>... moments) {
  update_qblocks(std::index_sequence_for<code_t...>{}, n, master, grads, params, multiplier,
                 update, moments...);
}

}  // namespace memkern::device
