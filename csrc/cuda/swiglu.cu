// memkern::swiglu_forward / swiglu_backward on CUDA, torch-free: the kernels — h = silu(gate) *
// up and its gradient, one pass over the elements in float32 (float64 for float64), rounded
// once — and their launchers (swiglu_launch.h). Contract: memkern/ops/swiglu.py; the
// per-element math (kernels/swiglu_math.h) is the CPU kernels'.
#include <cstdint>

#include "kernels/layer_common.cuh"
#include "kernels/swiglu_math.h"
#include "launch.cuh"
#include "swiglu_launch.h"

namespace memkern::device {

template <typename T>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* h, int64_t n,
                                      bool vectorised) {
  for_each_chunk(n, vectorised, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    const Vec<T, W> a = load<W>(gate, i), b = load<W>(up, i);
    Vec<T, W> out;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      out.v[k] = from_compute<T>(math::swiglu(to_compute(a.v[k]), to_compute(b.v[k])));
    }
    store<W>(h, i, out);
  });
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* grad, const T* gate, const T* up, T* grad_gate,
                                       T* grad_up, int64_t n, bool vectorised) {
  for_each_chunk(n, vectorised, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    const Vec<T, W> g = load<W>(grad, i), a = load<W>(gate, i), b = load<W>(up, i);
    Vec<T, W> da, db;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const math::SwigluGrad<compute_t<T>> d =
          math::swiglu_grad(to_compute(g.v[k]), to_compute(a.v[k]), to_compute(b.v[k]));
      da.v[k] = from_compute<T>(d.gate);
      db.v[k] = from_compute<T>(d.up);
    }
    store<W>(grad_gate, i, da);
    store<W>(grad_up, i, db);
  });
}

}  // namespace memkern::device

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
