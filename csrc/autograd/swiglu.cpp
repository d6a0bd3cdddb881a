// memkern::swiglu_layer: the autograd of memkern's SwiGLU MLP down(silu(gate(x)) * up(x)) in
// C++ (torch::autograd::Function), so a layer call costs on the host what torch's composition
// of C++ autograd nodes does: no Python autograd.Function per call.
//
// What it computes, saves and recomputes is memkern.nn.functional.swiglu's SwiGLUFunction for
// one dtype and no autocast (the Python functional routes only those calls here): per
// recompute, "none" saves x, gate(x), up(x) and h; "activation" x, gate and up; "full" x only —
// x being the norm's recipe when it is a memkern norm's output (saved_input.h) — and the
// weights (and the gate/up biases, for "full"). The gated unit and its gradient run as
// memkern::swiglu_forward / swiglu_backward through the dispatcher; weight gradients are added
// straight into .grad when that gives exactly what autograd would (weight_grad.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

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

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memkern::swiglu_forward", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(gate, up);
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                   const at::Tensor& up) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::swiglu_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&)>();
  return op.call(grad, gate, up);
}

bool keeps_gate_and_up(c10::string_view recompute) {
  TORCH_CHECK(recompute == "none" || recompute == "activation" || recompute == "full",
              "memkern::swiglu_layer: recompute='", recompute,
              "' is not one of ('none', 'activation', 'full')");
  return recompute != "full";
}

at::Tensor forward_only(const at::Tensor& x, const at::Tensor& wg,
                        const std::optional<at::Tensor>& bg, const at::Tensor& wu,
                        const std::optional<at::Tensor>& bu, const at::Tensor& wd,
                        const std::optional<at::Tensor>& bd) {
  const at::Tensor x2 = mka::rows(x);
  const at::Tensor h = swiglu_forward(mka::layer_mm(x2, wg, bg, false),
                                      mka::layer_mm(x2, wu, bu, false));
  const at::Tensor out = mka::layer_mm(h, wd, bd, false);
  return out.view(mka::with_last(x.sizes(), out.size(-1)));
}

// Slots of save_for_backward after the saved input.
constexpr size_t kGate = mka::kSavedInputSlots, kUp = kGate + 1, kH = kGate + 2, kWg = kGate + 3,
                 kBg = kGate + 4, kWu = kGate + 5, kBu = kGate + 6, kWd = kGate + 7;

struct SwiGLUFunction : public torch::autograd::Function<SwiGLUFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& wg,
                            const std::optional<at::Tensor>& bg, const at::Tensor& wu,
                            const std::optional<at::Tensor>& bu, const at::Tensor& wd,
                            const std::optional<at::Tensor>& bd, bool keep_gate_and_up,
                            bool keep_h, const NormRecipe& recipe) {
    const at::Tensor x2 = mka::rows(x);
    const at::Tensor gate = mka::layer_mm(x2, wg, bg, false);
    const at::Tensor up = mka::layer_mm(x2, wu, bu, false);
    const at::Tensor h = swiglu_forward(gate, up);
    const at::Tensor out = mka::layer_mm(h, wd, bd, false);
    std::vector<at::Tensor> to_save;
    mka::save_input(ctx, to_save, x, recipe);
    to_save.insert(to_save.end(),
                   {keep_gate_and_up ? gate : at::Tensor(), keep_gate_and_up ? up : at::Tensor(),
                    keep_h ? h : at::Tensor(), wg, bg.value_or(at::Tensor()), wu,
                    bu.value_or(at::Tensor()), wd});
    ctx->save_for_backward(to_save);
    ctx->saved_data["has_bd"] = bd.has_value() && bd->defined();
    return out.view(mka::with_last(x.sizes(), out.size(-1)));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    mka::check_not_double_backward("SwiGLU");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& wg = saved[kWg];
    const at::Tensor& wu = saved[kWu];
    const at::Tensor& wd = saved[kWd];
    // x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias
    const auto need = mka::needs_input_grad<7>(
        ctx, {true, true, saved[kBg].defined(), true, saved[kBu].defined(), true,
              ctx->saved_data["has_bd"].toBool()});
    const at::Tensor& grad_out = grad_outputs[0];
    const at::Tensor g = mka::rows(grad_out);
    at::Tensor gate = saved[kGate];
    at::Tensor up = saved[kUp];
    at::Tensor h = saved[kH];
    at::Tensor x2;  // rebuilt only where needed: the input GEMMs again, or their weight gradients
    if (!gate.defined() || need[1] || need[3]) {
      x2 = mka::rows(mka::load_input(ctx, saved));
    }
    if (!gate.defined()) {  // "full": both GEMMs again
      gate = mka::layer_mm(x2, wg, saved[kBg], false);
      up = mka::layer_mm(x2, wu, saved[kBu], false);
    }
    at::Tensor dx, dwg, dbg, dwu, dbu, dwd, dbd;
    if (need[5]) {
      if (!h.defined()) {  // the gated unit again
        h = swiglu_forward(gate, up);
      }
      dwd = mka::weight_grad(wd, g.t(), h);
    }
    h.reset();
    if (need[6]) {
      dbd = g.sum(0);
    }
    if (need[0] || need[1] || need[2] || need[3] || need[4]) {
      auto [dgate, dup] = swiglu_backward(at::mm(g, wd), gate, up);
      gate.reset();
      up.reset();
      if (need[1]) {
        dwg = mka::weight_grad(wg, dgate.t(), x2);
      }
      if (need[2]) {
        dbg = dgate.sum(0);
      }
      if (need[3]) {
        dwu = mka::weight_grad(wu, dup.t(), x2);
      }
      if (need[4]) {
        dbu = dup.sum(0);
      }
      if (need[0]) {
        dx = at::mm(dgate, wg);
        dx.addmm_(dup, wu);
        dx = dx.view(mka::with_last(grad_out.sizes(), wg.size(1)));
      }
    }
    return {dx,          dwg,         dbg,         dwu,         dbu, dwd,
            dbd,         at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor swiglu_autograd(const at::Tensor& x, const at::Tensor& wg,
                           const std::optional<at::Tensor>& bg, const at::Tensor& wu,
                           const std::optional<at::Tensor>& bu, const at::Tensor& wd,
                           const std::optional<at::Tensor>& bd, c10::string_view recompute,
                           const std::optional<at::Tensor>& norm_x,
                           const std::optional<at::Tensor>& norm_weight,
                           const std::optional<at::Tensor>& norm_bias, int64_t norm_kind,
                           int64_t norm_dims, double norm_eps) {
  return SwiGLUFunction::apply(
      x, wg, bg, wu, bu, wd, bd, keeps_gate_and_up(recompute), recompute == "none",
      NormRecipe{norm_x, norm_weight, norm_bias, norm_kind, norm_dims, norm_eps});
}

at::Tensor swiglu_no_autograd(const at::Tensor& x, const at::Tensor& wg,
                              const std::optional<at::Tensor>& bg, const at::Tensor& wu,
                              const std::optional<at::Tensor>& bu, const at::Tensor& wd,
                              const std::optional<at::Tensor>& bd, c10::string_view,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, int64_t, int64_t, double) {
  return forward_only(x, wg, bg, wu, bu, wd, bd);
}

}  // namespace

// The schema is defined in memkern/ops/swiglu_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("swiglu_layer", swiglu_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("swiglu_layer", swiglu_no_autograd);
}
