// memkern::l2_norm — sqrt(sum(float(grads[i])^2)) accumulated in float32. Contract:
// memkern/ops/l2_norm.py.
//
// Deterministic two-pass reduction: l2_norm_partials_kernel writes one sum of squares per
// block into a workspace, then l2_norm_finalize_kernel (one block) sums them in a fixed order.
// No atomics, so the same buffer at the same address gives the same bits on every run.
// NaN and inf propagate through the sums and the sqrt as in torch.linalg.vector_norm.
#pragma once

#include "common.cuh"

namespace memkern::device {

// Upper bound on the partials of the first pass (= its grid size). A constant rather than a
// function of the SM count, so the reduction order, and thus the result, does not depend on
// which GPU runs it. 1024 blocks of 256 threads are about one full wave on an H100
// (132 SMs x 8 resident blocks).
constexpr int kL2NormMaxPartials = 1024;

// Sum of `value` over the block; the result is valid in thread 0. Uses fixed shuffle and
// shared-memory orders, so it is deterministic.
__device__ __forceinline__ float block_sum(float value) {
  static_assert(kThreadsPerBlock % 32 == 0 && kThreadsPerBlock <= 1024,
                "block_sum needs whole warps and at most 32 of them");
  constexpr int kWarps = kThreadsPerBlock / 32;
  __shared__ float warp_sums[kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  if (lane == 0) {
    warp_sums[warp] = value;
  }
  __syncthreads();
  if (warp == 0) {
    value = lane < kWarps ? warp_sums[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      value += __shfl_down_sync(0xffffffffu, value, offset);
    }
  }
  return value;
}

// Launched with exactly kThreadsPerBlock threads and gridDim.x partials.
template <typename T>
__global__ void l2_norm_partials_kernel(const T* grads, int64_t n, bool vectorised,
                                        float* partials) {
  float sum_of_squares = 0.0f;
  for_each_chunk(n, vectorised, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    const Vec<T, W> chunk = load<W>(grads, i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float g = to_float(chunk.v[k]);
      sum_of_squares = fmaf(g, g, sum_of_squares);
    }
  });
  const float block_total = block_sum(sum_of_squares);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = block_total;
  }
}

// Launched as one block of kThreadsPerBlock threads.
__global__ void l2_norm_finalize_kernel(const float* partials, int partial_count, float* norm) {
  float sum_of_squares = 0.0f;
  for (int i = threadIdx.x; i < partial_count; i += blockDim.x) {
    sum_of_squares += partials[i];
  }
  const float total = block_sum(sum_of_squares);
  if (threadIdx.x == 0) {
    *norm = sqrtf(total);
  }
}

}  // namespace memkern::device
