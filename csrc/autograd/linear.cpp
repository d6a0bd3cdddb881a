// memkern::linear_layer: the autograd of memkern's Linear in C++ (a torch::autograd::Node,
// node.h), so a layer call costs what nn.Linear's does on the host: no Python
// autograd.Function per call.
//
// What it computes and saves is memkern.nn.functional.linear's LinearFunction for one dtype and
// no autocast (the Python module routes only those calls here): out = x @ W^T + b (x @ W + b
// with transposed = true, GPT-2's Conv1D); saves x (when W needs a gradient) — or, when x is a
// memkern norm's output, the norm's recipe (saved_input.h) — and W. In backward the weight
// gradient is added straight into W.grad when that gives exactly what autograd would
// (weight_grad.h). Device-generic: only ATen ops and memkern ops through the dispatcher,
// registered for the Autograd dispatch key.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "gemm.h"
#include "node.h"
#include "saved_input.h"
#include "weight_grad.h"

namespace {

using memkern::autograd::NormRecipe;
using torch::autograd::variable_list;
namespace mka = memkern::autograd;

at::Tensor forward_only(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, bool transposed) {
  const at::Tensor out = mka::layer_mm(mka::rows(x), weight, bias, transposed);
  return out.view(mka::with_last(x.sizes(), out.size(-1)));
}

// The backward of one call; its inputs (next edges) are x, weight, bias.
struct LinearBackward : public torch::autograd::Node {
  mka::SavedInput input;  // x, when the weight needs a gradient
  torch::autograd::SavedVariable weight;
  bool transposed = false;
  bool has_bias = false;

  variable_list apply(variable_list&& grads) override {
    mka::check_not_double_backward("Linear");
    const at::Tensor& grad_out = grads[0];
    variable_list out(3);
    if (!grad_out.defined()) {
      return out;
    }
    const at::Tensor w = weight.unpack();
    const at::Tensor g = mka::rows(grad_out);
    if (task_should_compute_output(0)) {
      const int64_t in_features = transposed ? w.size(0) : w.size(1);
      out[0] = mka::input_grad(g, w, transposed)
                   .view(mka::with_last(grad_out.sizes(), in_features));
    }
    if (task_should_compute_output(1)) {
      const auto [a, b] = mka::weight_grad_operands(g, mka::rows(input.load()), transposed);
      out[1] = mka::weight_grad(w, a, b);
    }
    if (has_bias && task_should_compute_output(2)) {
      out[2] = g.sum(0);
    }
    return out;
  }

  void release_variables() override {
    input.release();
    weight.reset_data();
  }

  std::string name() const override { return "memkern::LinearBackward"; }
};

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, bool transposed,
                           const std::optional<at::Tensor>& norm_x,
                           const std::optional<at::Tensor>& norm_weight,
                           const std::optional<at::Tensor>& norm_bias, int64_t norm_kind,
                           int64_t norm_dims, double norm_eps) {
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = forward_only(x, weight, bias, transposed);
  }
  const at::Tensor b = bias.value_or(at::Tensor());
  if (torch::autograd::compute_requires_grad(x, weight, b)) {
    auto node = mka::make_node<LinearBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, weight, b));
    node->input.save(weight.requires_grad() ? x : at::Tensor(),
                     NormRecipe{norm_x, norm_weight, norm_bias, norm_kind, norm_dims, norm_eps});
    node->weight = torch::autograd::SavedVariable(weight, /*is_output=*/false);
    node->transposed = transposed;
    node->has_bias = b.defined();
    torch::autograd::set_history(out, node);
  }
  return out;
}

at::Tensor linear_no_autograd(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, bool transposed,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, int64_t, int64_t, double) {
  return forward_only(x, weight, bias, transposed);
}

}  // namespace

// The schema is defined in memkern/ops/linear.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("linear_layer", linear_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("linear_layer", linear_no_autograd);
}
