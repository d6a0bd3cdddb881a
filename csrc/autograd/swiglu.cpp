// memkern::swiglu_layer: memkern's SwiGLU MLP down(silu(gate(x)) * up(x)) with its autograd in
// C++ (a torch::autograd::Node, node.h), the layer's one implementation: eager calls run it,
// and torch.compile traces it into its inner ops.
//
// Computed in autocast's dtype when autocast is on for x's device (x, the weights and the
// biases cast to it first, as torch's linear does), else in x's. Per recompute, "none" saves
// x, gate(x), up(x) and h; "activation" x, gate and up; "full" x only — x as cast, or the
// norm's recipe when x is a memkern norm's output of the compute dtype (saved_input.h) — and
// the weights themselves (and the gate/up biases, for "full"): under autocast their
// low-precision copies are made again in backward rather than kept. What backward runs again
// is swiglu_recomputed_ops. The gated unit and its gradient run as memkern::swiglu_forward /
// swiglu_backward through the dispatcher; weight gradients are added straight into .grad when
// that gives exactly what autograd would (weight_grad.h); the engine casts each gradient to its
// input's dtype.
//
// At the end of the file: the layer's eager entry from Python, memkern._C.swiglu_layer
// (python_entry.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

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

constexpr const char* kSwigluForward = "memkern::swiglu_forward";

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(kSwigluForward, "")
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

// The forward's tensors: x in the compute dtype, gate(x), up(x), the gated unit, the output.
struct Forward {
  at::Tensor xc, gate, up, h, out;
};

Forward forward(const at::Tensor& x, const at::Tensor& wg, const std::optional<at::Tensor>& bg,
                const at::Tensor& wu, const std::optional<at::Tensor>& bu, const at::Tensor& wd,
                const std::optional<at::Tensor>& bd) {
  const at::ScalarType dtype = mka::compute_dtype(x);
  Forward f;
  f.xc = mka::cast(x, dtype);
  const at::Tensor x2 = mka::rows(f.xc);
  f.gate = mka::layer_mm(x2, mka::cast(wg, dtype), mka::cast(bg, dtype), false);
  f.up = mka::layer_mm(x2, mka::cast(wu, dtype), mka::cast(bu, dtype), false);
  f.h = swiglu_forward(f.gate, f.up);
  const at::Tensor out = mka::layer_mm(f.h, mka::cast(wd, dtype), mka::cast(bd, dtype), false);
  f.out = out.view(mka::with_last(x.sizes(), out.size(-1)));
  return f;
}

// The backward of one call; its inputs (next edges) are x, gate_weight, gate_bias, up_weight,
// up_bias, down_weight, down_bias.
struct SwiGLUBackward : public torch::autograd::Node {
  mka::SavedInput input;
  SavedVariable gate, up, h;  // gate, up: not for "full"; h: "none" only
  SavedVariable wg, bg, wu, bu, wd;
  at::ScalarType dtype = at::kFloat;  // the compute dtype
  bool has_bd = false;

