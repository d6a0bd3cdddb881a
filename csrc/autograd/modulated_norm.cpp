// memkern::modulated_norm_layer: adaLN's modulated LayerNorm (DiT's adaLN-Zero blocks) as one
// C++ autograd node (node.h): y = layer_norm(x) * (1 + scale) + shift, the LayerNorm over x's
// last dimension without affine parameters, scale and shift [batch, features] per sample
// (modulate(), saved_input.h).
//
// Saves x and its per-row mean and rstd (as torch's LayerNorm does), and the scale — never the
// normalised input (which torch's multiply by 1 + scale would keep) nor the output. It also
// keeps the shift ([batch, features], which backward does not need): the output's recipe
// (kModulatedLayerNorm) refers to it, and a consumer must find it alive to save the recipe
// instead of the output. Backward: dshift = sum of dy over the tokens, dscale = the same of
// dy * normalised (rebuilt from x and the statistics), dx = native_layer_norm_backward of
// dy * (1 + scale). Only ATen ops through the dispatcher: any device, and torch.compile traces
// it.
//
// At the end of the file: the layer's eager entry from Python, memkern._C.modulated_norm
// (python_entry.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "node.h"
#include "python_entry.h"
#include "saved_input.h"

namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
namespace mka = memkern::autograd;

// The dimensions between the batch and the features, which the per-sample scale and shift
// broadcast over (and their gradients sum over).
std::vector<int64_t> token_dims(const at::Tensor& x) {
  std::vector<int64_t> dims;
  for (int64_t d = 1; d < x.dim() - 1; ++d) {
    dims.push_back(d);
  }
  return dims;
}

// `t` [batch, ..., features] summed over the tokens: [batch, features].
at::Tensor per_sample(const at::Tensor& t) {
  const std::vector<int64_t> dims = token_dims(t);
  return dims.empty() ? t : t.sum(dims);
}

// The backward of one call; its inputs (next edges) are x, scale, shift.
struct ModulatedNormBackward : public torch::autograd::Node {
  SavedVariable x, mean, rstd, scale, shift;

  variable_list apply(variable_list&& grads) override {
    mka::check_not_double_backward("modulated LayerNorm");
    variable_list out(3);
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) {
      return out;
    }
    const at::Tensor x_ = x.unpack();
    const at::Tensor mean_ = mean.unpack();
    const at::Tensor rstd_ = rstd.unpack();
    const at::Tensor scale_ = scale.unpack();
    if (task_should_compute_output(0)) {
      const at::Tensor dnormed = dy * (mka::per_sample_view(scale_, dy.dim()) + 1);
      out[0] = std::get<0>(at::native_layer_norm_backward_symint(
          dnormed, x_, {x_.sym_size(-1)}, mean_, rstd_, {}, {}, {true, false, false}));
    }
    if (task_should_compute_output(1)) {
      out[1] = per_sample(dy * ((x_ - mean_) * rstd_));
    }
    if (task_should_compute_output(2)) {
      out[2] = per_sample(dy);
    }
    return out;
  }

  void release_variables() override {
    x.reset_data();
    mean.reset_data();
    rstd.reset_data();
    scale.reset_data();
    shift.reset_data();
  }

  std::string name() const override { return "memkern::ModulatedNormBackward"; }
};

at::Tensor modulated_norm_autograd(const at::Tensor& x, const at::Tensor& scale,
                                   const at::Tensor& shift, double eps) {
  at::Tensor y, mean, rstd;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor normed;
    std::tie(normed, mean, rstd) = at::native_layer_norm_symint(x, {x.sym_size(-1)}, {}, {}, eps);
    y = mka::modulate(normed, scale, shift);
  }
  if (torch::autograd::compute_requires_grad(x, scale, shift)) {
    auto node = mka::make_node<ModulatedNormBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, scale, shift));
    node->x = SavedVariable(x, /*is_output=*/false);
    node->mean = SavedVariable(mean, false);
    node->rstd = SavedVariable(rstd, false);
    node->scale = SavedVariable(scale, false);
    node->shift = SavedVariable(shift, false);
    torch::autograd::set_history(y, node);
  }
  return y;
}

at::Tensor modulated_norm_forward(const at::Tensor& x, const at::Tensor& scale,
                                  const at::Tensor& shift, double eps) {
  return mka::modulate(
      std::get<0>(at::native_layer_norm_symint(x, {x.sym_size(-1)}, {}, {}, eps)), scale, shift);
}

}  // namespace

// The schema is defined in memkern/ops/modulated_norm_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) {
  m.impl("modulated_norm_layer", modulated_norm_autograd);
}
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("modulated_norm_layer", modulated_norm_forward);
}

// The layer's eager entry from Python, memkern._C.modulated_norm (python_entry.h).
namespace memkern::autograd {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

// memkern.nn.functional.modulated_layer_norm in eager mode: memkern::modulated_norm_layer, its
// output carrying its recipe (kModulatedLayerNorm: x, scale, shift) like a norm's. None for a
// call the Python path takes: autocast on x's device (the op has none: torch's composition
// runs), mixed dtypes or shapes that do not fit (the Python path raises).
py::object modulated_norm(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                          double eps) {
  if (x.dim() < 2 || scale.dim() != 2 || scale.sizes() != shift.sizes() ||
      scale.size(0) != x.size(0) || scale.size(1) != x.size(-1) || !one_dtype(x, scale, shift) ||
      autocast_on(x.device().type())) {
    return py::none();
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::modulated_norm_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return with_recipe(op.call(x, scale, shift, eps), x, scale, shift,
                     kModulatedLayerNorm, 1, eps);
}

}  // namespace

void add_modulated_norm_entries(py::module_& m) {
  m.def("modulated_norm", &modulated_norm, py::arg("x"), py::arg("scale"), py::arg("shift"),
        py::arg("eps"),
        "memkern.nn.functional.modulated_layer_norm's eager call: memkern::modulated_norm_layer, "
        "its output carrying its recipe, or None when the Python path must take the call.");
}

}  // namespace memkern::autograd
