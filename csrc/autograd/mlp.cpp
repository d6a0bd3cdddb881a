// memkern::mlp_layer: the autograd of memkern's MLP fc2(act(fc1(x))) in C++
// (torch::autograd::Function), so a layer call costs on the host what torch's composition of
// C++ autograd nodes does: no Python autograd.Function per call.
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
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "gemm.h"
#include "needs_grad.h"
#include "node.h"
#include "saved_input.h"
#include "weight_grad.h"

namespace {

using memkern::autograd::NormRecipe;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace mka = memkern::autograd;

// memkern.nn.functional.mlp.RECOMPUTE, in order.
enum Recompute : int64_t { kNone = 0, kActivation = 1, kFull = 2 };

Recompute parse_recompute(c10::string_view recompute) {
  if (recompute == "none") return kNone;
  if (recompute == "activation") return kActivation;
  TORCH_CHECK(recompute == "full", "memkern::mlp_layer: recompute='", recompute,
              "' is not one of ('none', 'activation', 'full')");
  return kFull;
}

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

// Slots of save_for_backward after the saved input.
constexpr size_t kPre = mka::kSavedInputSlots, kH = kPre + 1, kW1 = kPre + 2, kW2 = kPre + 3,
                 kB1 = kPre + 4;

struct MLPFunction : public torch::autograd::Function<MLPFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                            const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                            const std::optional<at::Tensor>& b2, const std::string& activation,
                            int64_t recompute, bool transposed, const NormRecipe& recipe) {
    const at::Tensor pre = mka::layer_mm(mka::rows(x), w1, b1, transposed);
    const at::Tensor h = act_forward(pre, activation);
    const at::Tensor out = mka::layer_mm(h, w2, b2, transposed);
    std::vector<at::Tensor> to_save;
    mka::save_input(ctx, to_save, x, recipe);
    to_save.insert(to_save.end(), {recompute != kFull ? pre : at::Tensor(),
                                   recompute == kNone ? h : at::Tensor(), w1, w2,
                                   b1.value_or(at::Tensor())});
    ctx->save_for_backward(to_save);
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["has_b2"] = b2.has_value() && b2->defined();
    return out.view(mka::with_last(x.sizes(), out.size(-1)));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    mka::check_not_double_backward("MLP");
    const auto saved = ctx->get_saved_variables();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const bool transposed = ctx->saved_data["transposed"].toBool();
    const at::Tensor& w1 = saved[kW1];
    const at::Tensor& w2 = saved[kW2];
    const at::Tensor& grad_out = grad_outputs[0];
    const at::Tensor g = mka::rows(grad_out);
    // x, fc1_weight, fc1_bias, fc2_weight, fc2_bias
    const auto need = mka::needs_input_grad<5>(
        ctx, {true, true, saved[kB1].defined(), true, ctx->saved_data["has_b2"].toBool()});
    at::Tensor pre = saved[kPre];
    at::Tensor h = saved[kH];
    at::Tensor x2;  // rebuilt only where needed: the first GEMM again, or fc1's weight gradient
    if (!pre.defined() || need[1]) {
      x2 = mka::rows(mka::load_input(ctx, saved));
    }
    if (!pre.defined()) {  // "full": the first GEMM again
      pre = mka::layer_mm(x2, w1, saved[kB1], transposed);
    }
    at::Tensor dx, dw1, db1, dw2, db2;
    if (need[3]) {
      if (!h.defined()) {  // "activation"/"full": the activation again
        h = act_forward(pre, activation);
      }
      const auto [a, b] = mka::weight_grad_operands(g, h, transposed);
      dw2 = mka::weight_grad(w2, a, b);
    }
    h.reset();
    if (need[4]) {
      db2 = g.sum(0);
    }
    if (need[0] || need[1] || need[2]) {
      at::Tensor dpre = act_backward(mka::input_grad(g, w2, transposed), pre, activation);
      pre.reset();
      if (need[1]) {
        const auto [a, b] = mka::weight_grad_operands(dpre, x2, transposed);
        dw1 = mka::weight_grad(w1, a, b);
      }
      if (need[2]) {
        db1 = dpre.sum(0);
      }
      if (need[0]) {
        const int64_t in_features = transposed ? w1.size(0) : w1.size(1);
        dx = mka::input_grad(dpre, w1, transposed)
                 .view(mka::with_last(grad_out.sizes(), in_features));
      }
    }
    return {dx, dw1, db1, dw2, db2, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor mlp_autograd(const at::Tensor& x, const at::Tensor& w1,
                        const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                        const std::optional<at::Tensor>& b2, c10::string_view activation,
                        c10::string_view recompute, bool transposed,
                        const std::optional<at::Tensor>& norm_x,
                        const std::optional<at::Tensor>& norm_weight,
                        const std::optional<at::Tensor>& norm_bias, int64_t norm_kind,
                        int64_t norm_dims, double norm_eps) {
  return MLPFunction::apply(
      x, w1, b1, w2, b2, std::string(activation), parse_recompute(recompute), transposed,
      NormRecipe{norm_x, norm_weight, norm_bias, norm_kind, norm_dims, norm_eps});
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