  variable_list apply(variable_list&& grads) override {
    mka::check_not_double_backward("SwiGLU");
    variable_list out(7);
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return out;
    }
    const at::Tensor wg_stored = wg.unpack();
    const at::Tensor wu_stored = wu.unpack();
    const at::Tensor wd_stored = wd.unpack();
    const at::Tensor wg_ = mka::cast(wg_stored, dtype);
    const at::Tensor wu_ = mka::cast(wu_stored, dtype);
    const at::Tensor wd_ = mka::cast(wd_stored, dtype);
    // x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias
    bool need[7];
    for (size_t i = 0; i < 7; ++i) {
      need[i] = task_should_compute_output(i);
    }
    need[6] = need[6] && has_bd;
    const at::Tensor g = mka::rows(mka::cast(grad_out, dtype));
    at::Tensor gate_ = gate.unpack();
    at::Tensor up_ = up.unpack();
    at::Tensor h_ = h.unpack();
    at::Tensor x2;  // rebuilt only where needed: the input GEMMs again, or their weight gradients
    if (!gate_.defined() || need[1] || need[3]) {
      x2 = mka::rows(input.load());
    }
    if (!gate_.defined()) {  // "full": both GEMMs again
      gate_ = mka::layer_mm(x2, wg_, mka::cast(bg.unpack(), dtype), false);
      up_ = mka::layer_mm(x2, wu_, mka::cast(bu.unpack(), dtype), false);
    }
    if (need[5]) {
      if (!h_.defined()) {  // the gated unit again
        h_ = swiglu_forward(gate_, up_);
      }
      out[5] = mka::weight_grad(wd_stored, g.t(), h_);
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
        out[1] = mka::weight_grad(wg_stored, dgate.t(), x2);
      }
      if (need[2]) {
        out[2] = dgate.sum(0);
      }
      if (need[3]) {
        out[3] = mka::weight_grad(wu_stored, dup.t(), x2);
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
  Forward f;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    f = forward(x, wg, bg, wu, bu, wd, bd);
  }
  const at::Tensor bg_ = bg.value_or(at::Tensor());
  const at::Tensor bu_ = bu.value_or(at::Tensor());
  const at::Tensor bd_ = bd.value_or(at::Tensor());
  if (torch::autograd::compute_requires_grad(x, wg, bg_, wu, bu_, wd, bd_)) {
    auto node = mka::make_node<SwiGLUBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, wg, bg_, wu, bu_, wd, bd_));
    // a cast x is not the norm's output: the recipe cannot rebuild it
    node->input.save(f.xc, f.xc.is_same(x) ? NormRecipe{norm_x, norm_weight, norm_bias,
                                                        norm_kind, norm_dims, norm_eps}
                                           : NormRecipe{});
    const bool keep_gate_and_up = keep != memkern::kFull;
    node->gate = SavedVariable(keep_gate_and_up ? f.gate : at::Tensor(), false);
    node->up = SavedVariable(keep_gate_and_up ? f.up : at::Tensor(), false);
    node->h = SavedVariable(keep == memkern::kNone ? f.h : at::Tensor(), false);
    node->wg = SavedVariable(wg, false);
    node->bg = SavedVariable(bg_, false);
    node->wu = SavedVariable(wu, false);
    node->bu = SavedVariable(bu_, false);
    node->wd = SavedVariable(wd, false);
    node->dtype = f.xc.scalar_type();
    node->has_bd = bd_.defined();
    torch::autograd::set_history(f.out, node);
  }
  return f.out;
}

at::Tensor swiglu_no_autograd(const at::Tensor& x, const at::Tensor& wg,
                              const std::optional<at::Tensor>& bg, const at::Tensor& wu,
                              const std::optional<at::Tensor>& bu, const at::Tensor& wd,
                              const std::optional<at::Tensor>& bd, c10::string_view,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, int64_t, int64_t, double) {
  return forward(x, wg, bg, wu, bu, wd, bd).out;
}

}  // namespace

namespace memkern::autograd {

// SwiGLUBackward's recomputation: the gated unit is memkern::swiglu_forward.
std::vector<const char*> swiglu_recomputed_ops(Recompute recompute) {
  return gemm_layer_recomputed_ops(recompute, kSwigluForward);
}

}  // namespace memkern::autograd

// The schema is defined in memkern/ops/swiglu_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("swiglu_layer", swiglu_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("swiglu_layer", swiglu_no_autograd);
}

// The layer's eager entry from Python, memkern._C.swiglu_layer (python_entry.h).
namespace memkern::autograd {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

// memkern.nn.functional.swiglu in eager mode: memkern::swiglu_layer with x's norm recipe, or
// None for a call that function refuses with its error (gemm_input).
OptTensor swiglu_layer(py::handle x_obj, const at::Tensor& gate_weight, const OptTensor& gate_bias,
                 const at::Tensor& up_weight, const OptTensor& up_bias,
                 const at::Tensor& down_weight, const OptTensor& down_bias,
                 const std::string& recompute) {
  const auto in = gemm_input(
      x_obj, {{&gate_weight, &gate_bias}, {&up_weight, &up_bias}, {&down_weight, &down_bias}}, 1);
  if (!in) {
    return std::nullopt;
  }
  const NormRecipe& recipe = in->recipe;
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::swiglu_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const at::Tensor&, const OptTensor&, const at::Tensor&,
                            const OptTensor&, c10::string_view, const OptTensor&,
                            const OptTensor&, const OptTensor&, int64_t, int64_t, double)>();
  return op.call(in->x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias,
                 recompute, recipe.x, recipe.weight, recipe.bias, recipe.kind, recipe.dims,
                 recipe.eps);
}

}  // namespace

void add_swiglu_entries(py::module_& m) {
  m.def("swiglu_layer", &swiglu_layer, py::arg("x"), py::arg("gate_weight"), py::arg("gate_bias"),
        py::arg("up_weight"), py::arg("up_bias"), py::arg("down_weight"), py::arg("down_bias"),
        py::arg("recompute"),
        "memkern.nn.functional.swiglu's eager call: memkern::swiglu_layer with x's norm "
        "recipe, or None for a call that function refuses with its error.");
}

}  // namespace memkern::autograd
