// memkern::dropout on CUDA, torch-free: the kernel — y[i] = x[i] * scale where element i's
// Philox word is >= threshold, else 0 — and its launcher (dropout_launch.h). Contract:
// memkern/ops/dropout.py; the mask math (kernels/dropout_math.h) is the CPU kernel's.
#include <cstdint>

#include "dropout_launch.h"
#include "kernels/dropout_math.h"
#include "kernels/layer_common.cuh"
#include "launch.cuh"

namespace memkern::device {

// One thread per Philox counter c (grid-stride): its four words mask elements c, c + n4,
// c + 2 n4 and c + 3 n4 (n4 = ceil(n / 4)), so consecutive threads touch consecutive elements.
// The seed is read here, from device memory: the host never waits for it.
template <typename T>
__global__ void dropout_kernel(const T* x, T* y, int64_t n, const int64_t* seed,
                               uint64_t threshold, compute_t<T> scale) {
  const math::PhiloxKey key = math::philox_key(*seed);
  const int64_t n4 = math::dropout_counters(n);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < n4;
       c += stride) {
    uint32_t words[4];
    math::philox4x32(static_cast<uint64_t>(c), key.k0, key.k1, words);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int64_t i = c + w * n4;
      if (i < n) {
        y[i] = from_compute<T>(math::dropout_element(words[w], threshold, to_compute(x[i]), scale));
      }
    }
  }
}

}  // namespace memkern::device

namespace memkern::layer_ops {

namespace {
constexpr int kThreads = 256;
// Resident blocks per multiprocessor the grid is capped at (a full H100 SM holds 8 of 256).
constexpr int kBlocksPerSm = 8;
}  // namespace

cudaError_t dropout(const void* x, void* y, DType dtype, int64_t n, const int64_t* seed,
                    double p, cudaStream_t stream) {
  if (!(p >= 0.0 && p <= 1.0)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) {
    return cudaSuccess;
  }
  const int64_t counters = math::dropout_counters(n);
  int grid = 0;
  if (const cudaError_t err =
          launch::capped_grid((counters + kThreads - 1) / kThreads, kBlocksPerSm, &grid);
      err != cudaSuccess) {
    return err;
  }
  const uint64_t threshold = math::dropout_threshold(p);
  const double scale = math::dropout_scale(p);
  return launch::with_dtype<true>(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    device::dropout_kernel<T><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(y), n, seed, threshold,
        static_cast<device::compute_t<T>>(scale));
    return cudaGetLastError();
  });
}

}  // namespace memkern::layer_ops
