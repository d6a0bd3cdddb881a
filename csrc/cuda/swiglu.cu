// The launchers of memkern::swiglu_forward / swiglu_backward's CUDA kernels (layer_ops.h).
#include <cstdint>

#include "kernels/swiglu.cuh"
#include "launch.cuh"
#include "layer_ops.h"

namespace memkern::layer_ops {

namespace {

using device::kThreadsPerBlock;
using device::kVecWidth;
constexpr int kBlocksPerSm = 8;

// The grid of n elements at kVecWidth per thread, capped (the kernels stride over the rest).
cudaError_t elementwise_grid(int64_t n, int* grid) {
  constexpr int64_t kPerBlock = int64_t{kThreadsPerBlock} * kVecWidth;
  return launch::capped_grid((n + kPerBlock - 1) / kPerBlock, kBlocksPerSm, grid);
}

template <typename T>
bool aligned(const void* buffer) {
  return launch::vector_aligned<T>(buffer, kVecWidth);
}

}  // namespace

cudaError_t swiglu_forward(const void* gate, const void* up, void* h, DType dtype, int64_t n,
                           cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  int grid = 0;
  if (const cudaError_t err = elementwise_grid(n, &grid); err != cudaSuccess) {
    return err;
  }
  return launch::with_dtype<true>(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vectorised = aligned<T>(gate) && aligned<T>(up) && aligned<T>(h);
    device::swiglu_forward_kernel<T><<<grid, kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(h), n,
        vectorised);
    return cudaGetLastError();
  });
}

cudaError_t swiglu_backward(const void* grad, const void* gate, const void* up, void* grad_gate,
                            void* grad_up, DType dtype, int64_t n, cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  int grid = 0;
  if (const cudaError_t err = elementwise_grid(n, &grid); err != cudaSuccess) {
    return err;
  }
  return launch::with_dtype<true>(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vectorised = aligned<T>(grad) && aligned<T>(gate) && aligned<T>(up) &&
                            aligned<T>(grad_gate) && aligned<T>(grad_up);
    device::swiglu_backward_kernel<T><<<grid, kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(gate), static_cast<const T*>(up),
        static_cast<T*>(grad_gate), static_cast<T*>(grad_up), n, vectorised);
    return cudaGetLastError();
  });
}

}  // namespace memkern::layer_ops
