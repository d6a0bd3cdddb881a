// memkern::norm_layer: the autograd of memkern's LayerNorm/RMSNorm (NormFunction in
// memkern/nn/functional/norm.py) in C++ (torch::autograd::Function), so a layer call costs no
// Python autograd.Function.
//
// Forward flattens x to [rows, D] (D = the product of the last n_norm sizes) and runs
// memkern::norm_forward; saves x, the weight, and the float32 (float64 for float64 x) per-row
// mean (LayerNorm; empty for RMSNorm) and rstd — never the output. Backward runs
// memkern::norm_backward. Both ops are called through the dispatcher, so whatever kernel is
// registered for the device serves them (C++ on the CPU and on CUDA: csrc/cpu/norm.cpp,
// csrc/cuda/norm.cu).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "node.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

at::Tensor rows(const at::Tensor& x, int64_t n_norm) {
  int64_t d = 1;
  for (int64_t i = x.dim() - n_norm; i < x.dim(); ++i) d *= x.size(i);
  return x.reshape({-1, d}).contiguous();
}

std::optional<at::Tensor> flat(const std::optional<at::Tensor>& p) {
  if (!p.has_value() || !p->defined()) return std::nullopt;
  return p->reshape({-1});
}

Triple norm_forward(const at::Tensor& x2, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, double eps, bool rms) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::norm_forward", "")
          .typed<Triple(const at::Tensor&, const std::optional<at::Tensor>&,
                        const std::optional<at::Tensor>&, double, bool)>();
  return op.call(x2, weight, bias, eps, rms);
}

Triple norm_backward(const at::Tensor& dy2, const at::Tensor& x2,
                     const std::optional<at::Tensor>& weight, const at::Tensor& mean,
                     const at::Tensor& rstd, bool rms) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::norm_backward", "")
          .typed<Triple(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(dy2, x2, weight, mean, rstd, rms);
}

struct NormFunction : public torch::autograd::Function<NormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, int64_t n_norm, double eps,
                            bool rms) {
    auto [y, mean, rstd] = norm_forward(rows(x, n_norm), flat(weight), flat(bias), eps, rms);
    ctx->save_for_backward({x, weight.value_or(at::Tensor()), mean, rstd});
    ctx->saved_data["n_norm"] = n_norm;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return y.view(x.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    memkern::autograd::check_not_double_backward("LayerNorm/RMSNorm");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const int64_t n_norm = ctx->saved_data["n_norm"].toInt();
    const at::Tensor dy2 = rows(grad_outputs[0], n_norm).to(x.scalar_type());
    const std::optional<at::Tensor> w =
        weight.defined() ? std::optional<at::Tensor>(weight.reshape({-1})) : std::nullopt;
    auto [dx, dw, db] = norm_backward(dy2.contiguous(), rows(x, n_norm), w, saved[2], saved[3],
                                      ctx->saved_data["rms"].toBool());
    at::Tensor dweight, dbias;
    if (weight.defined() && ctx->needs_input_grad(1)) {
      dweight = dw.to(weight.scalar_type()).view(weight.sizes());
    }
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      dbias = db.to(weight.scalar_type()).view(weight.sizes());
    }
    return {dx.view(x.sizes()), dweight, dbias, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor norm_layer_autograd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, int64_t n_norm, double eps,
                               bool rms) {
  return NormFunction::apply(x, weight, bias, n_norm, eps, rms);
}

at::Tensor norm_layer_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, int64_t n_norm, double eps,
                              bool rms) {
  return std::get<0>(norm_forward(rows(x, n_norm), flat(weight), flat(bias), eps, rms))
      .view(x.sizes());
}

}  // namespace

// The schema is defined in memkern/ops/norm_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("norm_layer", norm_layer_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("norm_layer", norm_layer_forward);
}
