// Argument checks of the layer ops' compiled kernels (dropout, SwiGLU, the norms), shared by
// the CPU kernels (csrc/cpu) and the CUDA bindings (csrc/cuda/<layer>_ops.cpp). Each message
// names the argument, says what was wrong and what to do; the Python entries check the same
// first (memkern/ops/*.py), so these guard direct calls of torch.ops.memkern.* and the C++
// autograd layers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace memkern {

// The math type of the layer ops: float64 for float64 inputs, float32 otherwise.
inline at::ScalarType layer_acc_type(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// x of memkern::dropout, and its seed: one int64 element on x's device (read by the kernel
// there: a seed in another memory would need a copy, and on a GPU a host sync).
inline void check_dropout_args(const at::Tensor& x, const at::Tensor& seed, double p) {
  TORCH_CHECK(x.is_contiguous(), "memkern.dropout: x must be contiguous; pass x.contiguous()");
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong &&
                  seed.device() == x.device(),
              "memkern.dropout: seed must be a one-element int64 tensor on x's device ",
              x.device(), ", got ", seed.scalar_type(), " of shape ", seed.sizes(), " on ",
              seed.device());
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "memkern.dropout: p=", p, " must be a probability in [0, 1]");
}

// A tensor of the SwiGLU ops that must match gate's shape, dtype and device.
inline void check_like_gate(const char* op, const char* name, const at::Tensor& t,
                            const at::Tensor& gate) {
  TORCH_CHECK(t.sizes() == gate.sizes() && t.scalar_type() == gate.scalar_type() &&
                  t.device() == gate.device(),
              "memkern.", op, ": ", name, " has shape ", t.sizes(), ", dtype ", t.scalar_type(),
              " and device ", t.device(), "; expected gate's ", gate.sizes(), ", ",
              gate.scalar_type(), " and ", gate.device());
}

// x of memkern::norm_forward / norm_backward: [rows, D].
inline void check_norm_input(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "memkern.", op, ": x must be 2-D [rows, D], got shape ", x.sizes(),
              "; flatten the leading dimensions with x.reshape(-1, D)");
}

// A norm's optional weight or bias: [D] on x's device.
inline void check_norm_param(const char* op, const char* name, const std::optional<at::Tensor>& t,
                             const at::Tensor& x) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == x.size(1) && t->device() == x.device(), "memkern.",
              op, ": ", name, " must be [", x.size(1), "] on ", x.device(), " to match x, got ",
              t->sizes(), " on ", t->device());
}

// dy, x and the statistics of memkern::norm_backward.
inline void check_norm_backward_args(const at::Tensor& dy, const at::Tensor& x,
                                     const at::Tensor& mean, const at::Tensor& rstd, bool rms) {
  TORCH_CHECK(x.dim() == 2 && dy.sizes() == x.sizes() && dy.device() == x.device(),
              "memkern.norm_backward: dy and x must be 2-D [rows, D] of one shape on one device, "
              "got ", dy.sizes(), " on ", dy.device(), " and ", x.sizes(), " on ", x.device());
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), "memkern.norm_backward: dy has dtype ",
              dy.scalar_type(), " but x has ", x.scalar_type(), "; pass dy in x's dtype");
  const at::ScalarType acc = layer_acc_type(x);
  const int64_t rows = x.size(0);
  TORCH_CHECK(rstd.scalar_type() == acc && rstd.numel() == rows && rstd.device() == x.device() &&
                  (rms || (mean.scalar_type() == acc && mean.numel() == rows &&
                           mean.device() == x.device())),
              "memkern.norm_backward: mean and rstd must be the ", acc,
              " statistics norm_forward returned for this x");
}

}  // namespace memkern
