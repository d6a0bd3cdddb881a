// Host-side helpers of the launchers (flat_ops.cu and the layer-op launchers): the element
// type of a DType, alignment checks for vector accesses, grid sizes. Torch-free, nvcc only.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "dtype.h"

namespace memkern::launch {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) with the element type that `dtype` names. float64 only where the
// kernels are instantiated for it (kWithFloat64); cudaErrorInvalidValue otherwise.
template <bool kWithFloat64 = false, typename Fn>
cudaError_t with_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32:
      return fn(TypeTag<float>{});
    case DType::bf16:
      return fn(TypeTag<__nv_bfloat16>{});
    case DType::f16:
      return fn(TypeTag<__half>{});
    case DType::f64:
      if constexpr (kWithFloat64) {
        return fn(TypeTag<double>{});
      } else {
        return cudaErrorInvalidValue;
      }
  }
  return cudaErrorInvalidValue;
}

// Whether `buffer` (a T array) allows `width`-element vector accesses; null passes.
template <typename T>
bool vector_aligned(const void* buffer, int width) {
  return reinterpret_cast<std::uintptr_t>(buffer) % (sizeof(T) * width) == 0;
}

// The multiprocessor count of the current device: two cheap runtime queries (the runtime
// caches device attributes), no occupancy calculation, as the layer ops are launched on every
// layer call and their host time counts.
inline cudaError_t sm_count(int* count) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err != cudaSuccess
             ? err
             : cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}

// A grid of `wanted` blocks (at least 1), capped at `per_sm` blocks per multiprocessor: the
// kernels' grid-stride loops cover the rest.
inline cudaError_t capped_grid(int64_t wanted, int per_sm, int* grid) {
  int sms = 0;
  if (const cudaError_t err = sm_count(&sms); err != cudaSuccess) {
    return err;
  }
  *grid = static_cast<int>(std::clamp<int64_t>(wanted, 1, int64_t{sms} * per_sm));
  return cudaSuccess;
}

}  // namespace memkern::launch
