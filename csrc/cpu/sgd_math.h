// The SGD math of the CPU backend, shared by memkern::sgd_step_ (sgd.cpp) and
// memkern::sgd8bit_step_ (sgd8bit.cpp): the per-step coefficients and the update of one
// element. Contract: memkern/ops/sgd.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "flat_math.h"

namespace memkern::cpu {

struct SgdCoefficients {
  float grad_multiplier;
  float lr;
  float momentum;
  float one_minus_dampening;
  float weight_decay;
  bool use_momentum;
  bool first_step;  // torch initialises the momentum buffer with d on the first step
  bool nesterov;
};

// The coefficients of a step from the counter value `step_before`.
inline SgdCoefficients sgd_coefficients(float step_before,
                                        const std::optional<at::Tensor>& grad_multiplier,
                                        double lr, double momentum, double dampening,
                                        double weight_decay, bool nesterov) {
  return SgdCoefficients{grad_multiplier.has_value() ? read_scalar(*grad_multiplier) : 1.0f,
                         static_cast<float>(lr),
                         static_cast<float>(momentum),
                         static_cast<float>(1.0 - dampening),
                         static_cast<float>(weight_decay),
                         momentum != 0.0,
                         step_before == 0.0f,
                         nesterov};
}

// torch.optim.SGD's update of one element in float32: the momentum buffer `buf` in place
// (untouched without momentum), returns the new master weight.
inline float sgd_element(float master, float& buf, float grad, const SgdCoefficients& c) {
  float d = grad * c.grad_multiplier + c.weight_decay * master;
  if (c.use_momentum) {
    buf = c.first_step ? d : c.momentum * buf + c.one_minus_dampening * d;
    d = c.nesterov ? d + c.momentum * buf : buf;
  }
  return master - c.lr * d;
}

}  // namespace memkern::cpu
