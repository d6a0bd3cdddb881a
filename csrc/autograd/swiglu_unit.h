// SwiGLU's gated unit silu(gate) * up as the layer of swiglu_unit.cpp computes it, which the
// consumers of its output rebuild it by (saved_input.cpp).
#pragma once

#include <ATen/ATen.h>

namespace memkern::autograd {

// memkern::swiglu_forward(gate, up) through the dispatcher (gate and up contiguous, one shape
// and dtype).
at::Tensor swiglu_unit(const at::Tensor& gate, const at::Tensor& up);

}  // namespace memkern::autograd
