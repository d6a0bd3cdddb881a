// memkern::linear_layer: the autograd of memkern's Linear in C++ (a torch::autograd::Node,
// node.h), so a layer call costs what nn.Linear's does on the host: no Python
// autograd.Function per call.
//
// out = x @ W^T + b (x @ W + b with transposed = true, GPT-2's Conv1D), computed in autocast's
// dtype when autocast is on for x's device (x, W and b cast to it first, as torch's linear
// is), else in x's. Saves x as cast (when W needs a gradient) — or, when x is a memkern norm's
// output of that dtype, the norm's recipe (saved_input.h) — and W itself: under autocast its
// low-precision copy is made again in backward rather than kept. In backward the weight
// gradient is added straight into W.grad when that gives exactly what autograd would
// (weight_grad.h); the engine casts each gradient to its input's dtype. Device-generic: only
// ATen ops through the dispatcher, registered for the Autograd dispatch key; torch.compile
// traces it.
//
// At the end of the file: the layer's eager entry from Python, memkern._C.linear_layer
// (python_entry.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "gemm.h"
#include "node.h"
#include "python_entry.h"
#include "saved_input.h"
#include "weight_grad.h"

namespace {

using memkern::autograd::NormRecipe;
using torch::autograd::variable_list;
namespace mka = memkern::autograd;

// The output from x, W, b already in the compute dtype.
at::Tensor forward_only(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, bool transposed) {
  const at::Tensor out = mka::layer_mm(mka::rows(x), weight, bias, transposed);
  return out.view(mka::with_last(x.sizes(), out.size(-1)));
}

// The backward of one call; its inputs (next edges) are x, weight, bias.
struct LinearBackward : public torch::autograd::Node {
  mka::SavedInput input;  // x, when the weight needs a gradient
  torch::autograd::SavedVariable weight;
  at::ScalarType dtype = at::kFloat;  // the compute dtype
  bool transposed = false;
  bool has_bias = false;

  variable_list apply(variable_list&& grads) override {
    mka::check_not_double_backward("Linear");
    const at::Tensor& grad_out = grads[0];
    variable_list out(3);
    if (!grad_out.defined()) {
      return out;
    }
    const at::Tensor stored = weight.unpack();
    const at::Tensor w = mka::cast(stored, dtype);
    const at::Tensor g = mka::rows(mka::cast(grad_out, dtype));
    if (task_should_compute_output(0)) {
      const int64_t in_features = transposed ? w.size(0) : w.size(1);
      out[0] = mka::input_grad(g, w, transposed)
                   .view(mka::with_last(grad_out.sizes(), in_features));
    }
    if (task_should_compute_output(1)) {
      const auto [a, b] = mka::weight_grad_operands(g, mka::rows(input.load()), transposed);
      out[1] = mka::weight_grad(stored, a, b);
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
  const at::ScalarType dtype = mka::compute_dtype(x);
  at::Tensor xc, out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    xc = mka::cast(x, dtype);
    out = forward_only(xc, mka::cast(weight, dtype), mka::cast(bias, dtype), transposed);
  }
  const at::Tensor b = bias.value_or(at::Tensor());
  if (torch::autograd::compute_requires_grad(x, weight, b)) {
    auto node = mka::make_node<LinearBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, weight, b));
    // a cast x is not the norm's output: the recipe cannot rebuild it
    node->input.save(weight.requires_grad() ? xc : at::Tensor(),
                     xc.is_same(x) ? NormRecipe{norm_x, norm_weight, norm_bias, norm_kind,
                                                norm_dims, norm_eps}
                                   : NormRecipe{});
    node->dtype = dtype;
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
  const at::ScalarType dtype = mka::compute_dtype(x);
  return forward_only(mka::cast(x, dtype), mka::cast(weight, dtype), mka::cast(bias, dtype),
                      transposed);
}

}  // namespace

// The schema is defined in memkern/ops/linear_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("linear_layer", linear_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("linear_layer", linear_no_autograd);
}

// The layer's eager entry from Python, memkern._C.linear_layer (python_entry.h).
namespace memkern::autograd {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

// Whether a Linear call of one dtype without autocast is torch's own linear: when memkern
// does nothing differently (no recipe to save instead of x, not transposed, no weight.grad to
// add into).
bool linear_is_torch_linear(bool has_recipe, bool transposed, bool weight_has_grad) {
  return !has_recipe && !transposed && !weight_has_grad;
}

// Whether `weight` is a leaf holding a .grad to add into. A computed weight (torch's pruning:
// weight_orig * weight_mask) has none, and reading its .grad makes torch warn on every call.
bool leaf_with_grad(const at::Tensor& weight) {
  return weight.is_leaf() && weight.grad().defined();
}

// memkern.nn.functional.linear in eager mode: memkern::linear_layer with x's norm recipe
// (gemm_input), or torch's own linear (linear_is_torch_linear). None for a call
// memkern.nn.functional.linear refuses with its error.
OptTensor linear_layer(py::handle x_obj, const at::Tensor& weight, const OptTensor& bias,
                       bool transposed) {
  const auto in = gemm_input(x_obj, {{&weight, &bias}}, transposed ? 0 : 1);
  if (!in) {
    return std::nullopt;
  }
  const NormRecipe& recipe = in->recipe;
  if (!autocast_on(in->x.device().type()) &&
      linear_is_torch_linear(recipe.kind != kNoNorm, transposed,
                             leaf_with_grad(weight))) {
    return at::linear(in->x, weight, bias);
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::linear_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool,
                            const OptTensor&, const OptTensor&, const OptTensor&, int64_t,
                            int64_t, double)>();
  return op.call(in->x, weight, bias, transposed, recipe.x, recipe.weight, recipe.bias,
                 recipe.kind, recipe.dims, recipe.eps);
}

}  // namespace

void add_linear_entries(py::module_& m) {
  m.def("linear_layer", &linear_layer, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("transposed"),
        "memkern.nn.functional.linear's eager call: memkern::linear_layer with x's norm recipe (or "
        "torch's linear), or None for a call that function refuses with its error.");
}

}  // namespace memkern::autograd
