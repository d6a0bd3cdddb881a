// memkern::adamw_step_ — one fused AdamW step over flat buffers, with float32 master weights
// and optional low-precision params written back in the same pass. Contract and reference:
// memkern/ops/adamw.py. The step counter is advanced afterwards by advance_step_kernel.
//
// The math is csrc/math/adamw.h, the functions the CPU kernels run (bit for bit the same
// results). One trip of the loop moves kVecWidth elements of every buffer with 16-byte
// accesses; no value of a trip depends on another trip's, so the loads of all buffers are in
// flight together.
#pragma once

#include "../../math/adamw.h"
#include "common.cuh"

namespace memkern::device {

// The kernels' argument: the hyper-parameters (the step's factors are computed from them on
// the device, where the step counter lives) and the coefficients the host rounded from them
// (math::adamw_coefficients, grad_multiplier 1).
struct AdamWConstants {
  math::AdamWHyper hyper;
  math::AdamWCoefficients coefficients;
};

// The coefficients of this step with the given gradient multiplier. Thread 0 computes the
// step's factors once per block, into shared memory (float64 pow per thread would cost real
// time on GPUs with slow float64); every thread of the block must call it.
__device__ __forceinline__ math::AdamWCoefficients adamw_block_coefficients(
    const float* step, float grad_multiplier, const AdamWConstants& constants) {
  __shared__ math::AdamWCoefficients shared;
  if (threadIdx.x == 0) {
    math::AdamWCoefficients c = constants.coefficients;
    math::adamw_set_step(c, constants.hyper, static_cast<double>(*step) + 1.0);
    c.grad_multiplier = grad_multiplier;
    shared = c;
  }
  __syncthreads();
  return shared;
}

// `params` may be null (the master is the model weight); G and P are the dtypes of grads and
// params. Launched with kThreadsPerBlock threads.
template <typename G, typename P>
__global__ void __launch_bounds__(kThreadsPerBlock)
    adamw_step_kernel(float* __restrict__ master, float* __restrict__ exp_avg,
                      float* __restrict__ exp_avg_sq, const G* __restrict__ grads,
                      P* __restrict__ params, int64_t n, bool vectorised, const float* step,
                      const float* grad_multiplier, const float* found_inf,
                      AdamWConstants constants) {
  // Uniform across the grid, so whole blocks leave before the barrier below.
  if (step_skipped(found_inf)) {
    return;
  }
  const math::AdamWCoefficients c =
      adamw_block_coefficients(step, grad_multiplier_value(grad_multiplier), constants);

  for_each_chunk(n, vectorised, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    Vec<float, W> w = load<W>(master, i);
    Vec<float, W> m = load<W>(exp_avg, i);
    Vec<float, W> v = load<W>(exp_avg_sq, i);
    const Vec<G, W> g = load<W>(grads, i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      w.v[k] = math::adamw_element(w.v[k], m.v[k], v.v[k], to_float(g.v[k]), c);
    }
    store<W>(master, i, w);
    store<W>(exp_avg, i, m);
    store<W>(exp_avg_sq, i, v);
    store_rounded<W>(params, i, w);
  });
}

}  // namespace memkern::device
