// The elementwise math of memkern::swiglu_forward / swiglu_backward (contract and formulas:
// memkern/ops/swiglu.py), shared by the CPU kernels (csrc/cpu/swiglu.cpp) and the CUDA kernels
// (csrc/cuda/swiglu.cu). acc_t is the math type: float for float32 and 16-bit inputs (rounded once
// by the caller), double for float64.
#pragma once

#include "../../math/host_device.h"

namespace memkern::math {

// h = silu(gate) * up = gate / (1 + exp(-gate)) * up. exp(-gate) overflows to inf for a very
// negative gate, giving -0 * up as torch's silu does; NaN propagates.
template <typename acc_t>
MEMKERN_HOST_DEVICE acc_t swiglu(acc_t gate, acc_t up) {
  return gate / (acc_t(1) + exp_of(-gate)) * up;
}

// The gradients of h for the incoming gradient dh, with s = sigmoid(gate):
// grad_up = dh * gate * s, grad_gate = dh * up * s * (1 + gate * (1 - s)).
template <typename acc_t>
struct SwigluGrad {
  acc_t gate, up;
};

template <typename acc_t>
MEMKERN_HOST_DEVICE SwigluGrad<acc_t> swiglu_grad(acc_t dh, acc_t gate, acc_t up) {
  const acc_t s = acc_t(1) / (acc_t(1) + exp_of(-gate));
  return {dh * up * s * (acc_t(1) + gate * (acc_t(1) - s)), dh * gate * s};
}

}  // namespace memkern::math
