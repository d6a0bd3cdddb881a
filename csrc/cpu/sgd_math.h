// The SGD math of the CPU backend, shared by memkern::sgd_step_ (sgd.cpp) and
// memkern::sgd8bit_step_ (sgd8bit.cpp): csrc/math/sgd.h (the same functions the CUDA kernels
// run), and the step's coefficients from the op's arguments. Contract: memkern/ops/sgd.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "../math/sgd.h"
#include "flat_math.h"

namespace memkern::cpu {

// A step's coefficients: the element math's, the gradient multiplier, and whether this is
// the first step (the counter value `step_before` is 0).
struct SgdStep {
  math::SgdCoefficients c;
  float grad_multiplier;
  bool first_step;
};

inline SgdStep sgd_step_coefficients(float step_before,
                                     const std::optional<at::Tensor>& grad_multiplier, double lr,
                                     double momentum, double dampening, double weight_decay,
                                     bool nesterov) {
  return SgdStep{math::sgd_coefficients(lr, momentum, dampening, weight_decay, nesterov),
                 grad_multiplier.has_value() ? read_scalar(*grad_multiplier) : 1.0f,
                 step_before == 0.0f};
}

// One element from its raw gradient (math::sgd_element after the multiplier, as the CUDA
// kernels do).
inline float sgd_element(float master, float& buf, float grad, const SgdStep& s) {
  return math::sgd_element(master, buf, math::mul_rn(grad, s.grad_multiplier), s.first_step,
                           s.c);
}

}  // namespace memkern::cpu
