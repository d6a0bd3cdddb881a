// memkern::mlp_layer: memkern's MLP fc2(act(fc1(x))) with its autograd in C++ (a
// torch::autograd::Node, node.h), the layer's one implementation: eager calls run it, and
// torch.compile traces it into its inner ops.
//
// Computed in autocast's dtype when autocast is on for x's device (x, the weights and the
// biases cast to it first, as torch's linear does), else in x's. Per recompute, "none" saves
// x, pre = fc1(x) and h = act(pre); "activation" x and pre; "full" x only — x as cast, or the
// norm's recipe when x is a memkern norm's output of the compute dtype (saved_input.h) — and
// the weights themselves (and fc1's bias, for "full"): under autocast their low-precision
// copies are made again in backward rather than kept. What backward runs again is
// mlp_recomputed_ops. The activation and its gradient run as memkern::act_forward /
// act_backward through the dispatcher; weight gradients are added straight into .grad when
// that gives exactly what autograd would (weight_grad.h); the engine casts each gradient to its
// input's dtype.
//
// At the end of the file: the layer's eager entry from Python, memkern._C.mlp_layer
// (python_entry.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "../layer_constants.h"
#include "gemm.h"
#include "node.h"
#include "python_entry.h"
#include "recomputed_ops.h"
#include "saved_input.h"
#include "weight_grad.h"

namespace {

using memkern::autograd::NormRecipe;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
namespace mka = memkern::autograd;

constexpr const char* kActForward = "memkern::act_forward";

at::Tensor act_forward(const at::Tensor& x, const std::string& kind) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(kActForward, "")
                             .typed<at::Tensor(const at::Tensor&, c10::string_view)>();
  return op.call(x, kind);
}

at::Tensor act_backward(const at::Tensor& grad, const at::Tensor& x, const std::string& kind) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::act_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>();
  return op.call(grad, x, kind);
}

// The forward's tensors: x in the compute dtype, the pre-activation, the activation, the
// output.
struct Forward {
  at::Tensor xc, pre, h, out;
};

Forward forward(const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
                const at::Tensor& w2, const std::optional<at::Tensor>& b2,
                const std::string& activation, bool transposed) {
  const at::ScalarType dtype = mka::compute_dtype(x);
  Forward f;
  f.xc = mka::cast(x, dtype);
  f.pre =
      mka::layer_mm(mka::rows(f.xc), mka::cast(w1, dtype), mka::cast(b1, dtype), transposed);
  f.h = act_forward(f.pre, activation);
  const at::Tensor out =
      mka::layer_mm(f.h, mka::cast(w2, dtype), mka::cast(b2, dtype), transposed);
  f.out = out.view(mka::with_last(x.sizes(), out.size(-1)));
  return f;
}

// The backward of one call; its inputs (next edges) are x, fc1_weight, fc1_bias, fc2_weight,
// fc2_bias.
struct MLPBackward : public torch::autograd::Node {
  mka::SavedInput input;
  SavedVariable pre, h, w1, w2, b1;  // pre: not for "full"; h: "none" only
  std::string activation;
  at::ScalarType dtype = at::kFloat;  // the compute dtype
  bool transposed = false;
  bool has_b2 = false;

  variable_list apply(variable_list&& grads) override {
    mka::check_not_double_backward("MLP");
    variable_list out(5);
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return out;
    }
    const at::Tensor w1_stored = w1.unpack();
    const at::Tensor w2_stored = w2.unpack();
    const at::Tensor w1_ = mka::cast(w1_stored, dtype);
    const at::Tensor w2_ = mka::cast(w2_stored, dtype);
    const at::Tensor g = mka::rows(mka::cast(grad_out, dtype));
    // x, fc1_weight, fc1_bias, fc2_weight, fc2_bias
    const bool need[5] = {task_should_compute_output(0), task_should_compute_output(1),
                          task_should_compute_output(2), task_should_compute_output(3),
                          has_b2 && task_should_compute_output(4)};
    at::Tensor pre_ = pre.unpack();
    at::Tensor h_ = h.unpack();
    at::Tensor x2;  // rebuilt only where needed: the first GEMM again, or fc1's weight gradient
    if (!pre_.defined() || need[1]) {
      x2 = mka::rows(input.load());
    }
    if (!pre_.defined()) {  // "full": the first GEMM again
      pre_ = mka::layer_mm(x2, w1_, mka::cast(b1.unpack(), dtype), transposed);
    }
    if (need[3]) {
      if (!h_.defined()) {  // "activation"/"full": the activation again
        h_ = act_forward(pre_, activation);
      }
      const auto [a, b] = mka::weight_grad_operands(g, h_, transposed);
      out[3] = mka::weight_grad(w2_stored, a, b);
    }
    h_.reset();
    if (need[4]) {
      out[4] = g.sum(0);
    }
    if (need[0] || need[1] || need[2]) {
      at::Tensor dpre = act_backward(mka::input_grad(g, w2_, transposed), pre_, activation);
      pre_.reset();
      if (need[1]) {
        const auto [a, b] = mka::weight_grad_operands(dpre, x2, transposed);
        out[1] = mka::weight_grad(w1_stored, a, b);
      }
      if (need[2]) {
        out[2] = dpre.sum(0);
      }
      if (need[0]) {
        const int64_t in_features = transposed ? w1_.size(0) : w1_.size(1);
        out[0] = mka::input_grad(dpre, w1_, transposed)
                     .view(mka::with_last(grad_out.sizes(), in_features));
      }
    }
    return out;
  }

  void release_variables() override {
    input.release();
    for (SavedVariable* t : {&pre, &h, &w1, &w2, &b1}) {
      t->reset_data();
    }
  }

  std::string name() const override { return "memkern::MLPBackward"; }
};

