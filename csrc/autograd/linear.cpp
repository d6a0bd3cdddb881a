// memkern::linear: the autograd of memkern's Linear in C++ (torch::autograd::Function), so a
// layer call costs what nn.Linear's does on the host: no Python autograd.Function per call.
//
// What it computes and saves is memkern.nn.functional.linear's LinearFunction for one dtype and
// no autocast (the Python module routes only those calls here): out = x @ W^T + b (x @ W + b
// with transposed = true, GPT-2's Conv1D); saves x (when W needs a gradient) — or, when x is a
// memkern norm's output, the norm's recipe (saved_input.h) — and W. In backward the weight
// gradient is added straight into W.grad when that gives exactly what autograd would
// (weight_grad.h). Device-generic: only ATen ops and memkern ops through the dispatcher,
// registered for the Autograd dispatch key.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>

#include "gemm.h"
#include "saved_input.h"
#include "weight_grad.h"

namespace {

using memkern::autograd::NormRecipe;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace mka = memkern::autograd;

at::Tensor forward_only(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, bool transposed) {
  const at::Tensor out = mka::layer_mm(mka::rows(x), weight, bias, transposed);
  return out.view(mka::with_last(x.sizes(), out.size(-1)));
}

struct LinearFunction : public torch::autograd::Function<LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool transposed,
                            const NormRecipe& recipe) {
    std::vector<at::Tensor> to_save;
    mka::save_input(ctx, to_save, weight.requires_grad() ? x : at::Tensor(), recipe);
    to_save.push_back(weight);
    ctx->save_for_backward(to_save);
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return forward_only(x, weight, bias, transposed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[mka::kSavedInputSlots];
    const bool transposed = ctx->saved_data["transposed"].toBool();
    const at::Tensor& grad_out = grad_outputs[0];
    const at::Tensor g = mka::rows(grad_out);
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      const int64_t in_features = transposed ? weight.size(0) : weight.size(1);
      dx = mka::input_grad(g, weight, transposed)
               .view(mka::with_last(grad_out.sizes(), in_features));
    }
    if (ctx->needs_input_grad(1)) {
      const auto [a, b] =
          mka::weight_grad_operands(g, mka::rows(mka::load_input(ctx, saved)), transposed);
      dw = mka::weight_grad(weight, a, b);
    }
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      db = g.sum(0);
    }
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, bool transposed,
                           const std::optional<at::Tensor>& norm_x,
                           const std::optional<at::Tensor>& norm_weight,
                           const std::optional<at::Tensor>& norm_bias, int64_t norm_kind,
                           int64_t norm_dims, double norm_eps) {
  return LinearFunction::apply(
      x, weight, bias, transposed,
      NormRecipe{norm_x, norm_weight, norm_bias, norm_kind, norm_dims, norm_eps});
}

at::Tensor linear_no_autograd(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, bool transposed,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, int64_t, int64_t, double) {
  return forward_only(x, weight, bias, transposed);
}

}  // namespace

// The schema is defined in memkern/ops/linear.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("linear", linear_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) { m.impl("linear", linear_no_autograd); }
