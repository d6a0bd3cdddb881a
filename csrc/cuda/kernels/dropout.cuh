// memkern::dropout — y[i] = x[i] * scale where element i's Philox word is >= threshold, else 0.
// Contract: memkern/ops/dropout.py; the mask math (dropout_math.h) is the CPU kernel's.
#pragma once

#include "dropout_math.h"
#include "layer_common.cuh"

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
