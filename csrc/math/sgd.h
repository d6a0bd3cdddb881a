// The SGD math of one element, shared by the CPU kernels (csrc/cpu/sgd.cpp, sgd8bit.cpp,
// through sgd_math.h) and the CUDA kernels (csrc/cuda/kernels/sgd.cuh, sgd8bit.cuh): the same
// bits on both (host_device.h says how), so the CPU tests check what the GPU computes; the
// Triton kernel (memkern/kernels/sgd.py) runs the same operations in the same order. Contract
// and float64 reference: memkern/ops/sgd.py.
//
// torch.optim.SGD, from g = float32(grad) * grad_multiplier:
//   d = g + weight_decay master
//   buf = d (first step) or momentum buf + (1 - dampening) d;  d = d + momentum buf (Nesterov)
//   or buf
//   master = master - lr d
// with each product that feeds a sum rounded together with it (fma_rn: once instead of twice,
// where torch rounds the product and then the sum). A term that is off (weight_decay = 0, no
// momentum) is skipped, not added as zero: 0 * inf would turn an inf master into NaN, where
// torch keeps it.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace memkern::math {

// What the update of one element needs, in float32, with the switches decided on the
// unrounded hyper-parameters (a weight decay that rounds to 0 in float32 still counts).
struct SgdCoefficients {
  float lr;
  float momentum;
  float one_minus_dampening;
  float weight_decay;
  bool use_momentum;
  bool use_weight_decay;
  bool nesterov;
};

// Host code: the CPU kernels and the CUDA launchers call this same function, so both round
// the hyper-parameters alike.
inline SgdCoefficients sgd_coefficients(double lr, double momentum, double dampening,
                                        double weight_decay, bool nesterov) {
  return SgdCoefficients{static_cast<float>(lr),
                         static_cast<float>(momentum),
                         static_cast<float>(1.0 - dampening),
                         static_cast<float>(weight_decay),
                         momentum != 0.0,
                         weight_decay != 0.0,
                         nesterov};
}

// One element from g, the multiplied gradient: the momentum buffer `buf` in place (untouched
// without momentum; `first_step`: the counter is 0, when torch starts the buffer from d),
// returns the new master weight.
MEMKERN_HOST_DEVICE float sgd_element(float master, float& buf, float g, bool first_step,
                                      const SgdCoefficients& c) {
  float d = c.use_weight_decay ? fma_rn(c.weight_decay, master, g) : g;
  if (c.use_momentum) {
    buf = first_step ? d : fma_rn(c.momentum, buf, mul_rn(c.one_minus_dampening, d));
    d = c.nesterov ? fma_rn(c.momentum, buf, d) : buf;
  }
  return fma_rn(-c.lr, d, master);
}

}  // namespace memkern::math
