// The AdamW math of one element, shared by the CPU kernels (csrc/cpu/adamw.cpp,
// adamw8bit.cpp, through adamw_math.h) and the CUDA kernels (csrc/cuda/kernels/adamw.cuh,
// adamw8bit.cuh): the same bits on both (host_device.h says how), so the CPU tests check what
// the GPU computes. Contract and float64 reference: memkern/ops/adamw.py.
//
// torch.optim.AdamW, with t = step + 1:
//   m = lerp(m, g, 1 - beta1);  v = v beta2 + (1 - beta2) g^2
//   master = master (1 - lr wd) - lr / (1 - beta1^t) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// computed with sqrt(1 - beta2^t) moved out of the denominator: one division per element
// instead of two (on the GPU each correctly rounded division is ~10 instructions with a
// range check; on the CPU the divider is the slowest unit the loop uses), and the step's
// factors rounded once, from double. m and v are rounded as torch rounds them except where a
// product and a sum are one fma_rn (rounded once instead of twice); the master can differ
// from torch's in the last place. The tests hold every backend to the float64 reference.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace memkern::math {

// The optimizer's hyper-parameters, as torch.optim.AdamW takes them.
struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
};

// What the update of one element needs, in float32.
struct AdamWCoefficients {
  float grad_multiplier;  // every gradient is multiplied by it first
  float decay;            // 1 - lr * weight_decay
  // torch.lerp(m, g, w) with w = 1 - beta1 rounded to float32, as torch computes it: for
  // |w| < 0.5 fma(w, g - m, m), else fma(w - 1, g - m, g) (exact at w = 0 and 1; the two
  // forms differ for an infinite g). lerp_factor is w or w - 1; lerp_end_mask is all ones for
  // the second form, else 0 (a blend mask: see blend).
  float lerp_factor;
  uint32_t lerp_end_mask;
  float beta2;
  float one_minus_beta2;
  // The factors that depend on the step counter (adamw_set_step).
  float scaled_step_size;  // lr * sqrt(1 - beta2^t) / (1 - beta1^t)
  float scaled_eps;        // eps * sqrt(1 - beta2^t)
};

// The coefficients that do not depend on the step counter. Host code: CPU kernels and CUDA
// launchers call this same function, so both round the hyper-parameters alike.
inline AdamWCoefficients adamw_coefficients(const AdamWHyper& h, float grad_multiplier) {
  AdamWCoefficients c{};
  c.grad_multiplier = grad_multiplier;
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float w = static_cast<float>(1.0 - h.beta1);
  const bool from_end = !(std::fabs(w) < 0.5f);
  c.lerp_factor = from_end ? w - 1.0f : w;
  c.lerp_end_mask = from_end ? ~0u : 0u;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  return c;
}

// Sets the factors of the step that makes the counter t (= step + 1), computed in double as
// torch does. A CUDA kernel calls it where the counter lives, on the device (the library's
// pow and the C library's agree but for a rare last double bit, which float32 then rounds
// away).
MEMKERN_HOST_DEVICE void adamw_set_step(AdamWCoefficients& c, const AdamWHyper& h, double t) {
  const double bias_correction2_sqrt = sqrt(1.0 - pow(h.beta2, t));
  c.scaled_step_size = static_cast<float>(h.lr * bias_correction2_sqrt / (1.0 - pow(h.beta1, t)));
  c.scaled_eps = static_cast<float>(h.eps * bias_correction2_sqrt);
}

// The moments of one element, in place, from its raw gradient.
MEMKERN_HOST_DEVICE void adamw_moments(float& m, float& v, float grad,
                                       const AdamWCoefficients& c) {
  const float g = mul_rn(grad, c.grad_multiplier);
  const float g_minus_m = fma_rn(grad, c.grad_multiplier, -m);
  m = fma_rn(c.lerp_factor, g_minus_m, blend(c.lerp_end_mask, g, m));
  v = fma_rn(mul_rn(c.one_minus_beta2, g), g, mul_rn(v, c.beta2));
}

// The new master weight from the updated m and sqrt(v).
MEMKERN_HOST_DEVICE float adamw_master(float master, float m, float sqrt_v,
                                       const AdamWCoefficients& c) {
  return fma_rn(master, c.decay,
                -div_rn(mul_rn(c.scaled_step_size, m), sqrt_v + c.scaled_eps));
}

// One element: m and v in place, returns the new master weight.
MEMKERN_HOST_DEVICE float adamw_element(float master, float& m, float& v, float grad,
                                        const AdamWCoefficients& c) {
  adamw_moments(m, v, grad, c);
  return adamw_master(master, m, sqrt_rn(v), c);
}

}  // namespace memkern::math
