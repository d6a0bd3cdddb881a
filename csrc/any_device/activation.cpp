// memkern::act_forward / memkern::act_backward on CPU. Contract: memkern/ops/activation.py.
//
// torch's own CPU activation kernels are already vectorised single passes that compute 16-bit
// inputs in float32 and round once, which is this op's contract; registering them here in C++
// (rather than leaving the CPU key to the Python reference) takes the Python call out of every
// MLP forward and backward on the CPU — the host time of memkern's C++ MLP autograd.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string_view>

namespace memkern::cpu {
namespace {

[[noreturn]] void unknown_kind(const char* op, std::string_view kind) {
  TORCH_CHECK(false, "memkern.ops.", op, ": kind='", std::string(kind),
              "' is not an activation; use one of ('gelu', 'gelu_tanh', 'relu', 'silu')");
}

at::Tensor act_forward_cpu(const at::Tensor& x, c10::string_view kind) {
  if (kind == "gelu") return at::gelu(x);
  if (kind == "gelu_tanh") return at::gelu(x, "tanh");
  if (kind == "relu") return at::relu(x);
  if (kind == "silu") return at::silu(x);
  unknown_kind("act_forward", kind);
}

at::Tensor act_backward_cpu(const at::Tensor& grad, const at::Tensor& x, c10::string_view kind) {
  if (kind == "gelu") return at::gelu_backward(grad, x);
  if (kind == "gelu_tanh") return at::gelu_backward(grad, x, "tanh");
  if (kind == "relu") return at::threshold_backward(grad, x, 0);
  if (kind == "silu") return at::silu_backward(grad, x);
  unknown_kind("act_backward", kind);
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) {
  m.impl("act_forward", &act_forward_cpu);
  m.impl("act_backward", &act_backward_cpu);
}

}  // namespace memkern::cpu
