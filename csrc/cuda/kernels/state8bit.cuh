// The block-wise 8-bit optimizer-state format on the CUDA backend, shared by every 8-bit
// optimizer kernel (adamw8bit.cuh, sgd8bit.cuh): the element math of csrc/math/state8bit.h
// (which the CPU kernels run too: the same codes and values), one quantization block per warp,
// and the kernels' loop over the blocks. Format and map, defined and justified:
// memkern/ops/adamw8bit.py; constants: memkern/kernels/state8bit.py.
//
// A lane holds kQPerLane contiguous elements of its warp's block, so a whole block moves with
// one vector access per lane and buffer (the codes 8 bytes, master and bfloat16 grads and
// params 16-byte accesses), and the block's absmax is one warp reduction of the lanes' largest
// abs_bits. The first layout, lane + 32 k, took one access per element and buffer: 108 memory
// instructions per lane and block in the AdamW kernel, with the branches of a partial block on
// every element (benchmarks/NOTES.md has the instruction counts).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../../math/state8bit.h"
#include "common.cuh"

namespace memkern::device {

using math::kQBlock;
constexpr int kQPerLane = static_cast<int>(kQBlock / 32);  // elements of a block per lane
static_assert(kQPerLane == kVecWidth,
              "a lane's elements of a block are one vector chunk: the launchers check "
              "vector alignment for kVecWidth elements");

// One moment of an 8-bit optimizer state: its codes (int8: the signed map; uint8: the unsigned
// one) and the absmax of each block.
template <typename code_t>
struct QMoment {
  code_t* codes;
  float* absmax;
};

// The largest `value` of the warp, in every lane.
__device__ __forceinline__ uint32_t warp_max(uint32_t value) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, value);
#else
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    value = max(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
#endif
}

// The lane's elements i0 + k with k < count (all kQPerLane of a whole block: one vector
// access); the others read as zero.
template <bool kWhole, typename T>
__device__ __forceinline__ Vec<T, kQPerLane> load_lane(const T* base, int64_t i0, int count) {
  if constexpr (kWhole) {
    return load<kQPerLane>(base, i0);
  } else {
    Vec<T, kQPerLane> x{};
#pragma unroll
    for (int k = 0; k < kQPerLane; ++k) {
      if (k < count) {
        x.v[k] = base[i0 + k];
      }
    }
    return x;
  }
}

template <bool kWhole, typename T>
__device__ __forceinline__ void store_lane(T* base, int64_t i0, const Vec<T, kQPerLane>& x,
                                           int count) {
  if constexpr (kWhole) {
    store<kQPerLane>(base, i0, x);
  } else {
#pragma unroll
    for (int k = 0; k < kQPerLane; ++k) {
      if (k < count) {
        base[i0 + k] = x.v[k];
      }
    }
  }
}

// The lane's master weights, and the optional low-precision copy rounded from them.
template <bool kWhole, typename P>
__device__ __forceinline__ void store_weights(float* master, P* params, int64_t i0,
                                              const Vec<float, kQPerLane>& w, int count) {
  store_lane<kWhole>(master, i0, w, count);
  if (params != nullptr) {
    Vec<P, kQPerLane> p;
#pragma unroll
    for (int k = 0; k < kQPerLane; ++k) {
      p.v[k] = from_float<P>(w.v[k]);
    }
    store_lane<kWhole>(params, i0, p, count);
  }
}

// Block b's codes and absmax of one moment, from each lane's code inputs `x` (signed codes:
// the new values; unsigned: their square roots) and the largest abs_bits of its new values
// (over its `count` elements): NaN and zero codes when a value is not finite, zero codes when
// all are 0. Every lane of the warp must call it.
template <bool kWhole, typename code_t>
__device__ __forceinline__ void quantize_lane(const float (&x)[kQPerLane],
                                              uint32_t lane_amax_bits, QMoment<code_t> moment,
                                              int64_t b, int64_t i0, int count, int lane) {
  constexpr bool kSigned = std::is_same<code_t, int8_t>::value;
  static_assert(kSigned || std::is_same<code_t, uint8_t>::value, "codes are int8 or uint8");
  const uint32_t amax_bits = warp_max(lane_amax_bits);
  const float amax = math::bits_float(amax_bits);
  Vec<code_t, kQPerLane> codes{};
  if (amax_bits < math::kInfBits && amax_bits != 0) {  // uniform across the warp
    if constexpr (kSigned) {
      const float pre = math::signed_code_prescale(amax);
      const float factor = math::signed_code_factor(amax * pre);
#pragma unroll
      for (int k = 0; k < kQPerLane; ++k) {
        codes.v[k] = math::signed_code(x[k] * pre, factor);
      }
    } else {
      const float factor = math::unsigned_code_factor(amax);
#pragma unroll
      for (int k = 0; k < kQPerLane; ++k) {
        codes.v[k] = math::unsigned_code(x[k], factor);
      }
    }
  }
  store_lane<kWhole>(moment.codes, i0, codes, count);
  if (lane == 0) {
    moment.absmax[b] = amax_bits >= math::kInfBits ? __int_as_float(0x7fc00000) : amax;
  }
}

// The loop of the 8-bit optimizer kernels: one warp per quantization block, the warps of the
// grid striding over the blocks; block(b, i0, count, lane, WidthTag) for each block b of this
// warp, with i0 the first of the lane's `count` elements (kQPerLane but in a partial last
// block). With kVector (every buffer is aligned for kVecWidth-element accesses; the launcher
// checks) the whole blocks take the vector path (WidthTag<kQPerLane>) and the loop holds
// nothing else; a partial last block, and every block without kVector, takes the element path
// (WidthTag<1>). Each block's path is uniform within its warp, so every lane takes part in
// the block's reductions. Launched with kThreadsPerBlock threads (a multiple of 32).
template <bool kVector, typename Block>
__device__ __forceinline__ void for_each_lane_block(int64_t n, const Block& block) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  const int64_t blocks = (n + kQBlock - 1) / kQBlock;
  const int64_t whole_blocks = kVector ? n / kQBlock : 0;
  int64_t b = blockIdx.x * warps_per_block + threadIdx.x / 32;
  for (; b < whole_blocks; b += warp_stride) {
    block(b, b * kQBlock + int64_t{kQPerLane} * lane, kQPerLane, lane, WidthTag<kQPerLane>{});
  }
  for (; b < blocks; b += warp_stride) {
    const int64_t i0 = b * kQBlock + int64_t{kQPerLane} * lane;
    const int64_t left = n - i0;
    const int count = left <= 0 ? 0 : (left < kQPerLane ? static_cast<int>(left) : kQPerLane);
    block(b, i0, count, lane, WidthTag<1>{});
  }
}

}  // namespace memkern::device
