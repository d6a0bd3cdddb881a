// memkern::act_forward / memkern::act_backward on the CPU and, in a build with the CUDA
// kernels, on CUDA. Contract: memkern/ops/activation.py.
//
// torch's own activation kernels are already single passes that compute 16-bit inputs in
// float32 and round once, which is this op's contract, on every device; registering them here
// in C++ (rather than leaving a dispatch key to a Python kernel) takes the Python call out of
// every MLP forward and backward — the host time of memkern's C++ MLP autograd. The same
// functions serve both dispatch keys. Without the CUDA kernels (no toolkit at install time)
// the CUDA key is left to the Python registry (memkern/ops/_registry.py), which registers the
// Triton kernel there.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string_view>

#include "../layer_constants.h"

namespace memkern::any_device {
namespace {

[[noreturn]] void unknown_kind(const char* op, std::string_view kind) {
  TORCH_CHECK(false, "memkern.ops.", op, ": kind='", std::string(kind),
              "' is not an activation; use one of ", quoted_tuple(kActivationKinds));
}

at::Tensor act_forward(const at::Tensor& x, c10::string_view kind) {
  // kActivationKinds, in order
  if (kind == "gelu") return at::gelu(x);
  if (kind == "gelu_tanh") return at::gelu(x, "tanh");
  if (kind == "relu") return at::relu(x);
  if (kind == "silu") return at::silu(x);
  unknown_kind("act_forward", kind);
}

at::Tensor act_backward(const at::Tensor& grad, const at::Tensor& x, c10::string_view kind) {
  if (kind == "gelu") return at::gelu_backward(grad, x);
  if (kind == "gelu_tanh") return at::gelu_backward(grad, x, "tanh");
  if (kind == "relu") return at::threshold_backward(grad, x, 0);
  if (kind == "silu") return at::silu_backward(grad, x);
  unknown_kind("act_backward", kind);
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) {
  m.impl("act_forward", &act_forward);
  m.impl("act_backward", &act_backward);
}

#ifdef MEMKERN_WITH_CUDA
TORCH_LIBRARY_IMPL(memkern, CUDA, m) {
  m.impl("act_forward", &act_forward);
  m.impl("act_backward", &act_backward);
}
#endif

}  // namespace memkern::any_device
