// memkern::swiglu_forward / swiglu_backward — h = silu(gate) * up and its gradient, one pass
// over the elements in float32 (float64 for float64), rounded once. Contract:
// memkern/ops/swiglu.py; the per-element math (swiglu_math.h) is the CPU kernels'.
#pragma once

#include "layer_common.cuh"
#include "swiglu_math.h"

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
