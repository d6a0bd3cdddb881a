// MEMKERN_HOST_DEVICE marks the per-element and per-row math that both the C++ CPU kernels
// (csrc/cpu, compiled by the host compiler) and the CUDA kernels (compiled by nvcc) include,
// so that the CPU test suite runs the very math a GPU runs. Headers using it include no CUDA
// or torch header: plain C++ on both sides. Below, the math functions that math uses, each the
// device's own function in device code and <cmath>'s on the host.
#pragma once

#include <cmath>
#include <type_traits>

#if defined(__CUDACC__)
#define MEMKERN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEMKERN_HOST_DEVICE inline
#endif

namespace memkern::math {

// exp(x) and sqrt(x) for float (the float functions on the device, not the double ones) and
// double.
template <typename T>
MEMKERN_HOST_DEVICE T exp_of(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) return ::expf(x); else return ::exp(x);
#else
  return std::exp(x);
#endif
}

template <typename T>
MEMKERN_HOST_DEVICE T sqrt_of(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) return ::sqrtf(x); else return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

}  // namespace memkern::math
