// memkern::mlp_layer: the autograd of memkern's MLP fc2(act(fc1(x))) in C++ (a
// torch::autograd::Node, node.h), so a layer call costs on the host what torch's composition
// of C++ autograd nodes does: no Python autograd.Function per call.
//
// What it computes, saves and recomputes is memkern.nn.functional.mlp's MLPFunction for one
// dtype and no autocast (the Python functional routes only those calls here): per recompute,
// "none" saves x, pre = fc1(x) and h = act(pre); "activation" x and pre; "full" x only — x
// being the norm's recipe when it is a memkern norm's output (saved_input.h) — and the
// weights (and fc1's bias, for "full"). The activation and its gradient run as
// memkern::act_forward / act_backward through the dispatcher; weight gradients are added
// straight into .grad when that gives exactly what autograd would (weight_grad.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "../layer_constants.h"
#include "gemm.h"
#include "node.h"
#include "saved_input.h"
#include "weight_grad.h"

namespace {

using memkern::autograd::NormRecipe;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
namespace mka = memkern::autograd;

at::Tensor act_forward(const at::Tensor& x, const std::string& kind) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memkern::act_forward", "")
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

at::Tensor forward_only(const at::Tensor& x, const at::Tensor& w1,
                        const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                        const std::optional<at::Tensor>& b2, c10::string_view activation,
                        bool transposed) {
  const at::Tensor h = act_forward(mka::layer_mm(mka::rows(x), w1, b1, transposed),
                                   std::string(activation));
  const at::Tensor out = mka::layer_mm(h, w2, b2, transposed);
  return out.view(mka::with_last(x.sizes(), out.size(-1)));
}

// The backward of one call; its inputs (next edges) are x, fc1_weight, fc1_bias, fc2_weight,
// fc2_bias.
struct MLPBackward : public torch::autograd::Node {
  mka::SavedInput input;
  SavedVariable pre, h, w1, w2, b1;  // pre: not for "full"; h: "none" only
  std::string activation;
  bool transposed = false;
  bool has_b2 = false;

  variable_list apply(variable_list&& grads) override {
    mka::check_not_double_backward("MLP");
    variable_list out(5);
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return out;
    }
    const at::Tensor w1_ = w1.unpack();
    const at::Tensor w2_ = w2.unpack();
    const at::Tensor g = mka::rows(grad_out);
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
      pre_ = mka::layer_mm(x2, w1_, b1.unpack(), transposed);
    }
    if (need[3]) {
      if (!h_.defined()) {  // "activation"/"full": the activation again
        h_ = act_forward(pre_, activation);
      }
      const auto [a, b] = mka::weight_grad_operands(g, h_, transposed);
      out[3] = mka::weight_grad(w2_, a, b);
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
        out[1] = mka::weight_grad(w1_, a, b);
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
  at::Tensor pre, h, out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    pre = mka::layer_mm(mka::rows(x), w1, b1, transposed);
    h = act_forward(pre, act);
    out = mka::layer_mm(h, w2, b2, transposed);
    out = out.view(mka::with_last(x.sizes(), out.size(-1)));
  }
  const at::Tensor b1_ = b1.value_or(at::Tensor());
  const at::Tensor b2_ = b2.value_or(at::Tensor());
  if (torch::autograd::compute_requires_grad(x, w1, b1_, w2, b2_)) {
    auto node = mka::make_node<MLPBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, w1, b1_, w2, b2_));
    node->input.save(x, NormRecipe{norm_x, norm_weight, norm_bias, norm_kind, norm_dims,
                                   norm_eps});
    node->pre = SavedVariable(keep != memkern::kFull ? pre : at::Tensor(), false);
    node->h = SavedVariable(keep == memkern::kNone ? h : at::Tensor(), false);
    node->w1 = SavedVariable(w1, false);
    node->w2 = SavedVariable(w2, false);
    node->b1 = SavedVariable(b1_, false);
    node->activation = act;
    node->transposed = transposed;
    node->has_b2 = b2_.defined();
    torch::autograd::set_history(out, node);
  }
  return out;
}

at::Tensor mlp_no_autograd(const at::Tensor& x, const at::Tensor& w1,
                           const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                           const std::optional<at::Tensor>& b2, c10::string_view activation,
                           c10::string_view, bool transposed, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           int64_t, int64_t, double) {
  return forward_only(x, w1, b1, w2, b2, activation, transposed);
}

}  // namespace

// The schema is defined in memkern/ops/mlp_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("mlp_layer", mlp_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("mlp_layer", mlp_no_autograd);
}
