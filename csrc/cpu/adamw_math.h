// The AdamW math of the CPU backend, shared by memkern::adamw_step_ (adamw.cpp) and
// memkern::adamw8bit_step_ (adamw8bit.cpp): csrc/math/adamw.h (the same functions the CUDA
// kernels run), and the step's coefficients from the op's arguments. Contract:
// memkern/ops/adamw.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "../math/adamw.h"
#include "flat_math.h"

namespace memkern::cpu {

using math::AdamWCoefficients;
using math::adamw_element;
using math::adamw_master;
using math::adamw_moments;

// The coefficients of the step that makes the counter `t` (= step + 1).
inline AdamWCoefficients adamw_coefficients(double t,
                                            const std::optional<at::Tensor>& grad_multiplier,
                                            double lr, double beta1, double beta2, double eps,
                                            double weight_decay) {
  const math::AdamWHyper h{lr, beta1, beta2, eps, weight_decay};
  AdamWCoefficients c = math::adamw_coefficients(
      h, grad_multiplier.has_value() ? read_scalar(*grad_multiplier) : 1.0f);
  math::adamw_set_step(c, h, t);
  return c;
}

}  // namespace memkern::cpu
