// Which forward arguments of a C++ autograd Function need a gradient, counted the way the
// Python Function's ctx.needs_input_grad is: by argument position. (AutogradContext's
// needs_input_grad numbers only the tensor arguments that were given — an absent optional
// bias has no edge — so the positions after one shift.)
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <cstddef>
#include <initializer_list>

namespace memkern::autograd {

// needs[i]: whether tensor argument i (given[i]: it was passed) needs a gradient.
template <size_t N>
std::array<bool, N> needs_input_grad(const torch::autograd::AutogradContext* ctx,
                                     const std::array<bool, N>& given) {
  std::array<bool, N> needs{};
  size_t edge = 0;
  for (size_t i = 0; i < N; ++i) {
    needs[i] = given[i] && ctx->needs_input_grad(edge++);
  }
  return needs;
}

}  // namespace memkern::autograd
