// The GEMMs of the GEMM layers' C++ autograd (linear.cpp, mlp.cpp, swiglu.cpp): a weight is
// stored [out, in] (nn.Linear) or, with `transposed`, [in, out] (GPT-2's Conv1D).
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <array>
#include <optional>
#include <vector>

namespace memkern::autograd {

// `t` as [rows, features] (a view when possible).
inline at::Tensor rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// `sizes` with the last one replaced: the shape of a layer's output (or input gradient).
inline std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

// The dtype a GEMM layer computes in: autocast's when it is on for x's device (x floating),
// else x's own (which the parameters then share: memkern.nn.functional checks that first).
inline at::ScalarType compute_dtype(const at::Tensor& x) {
  const c10::DeviceType device = x.device().type();
  if (x.is_floating_point() && at::autocast::is_autocast_available(device) &&
      at::autocast::is_autocast_enabled(device)) {
    return at::autocast::get_autocast_dtype(device);
  }
  return x.scalar_type();
}

// The op `cast` runs (Tensor::to's), by name and overload (recomputed_ops.h).
inline constexpr const char* kCastOp = "aten::to.dtype";

// `t` in `dtype`: `t` itself when it has it (no aten::to call, which would return its input)
// or is undefined (an absent bias).
inline at::Tensor cast(const at::Tensor& t, at::ScalarType dtype) {
  return !t.defined() || t.scalar_type() == dtype ? t : t.to(dtype);
}

// The same for an optional tensor; absent stays absent.
inline std::optional<at::Tensor> cast(const std::optional<at::Tensor>& t, at::ScalarType dtype) {
  if (!t.has_value() || !t->defined()) {
    return std::nullopt;
  }
  return cast(*t, dtype);
}

// The ops `layer_mm` runs, by name (recomputed_ops.h).
inline constexpr std::array<const char*, 2> kLayerMmOps{"aten::mm", "aten::addmm"};

// a @ W^T + b (a @ W + b when transposed); b may be absent.
inline at::Tensor layer_mm(const at::Tensor& a, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, bool transposed) {
  const at::Tensor w = transposed ? weight : weight.t();
  return bias.has_value() && bias->defined() ? at::addmm(*bias, a, w) : at::mm(a, w);
}

// The input gradient g @ W (g @ W^T when transposed).
inline at::Tensor input_grad(const at::Tensor& g, const at::Tensor& weight, bool transposed) {
  return at::mm(g, transposed ? weight.t() : weight);
}

// The weight's gradient operands: (g^T, a) (transposed: (a^T, g)), for weight_grad.
inline std::pair<at::Tensor, at::Tensor> weight_grad_operands(const at::Tensor& g,
                                                              const at::Tensor& a,
                                                              bool transposed) {
  return transposed ? std::make_pair(a.t(), g) : std::make_pair(g.t(), a);
}

}  // namespace memkern::autograd