at::Tensor mlp_autograd(const at::Tensor& x, const at::Tensor& w1,
                        const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                        const std::optional<at::Tensor>& b2, c10::string_view activation,
                        c10::string_view recompute, bool transposed,
                        const std::optional<at::Tensor>& norm_x,
                        const std::optional<at::Tensor>& norm_weight,
                        const std::optional<at::Tensor>& norm_bias, int64_t norm_kind,
                        int64_t norm_dims, double norm_eps) {
  const memkern::Recompute keep = memkern::parse_recompute("mlp_layer", recompute);
  const std::string act(activation);
  Forward f;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    f = forward(x, w1, b1, w2, b2, act, transposed);
  }
  const at::Tensor b1_ = b1.value_or(at::Tensor());
  const at::Tensor b2_ = b2.value_or(at::Tensor());
  if (torch::autograd::compute_requires_grad(x, w1, b1_, w2, b2_)) {
    auto node = mka::make_node<MLPBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, w1, b1_, w2, b2_));
    // a cast x is not the norm's output: the recipe cannot rebuild it
    node->input.save(f.xc, f.xc.is_same(x) ? NormRecipe{norm_x, norm_weight, norm_bias,
                                                        norm_kind, norm_dims, norm_eps}
                                           : NormRecipe{});
    node->pre = SavedVariable(keep != memkern::kFull ? f.pre : at::Tensor(), false);
    node->h = SavedVariable(keep == memkern::kNone ? f.h : at::Tensor(), false);
    node->w1 = SavedVariable(w1, false);
    node->w2 = SavedVariable(w2, false);
    node->b1 = SavedVariable(b1_, false);
    node->activation = act;
    node->dtype = f.xc.scalar_type();
    node->transposed = transposed;
    node->has_b2 = b2_.defined();
    torch::autograd::set_history(f.out, node);
  }
  return f.out;
}

at::Tensor mlp_no_autograd(const at::Tensor& x, const at::Tensor& w1,
                           const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                           const std::optional<at::Tensor>& b2, c10::string_view activation,
                           c10::string_view, bool transposed, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           int64_t, int64_t, double) {
  return forward(x, w1, b1, w2, b2, std::string(activation), transposed).out;
}

}  // namespace

namespace memkern::autograd {

// MLPBackward's recomputation: the activation is memkern::act_forward.
std::vector<const char*> mlp_recomputed_ops(Recompute recompute) {
  return gemm_layer_recomputed_ops(recompute, kActForward);
}

}  // namespace memkern::autograd

// The schema is defined in memkern/ops/mlp_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("mlp_layer", mlp_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("mlp_layer", mlp_no_autograd);
}

// The layer's eager entry from Python, memkern._C.mlp_layer (python_entry.h).
namespace memkern::autograd {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

// memkern.nn.functional.mlp in eager mode: memkern::mlp_layer with x's norm recipe, or None
// for a call that function refuses with its error (gemm_input).
OptTensor mlp_layer(py::handle x_obj, const at::Tensor& fc1_weight, const OptTensor& fc1_bias,
              const at::Tensor& fc2_weight, const OptTensor& fc2_bias,
              const std::string& activation, const std::string& recompute, bool transposed) {
  const auto in =
      gemm_input(x_obj, {{&fc1_weight, &fc1_bias}, {&fc2_weight, &fc2_bias}}, transposed ? 0 : 1);
  if (!in) {
    return std::nullopt;
  }
  const NormRecipe& recipe = in->recipe;
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::mlp_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const at::Tensor&, const OptTensor&, c10::string_view,
                            c10::string_view, bool, const OptTensor&, const OptTensor&,
                            const OptTensor&, int64_t, int64_t, double)>();
  return op.call(in->x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, recompute,
                 transposed, recipe.x, recipe.weight, recipe.bias, recipe.kind, recipe.dims,
                 recipe.eps);
}

}  // namespace

void add_mlp_entries(py::module_& m) {
  m.def("mlp_layer", &mlp_layer, py::arg("x"), py::arg("fc1_weight"), py::arg("fc1_bias"),
        py::arg("fc2_weight"), py::arg("fc2_bias"), py::arg("activation"), py::arg("recompute"),
        py::arg("transposed"),
        "memkern.nn.functional.mlp's eager call: memkern::mlp_layer with x's norm recipe, or "
        "None for a call that function refuses with its error.");
}

}  // namespace memkern::autograd
