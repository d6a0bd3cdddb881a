// memkern::unscale_ — grads[i] = round(float(grads[i]) * inv_scale) in place, raising
// found_inf when any input element is inf or NaN. Contract: memkern/ops/unscale.py.
#pragma once

#include "common.cuh"

namespace memkern::device {

template <typename T>
__global__ void unscale_kernel(T* grads, int64_t n, bool vectorised, float* found_inf,
                               const float* inv_scale) {
  const float scale = *inv_scale;
  bool saw_non_finite = false;
  for_each_chunk(n, vectorised, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    Vec<T, W> chunk = load<W>(grads, i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float g = to_float(chunk.v[k]);
      saw_non_finite |= !isfinite(g);
      chunk.v[k] = from_float<T>(g * scale);
    }
    store<W>(grads, i, chunk);
  });
  // Every writer writes the same value, so the race is benign; the flag is never cleared
  // here, so one flag can gather several buffers.
  if (saw_non_finite) {
    *found_inf = 1.0f;
  }
}

}  // namespace memkern::device
