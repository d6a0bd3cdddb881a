// The AdamW math of the CPU backend, shared by memkern::adamw_step_ (adamw.cpp) and
// memkern::adamw8bit_step_ (adamw8bit.cpp): the per-step coefficients and the update of one
// element. Contract: memkern/ops/adamw.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <optional>

#include "flat_math.h"

namespace memkern::cpu {

// Per-step constants, computed once in double from the step counter as torch does.
struct AdamWCoefficients {
  float grad_multiplier;
  float decay;  // 1 - lr * weight_decay
  float one_minus_beta1;  // lerp weight
  float beta1;
  bool lerp_from_end;  // torch.lerp's second form, used when the weight is >= 0.5
  float beta2;
  float one_minus_beta2;
  // torch's m * lr / (1 - beta1^t) / (sqrt(v) / sqrt(1 - beta2^t) + eps), with sqrt(1 - beta2^t)
  // moved out of the denominator: one division per element instead of two (the divider is the
  // slowest unit the loop uses) and one rounding fewer (both products are rounded once, from
  // double).
  float scaled_step_size;  // lr * sqrt(1 - beta2^t) / (1 - beta1^t)
  float scaled_eps;  // eps * sqrt(1 - beta2^t)
};

// The coefficients of the step that makes the counter `t` (= step + 1).
inline AdamWCoefficients adamw_coefficients(double t,
                                            const std::optional<at::Tensor>& grad_multiplier,
                                            double lr, double beta1, double beta2, double eps,
                                            double weight_decay) {
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(beta2, t));
  return AdamWCoefficients{
      grad_multiplier.has_value() ? read_scalar(*grad_multiplier) : 1.0f,
      static_cast<float>(1.0 - lr * weight_decay),
      static_cast<float>(1.0 - beta1),
      static_cast<float>(beta1),
      1.0 - beta1 >= 0.5,
      static_cast<float>(beta2),
      static_cast<float>(1.0 - beta2),
      static_cast<float>(lr * bias_correction2_sqrt / (1.0 - std::pow(beta1, t))),
      static_cast<float>(eps * bias_correction2_sqrt)};
}

// torch.optim.AdamW's update of one element's moments in float32, in place: m and v are torch's
// to the bit.
inline void adamw_moments(float& m, float& v, float grad, const AdamWCoefficients& c) {
  const float g = grad * c.grad_multiplier;
  // torch.lerp(exp_avg, g, 1 - beta1), both of its forms (they differ for inf gradients).
  m = c.lerp_from_end ? g - (g - m) * c.beta1 : m + c.one_minus_beta1 * (g - m);
  v = v * c.beta2 + c.one_minus_beta2 * g * g;
}

// The new master weight from the updated m and sqrt(v); it can differ from torch's in the last
// place (the update is rounded differently, see scaled_step_size).
inline float adamw_master(float master, float m, float sqrt_v, const AdamWCoefficients& c) {
  return master * c.decay - c.scaled_step_size * m / (sqrt_v + c.scaled_eps);
}

// torch.optim.AdamW's update of one element in float32: m and v in place, returns the new
// master weight.
inline float adamw_element(float master, float& m, float& v, float grad,
                           const AdamWCoefficients& c) {
  adamw_moments(m, v, grad, c);
  return adamw_master(master, m, std::sqrt(v), c);
}

}  // namespace memkern::cpu
