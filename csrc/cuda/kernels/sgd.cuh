// memkern::sgd_step_ — one fused SGD step (momentum, dampening, weight decay, Nesterov) over
// flat buffers, with float32 master weights and optional low-precision params written back in
// the same pass. Contract and reference: memkern/ops/sgd.py. The step counter is advanced
// afterwards by advance_step_kernel.
//
// The math is csrc/math/sgd.h, the functions the CPU kernels run (bit for bit the same
// results).
#pragma once

#include "../../math/sgd.h"
#include "common.cuh"

namespace memkern::device {

// torch initialises the momentum buffer from the first step's update, the one from *step == 0.
__device__ __forceinline__ bool is_first_step(const float* step) { return *step == 0.0f; }

// `momentum_buffer` is used only with c.use_momentum; `params` may be null. G and P are the
// dtypes of grads and params.
template <typename G, typename P>
__global__ void sgd_step_kernel(float* master, float* momentum_buffer, const G* grads,
                                P* params, int64_t n, bool vectorised, const float* step,
                                const float* grad_multiplier, const float* found_inf,
                                math::SgdCoefficients c) {
  if (step_skipped(found_inf)) {
    return;
  }
  const float multiplier = grad_multiplier_value(grad_multiplier);
  const bool first_step = is_first_step(step);

  for_each_chunk(n, vectorised, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    Vec<float, W> w = load<W>(master, i);
    const Vec<G, W> g_in = load<W>(grads, i);
    Vec<float, W> buf{};
    if (c.use_momentum) {
      buf = load<W>(momentum_buffer, i);
    }
#pragma unroll
    for (int k = 0; k < W; ++k) {
      w.v[k] = math::sgd_element(w.v[k], buf.v[k], __fmul_rn(to_float(g_in.v[k]), multiplier),
                                 first_step, c);
    }
    store<W>(master, i, w);
    if (c.use_momentum) {
      store<W>(momentum_buffer, i, buf);
    }
    store_rounded<W>(params, i, w);
  });
}

}  // namespace memkern::device
