// Building blocks shared by the flat-buffer kernels: dtype <-> float conversion, aligned
// vector loads, the grid-stride loop with a scalar tail, the optimizer steps' skip test.
//
// Torch-free on purpose: CI compiles this with plain nvcc and no torch. Several translation
// units include it (the launchers csrc/cuda/*.cu), so it defines templates and inline device
// functions only: a plain kernel defined here would be defined once per launcher file.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace memkern::device {

constexpr int kThreadsPerBlock = 256;
// Elements per thread per iteration on the vectorised path: 16-byte accesses for every dtype
// (one for bfloat16/float16, two for float32), so that a 16-bit buffer does not cut a trip's
// bytes in flight in half (with 4, the AdamW step's grads and params moved 8 bytes per access).
constexpr int kVecWidth = 8;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Round-to-nearest-even, as torch's .to(dtype): the _rn intrinsics.
template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    static_assert(std::is_same_v<T, __half>, "memkern kernels support float, bfloat16, float16");
    return __float2half_rn(x);
  }
}

// `Width` consecutive elements, aligned so that one load/store instruction moves them all.
template <typename T, int Width>
struct alignas(sizeof(T) * Width) Vec {
  T v[Width];
};

template <int Width, typename T>
__device__ __forceinline__ Vec<T, Width> load(const T* base, int64_t i) {
  return *reinterpret_cast<const Vec<T, Width>*>(base + i);
}

template <int Width, typename T>
__device__ __forceinline__ void store(T* base, int64_t i, const Vec<T, Width>& x) {
  *reinterpret_cast<Vec<T, Width>*>(base + i) = x;
}

// Writes the optional low-precision parameter copy (null: none), rounded from the float32
// weights w: what both optimizer kernels do last.
template <int Width, typename P>
__device__ __forceinline__ void store_rounded(P* params, int64_t i, const Vec<float, Width>& w) {
  if (params == nullptr) {
    return;
  }
  Vec<P, Width> p;
#pragma unroll
  for (int k = 0; k < Width; ++k) {
    p.v[k] = from_float<P>(w.v[k]);
  }
  store<Width>(params, i, p);
}

template <int Width>
using WidthTag = std::integral_constant<int, Width>;

// Calls chunk(i, WidthTag<W>{}) over [0, n) with a grid-stride loop: chunk processes the W
// elements starting at i. With `vectorised` (every buffer the kernel touches is aligned to
// kVecWidth elements; the launcher checks) the body runs W = kVecWidth and the n % kVecWidth
// tail runs W = 1; otherwise everything runs W = 1.
template <typename Chunk>
__device__ __forceinline__ void for_each_chunk(int64_t n, bool vectorised, Chunk&& chunk) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail_start = 0;
  if (vectorised) {
    const int64_t vec_count = n / kVecWidth;
    for (int64_t c = first; c < vec_count; c += stride) {
      chunk(c * kVecWidth, WidthTag<kVecWidth>{});
    }
    tail_start = vec_count * kVecWidth;
  }
  for (int64_t i = tail_start + first; i < n; i += stride) {
    chunk(i, WidthTag<1>{});
  }
}

// True when the step must be skipped: found_inf is given and non-zero (NaN counts as set, as
// `found_inf != 0` does in the reference).
__device__ __forceinline__ bool step_skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// The gradient multiplier of a step: *grad_multiplier, 1 when none is given.
__device__ __forceinline__ float grad_multiplier_value(const float* grad_multiplier) {
  return grad_multiplier != nullptr ? *grad_multiplier : 1.0f;
}

}  // namespace memkern::device
