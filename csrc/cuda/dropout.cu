// The launcher of memkern::dropout's CUDA kernel (layer_ops.h).
#include <cstdint>

#include "kernels/dropout.cuh"
#include "launch.cuh"
#include "layer_ops.h"

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
