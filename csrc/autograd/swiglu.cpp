// memkern::swiglu_layer: the autograd of memkern's SwiGLU MLP down(silu(gate(x)) * up(x)) in
// C++ (a torch::autograd::Node, node.h), so a layer call costs on the host what torch's
// composition of C++ autograd nodes does: no Python autograd.Function per call.
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
#include <torch/library.h>

#include <optional>
#include <tuple>

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

// The backward of one call; its inputs (next edges) are x, gate_weight, gate_bias, up_weight,
// up_bias, down_weight, down_bias.
struct SwiGLUBackward : public torch::autograd::Node {
  mka::SavedInput input;
  SavedVariable gate, up, h;  // gate, up: not for "full"; h: "none" only
  SavedVariable wg, bg, wu, bu, wd;
  bool has_bd = false;

  variable_list apply(variable_list&& grads) override {
    mka::check_not_double_backward("SwiGLU");
    variable_list out(7);
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return out;
    }
    const at::Tensor wg_ = wg.unpack();
    const at::Tensor wu_ = wu.unpack();
    const at::Tensor wd_ = wd.unpack();
    // x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias
    bool need[7];
    for (size_t i = 0; i < 7; ++i) {
      need[i] = task_should_compute_output(i);
    }
    need[6] = need[6] && has_bd;
    const at::Tensor g = mka::rows(grad_out);
    at::Tensor gate_ = gate.unpack();
    at::Tensor up_ = up.unpack();
    at::Tensor h_ = h.unpack();
    at::Tensor x2;  // rebuilt only where needed: the input GEMMs again, or their weight gradients
    if (!gate_.defined() || need[1] || need[3]) {
      x2 = mka::rows(input.load());
    }
    if (!gate_.defined()) {  // "full": both GEMMs again
      gate_ = mka::layer_mm(x2, wg_, bg.unpack(), false);
      up_ = mka::layer_mm(x2, wu_, bu.unpack(), false);
    }
    if (need[5]) {
      if (!h_.defined()) {  // the gated unit again
        h_ = swiglu_forward(gate_, up_);
      }
      out[5] = mka::weight_grad(wd_, g.t(), h_);
    }
    h_.reset();
    if (need[6]) {
      out[6] = g.sum(0);
    }
    if (need[0] || need[1] || need[2] || need[3] || need[4]) {
      auto [dgate, dup] = swiglu_backward(at::mm(g, wd_), gate_, up_);
      gate_.reset();
      up_.reset();
      if (need[1]) {
        out[1] = mka::weight_grad(wg_, dgate.t(), x2);
      }
      if (need[2]) {
        out[2] = dgate.sum(0);
      }
      if (need[3]) {
        out[3] = mka::weight_grad(wu_, dup.t(), x2);
      }
      if (need[4]) {
        out[4] = dup.sum(0);
      }
      if (need[0]) {
        at::Tensor dx = at::mm(dgate, wg_);
        dx.addmm_(dup, wu_);
        out[0] = dx.view(mka::with_last(grad_out.sizes(), wg_.size(1)));
      }
    }
    return out;
  }

  void release_variables() override {
    input.release();
    for (SavedVariable* t : {&gate, &up, &h, &wg, &bg, &wu, &bu, &wd}) {
      t->reset_data();
    }
  }

  std::string name() const override { return "memkern::SwiGLUBackward"; }
};

at::Tensor swiglu_autograd(const at::Tensor& x, const at::Tensor& wg,
                           const std::optional<at::Tensor>& bg, const at::Tensor& wu,
                           const std::optional<at::Tensor>& bu, const at::Tensor& wd,
                           const std::optional<at::Tensor>& bd, c10::string_view recompute,
                           const std::optional<at::Tensor>& norm_x,
                           const std::optional<at::Tensor>& norm_weight,
                           const std::optional<at::Tensor>& norm_bias, int64_t norm_kind,
                           int64_t norm_dims, double norm_eps) {
  const memkern::Recompute keep = memkern::parse_recompute("swiglu_layer", recompute);
  at::Tensor gate, up, h, out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor x2 = mka::rows(x);
    gate = mka::layer_mm(x2, wg, bg, false);
    up = mka::layer_mm(x2, wu, bu, false);
    h = swiglu_forward(gate, up);
    out = mka::layer_mm(h, wd, bd, false);
    out = out.view(mka::with_last(x.sizes(), out.size(-1)));
  }
  const at::Tensor bg_ = bg.value_or(at::Tensor());
  const at::Tensor bu_ = bu.value_or(at::Tensor());
  const at::Tensor bd_ = bd.value_or(at::Tensor());
  if (torch::autograd::compute_requires_grad(x, wg, bg_, wu, bu_, wd, bd_)) {
    auto node = mka::make_node<SwiGLUBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, wg, bg_, wu, bu_, wd, bd_));
    node->input.save(x, NormRecipe{norm_x, norm_weight, norm_bias, norm_kind, norm_dims,
                                   norm_eps});
    const bool keep_gate_and_up = keep != memkern::kFull;
    node->gate = SavedVariable(keep_gate_and_up ? gate : at::Tensor(), false);
    node->up = SavedVariable(keep_gate_and_up ? up : at::Tensor(), false);
    node->h = SavedVariable(keep == memkern::kNone ? h : at::Tensor(), false);
    node->wg = SavedVariable(wg, false);
    node->bg = SavedVariable(bg_, false);
    node->wu = SavedVariable(wu, false);
    node->bu = SavedVariable(bu_, false);
    node->wd = SavedVariable(wd, false);
    node->has_bd = bd_.defined();
    torch::autograd::set_history(out, node);
  }
  return out;
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
