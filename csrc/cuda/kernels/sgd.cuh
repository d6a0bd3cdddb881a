// memkern::sgd_step_ — one fused SGD step (momentum, dampening, weight decay, Nesterov) over
// flat buffers, with float32 master weights and optional low-precision params written back in
// the same pass. Contract and reference: memkern/ops/sgd.py. The step counter is advanced
// afterwards by advance_step_kernel.
//
// Each operation is rounded to float32 where the reference's separate torch ops round:
// products that feed an addition use __fmul_rn, which nvcc never contracts into an FMA.
#pragma once

#include "common.cuh"

namespace memkern::device {

// Hyper-parameters rounded to float32 on the host, as the reference rounds a Python float
// against a float32 tensor. The use_* flags are decided on the unrounded values, and a term
// that is off is skipped entirely, as in the reference (adding 0 * inf would turn an inf
// master into NaN).
struct SGDConstants {
  float lr;
  float momentum;
  float one_minus_dampening;
  float weight_decay;
  bool use_momentum;
  bool use_weight_decay;
  bool nesterov;
};

// torch initialises the momentum buffer from the first step's update, the one from *step == 0.
__device__ __forceinline__ bool is_first_step(const float* step) { return *step == 0.0f; }

// torch.optim.SGD's update of one element from g (the multiplied gradient): the momentum
// buffer `buf` in place (untouched without momentum), returns the new master weight.
// Shared with sgd8bit.cuh.
__device__ __forceinline__ float sgd_element(float w, float& buf, float g, bool first_step,
                                             const SGDConstants& c) {
  float d = g;
  if (c.use_weight_decay) {
    d = d + __fmul_rn(c.weight_decay, w);
  }
  if (c.use_momentum) {
    buf = first_step ? d : __fmul_rn(c.momentum, buf) + __fmul_rn(c.one_minus_dampening, d);
    d = c.nesterov ? d + __fmul_rn(c.momentum, buf) : buf;
  }
  return w - __fmul_rn(c.lr, d);
}

// `momentum_buffer` is used only with c.use_momentum; `params` may be null. G and P are the
// dtypes of grads and params.
template <typename G, typename P>
__global__ void sgd_step_kernel(float* master, float* momentum_buffer, const G* grads,
                                P* params, int64_t n, bool vectorised, const float* step,
                                const float* grad_multiplier, const float* found_inf,
                                SGDConstants c) {
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
      w.v[k] = sgd_element(w.v[k], buf.v[k], __fmul_rn(to_float(g_in.v[k]), multiplier),
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
