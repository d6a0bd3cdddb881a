// Building blocks of the layer-op kernels (dropout, SwiGLU, norms): the math type of an element
// type with its conversions, and a deterministic block-wide sum.
//
// Torch-free, like every header here: CI compiles the kernels with plain nvcc.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace memkern::device {

// The math type of the layer kernels: float for float32 and 16-bit elements (rounded once on
// the way out), double for float64 — as the C++ CPU kernels compute (acc_type in
// csrc/cpu/flat_math.h).
template <typename T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
__device__ __forceinline__ compute_t<T> to_compute(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return to_float(x);
  }
}

template <typename T>
__device__ __forceinline__ T from_compute(compute_t<T> x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return from_float<T>(x);
  }
}

constexpr int kWarpSize = 32;
constexpr int kMaxWarpsPerBlock = 32;

// The sums over the block of each thread's N values, returned to every thread. Deterministic:
// a fixed tree within each warp, then the warps' sums added in warp order. blockDim.x must be
// a multiple of kWarpSize; `scratch` holds N * kMaxWarpsPerBlock values of shared memory. Every
// thread of the block must call it (it synchronises the block), and may call it again at once.
template <int N, typename acc_t>
__device__ __forceinline__ void block_sum(acc_t (&v)[N], acc_t* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int k = 0; k < N; ++k) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
    }
  }
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) scratch[k * kMaxWarpsPerBlock + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    acc_t total = 0;
    for (int w = 0; w < warps; ++w) total += scratch[k * kMaxWarpsPerBlock + w];
    v[k] = total;
  }
}

}  // namespace memkern::device
