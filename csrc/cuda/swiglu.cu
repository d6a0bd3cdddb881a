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

template <typename T>
bool aligned(const void* buffer) {
  return launch::vector_aligned<T>(buffer, kVecWidth);
}

// Calls enqueue(TypeTag<T>{}, grid) for dtype's element type T with the grid of n elements at
// kVecWidth per thread, capped (the kernels stride over the rest); nothing for n == 0.
template <typename Launch>
cudaError_t launch_elementwise(DType dtype, int64_t n, Launch&& enqueue) {
  if (n == 0) {
    return cudaSuccess;
  }
  constexpr int64_t kPerBlock = int64_t{kThreadsPerBlock} * kVecWidth;
  int grid = 0;
  if (const cudaError_t err =
          launch::capped_grid((n + kPerBlock - 1) / kPerBlock, kBlocksPerSm, &grid);
      err != cudaSuccess) {
    return err;
  }
  return launch::with_dtype<true>(dtype, [&](auto tag) {
    enqueue(tag, grid);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t swiglu_forward(const void* gate, const void* up, void* h, DType dtype, int64_t n,
                           cudaStream_t stream) {
  return launch_elementwise(dtype, n, [&](auto tag, int grid) {
    using T = typename decltype(tag)::type;
    const bool vectorised = aligned<T>(gate) && aligned<T>(up) && aligned<T>(h);
    device::swiglu_forward_kernel<T><<<grid, kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(h), n,
        vectorised);
  });
}

cudaError_t swiglu_backward(const void* grad, const void* gate, const void* up, void* grad_gate,
                            void* grad_up, DType dtype, int64_t n, cudaStream_t stream) {
  return launch_elementwise(dtype, n, [&](auto tag, int grid) {
    using T = typename decltype(tag)::type;
    const bool vectorised = aligned<T>(grad) && aligned<T>(gate) && aligned<T>(up) &&
                            aligned<T>(grad_gate) && aligned<T>(grad_up);
    device::swiglu_backward_kernel<T><<<grid, kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(gate), static_cast<const T*>(up),
        static_cast<T*>(grad_gate), static_cast<T*>(grad_up), n, vectorised);
  });
}

}  // namespace memkern::layer_ops
