// memkern::adamw_step_ — one fused AdamW step over flat buffers, with float32 master weights
// and optional low-precision params written back in the same pass. Contract and reference:
// memkern/ops/adamw.py. The step counter is advanced afterwards by advance_step_kernel.
//
// Each operation is rounded to float32 where the reference's separate torch ops round:
// products that feed an addition use __fmul_rn, which nvcc never contracts into an FMA.
#pragma once

#include "common.cuh"

namespace memkern::device {

// Hyper-parameters, rounded to float32 on the host where the reference rounds a Python
// float to the float32 tensor's dtype. lr and the betas stay double: the bias corrections
// depend on the step counter, which only the device knows, and the reference computes them
// in float64.
struct AdamWConstants {
  double lr;
  double beta1;
  double beta2;
  float weight_decay_factor;  // 1 - lr * weight_decay
  float exp_avg_weight;       // 1 - beta1, the lerp weight
  float beta2_f32;
  float one_minus_beta2;
  float eps;
};

// torch.lerp(start, end, weight) as torch computes it for float32: one FMA from whichever end
// is nearer, which keeps it exact at weight 0 and 1.
__device__ __forceinline__ float lerp(float start, float end, float weight) {
  return fabsf(weight) < 0.5f ? __fmaf_rn(weight, end - start, start)
                              : __fmaf_rn(weight - 1.0f, end - start, end);
}

// The per-step scalars that depend on the step counter, which only the device knows.
struct AdamWStepScalars {
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};

// Computes the step's scalars into shared memory once per block (float64 pow per thread would
// cost real time on GPUs with slow float64); every thread of the block must call it.
__device__ __forceinline__ void adamw_step_scalars(const float* step, const AdamWConstants& c,
                                                   AdamWStepScalars* shared) {
  if (threadIdx.x == 0) {
    const double t = static_cast<double>(*step) + 1.0;
    shared->step_size = static_cast<float>(c.lr / (1.0 - pow(c.beta1, t)));
    shared->bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(c.beta2, t)));
  }
  __syncthreads();
}

// torch.optim.AdamW's update of one element (g already multiplied): m and v in place,
// returns the new master weight.
__device__ __forceinline__ float adamw_element(float w, float& m, float& v, float g,
                                               const AdamWStepScalars& s,
                                               const AdamWConstants& c) {
  m = lerp(m, g, c.exp_avg_weight);
  v = __fmul_rn(v, c.beta2_f32) + __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g);
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + c.eps;
  return __fmul_rn(w, c.weight_decay_factor) - __fmul_rn(s.step_size, m) / denom;
}

// `params` may be null (the master is the model weight); G and P are the dtypes of grads and
// params. Launched with kThreadsPerBlock threads.
template <typename G, typename P>
__global__ void adamw_step_kernel(float* master, float* exp_avg, float* exp_avg_sq,
                                  const G* grads, P* params, int64_t n, bool vectorised,
                                  const float* step, const float* grad_multiplier,
                                  const float* found_inf, AdamWConstants c) {
  // Uniform across the grid, so whole blocks leave before the barrier below.
  if (step_skipped(found_inf)) {
    return;
  }
  __shared__ AdamWStepScalars s;
  adamw_step_scalars(step, c, &s);
  const float multiplier = grad_multiplier_value(grad_multiplier);

  for_each_chunk(n, vectorised, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    Vec<float, W> w = load<W>(master, i);
    Vec<float, W> m = load<W>(exp_avg, i);
    Vec<float, W> v = load<W>(exp_avg_sq, i);
    const Vec<G, W> g_in = load<W>(grads, i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float g = __fmul_rn(to_float(g_in.v[k]), multiplier);
      w.v[k] = adamw_element(w.v[k], m.v[k], v.v[k], g, s, c);
    }
    store<W>(master, i, w);
    store<W>(exp_avg, i, m);
    store<W>(exp_avg_sq, i, v);
    store_rounded<W>(params, i, w);
  });
}

}  // namespace memkern::device
