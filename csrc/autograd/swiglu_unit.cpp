// memkern::swiglu_unit_layer: SwiGLU's gated unit h = silu(gate) * up on its own, with its
// autograd in C++ (a torch::autograd::Node, node.h): the layer of a SwiGLU MLP whose three
// projections are called as layers rather than read by the fused swiglu_layer (swiglu.cpp) —
// LoRA-adapted projections (lora.cpp), or layers a hook watches.
//
// Saves gate and up (what its gradient needs, memkern::swiglu_backward), never h; in eager mode
// its output carries a recipe (saved_input.h, kSwiGLUUnit) naming gate and up, so the layer
// consuming h (the down projection: memkern's Linear, or a LoRA adapter) saves those — storage
// kept here anyway — instead of h, and rebuilds h in backward by the same kernel, bit for bit.
// gate and up: one shape and dtype (made contiguous); 16-bit values are computed in float32
// and rounded once (memkern/ops/swiglu.py).
//
// At the end of the file: the layer's eager entry from Python, memkern._C.swiglu_unit_layer
// (python_entry.h).
#include "swiglu_unit.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

#include "node.h"
#include "python_entry.h"

namespace memkern::autograd {

at::Tensor swiglu_unit(const at::Tensor& gate, const at::Tensor& up) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memkern::swiglu_forward", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(gate, up);
}

}  // namespace memkern::autograd

namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The backward of one call; its inputs (next edges) are gate and up.
struct SwiGLUUnitBackward : public torch::autograd::Node {
  SavedVariable gate, up;

  variable_list apply(variable_list&& grads) override {
    memkern::autograd::check_not_double_backward("SwiGLU unit");
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor()};
    }
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("memkern::swiglu_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&)>();
    auto [grad_gate, grad_up] = op.call(grads[0].contiguous(), gate.unpack(), up.unpack());
    return {grad_gate, grad_up};
  }

  void release_variables() override {
    gate.reset_data();
    up.reset_data();
  }

  std::string name() const override { return "memkern::SwiGLUUnitBackward"; }
};

at::Tensor swiglu_unit_autograd(const at::Tensor& gate, const at::Tensor& up) {
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = memkern::autograd::swiglu_unit(g, u);
  }
  if (torch::autograd::compute_requires_grad(gate, up)) {
    auto node = memkern::autograd::make_node<SwiGLUUnitBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(gate, up));
    node->gate = SavedVariable(g, /*is_output=*/false);
    node->up = SavedVariable(u, /*is_output=*/false);
    torch::autograd::set_history(out, node);
  }
  return out;
}

at::Tensor swiglu_unit_forward(const at::Tensor& gate, const at::Tensor& up) {
  return memkern::autograd::swiglu_unit(gate.contiguous(), up.contiguous());
}

}  // namespace

// The schema is defined in memkern/ops/swiglu_unit_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("swiglu_unit_layer", swiglu_unit_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("swiglu_unit_layer", swiglu_unit_forward);
}

// The layer's eager entry from Python, memkern._C.swiglu_unit_layer (python_entry.h).
namespace memkern::autograd {
namespace {

namespace py = pybind11;

// memkern.nn.functional.swiglu_unit in eager mode: memkern::swiglu_unit_layer, its output
// carrying the unit's recipe (gate, up) when it requires grad; None for a call that function
// refuses with its error (not two tensors of one shape, dtype and device, floating point).
py::object swiglu_unit_layer(py::handle gate_obj, py::handle up_obj) {
  const at::Tensor* gate = as_tensor(gate_obj);
  const at::Tensor* up = as_tensor(up_obj);
  if (gate == nullptr || up == nullptr || gate->sizes() != up->sizes() ||
      gate->scalar_type() != up->scalar_type() || gate->device() != up->device() ||
      !gate->is_floating_point()) {
    return py::none();
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memkern::swiglu_unit_layer", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  at::Tensor h = op.call(*gate, *up);
  // the recipe names gate and up as the node saved them: contiguous, the same tensors when
  // they were (a copy made here would be freed, and the recipe with it)
  if (!gate->is_contiguous() || !up->is_contiguous()) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(h)));
  }
  return with_recipe(std::move(h), *gate, *up, std::nullopt, kSwiGLUUnit, 0, 0.0);
}

}  // namespace

void add_swiglu_unit_entries(py::module_& m) {
  m.def("swiglu_unit_layer", &swiglu_unit_layer, py::arg("gate"), py::arg("up"),
        "memkern.nn.functional.swiglu_unit's eager call: memkern::swiglu_unit_layer, its output "
        "carrying the unit's recipe; None for a call that function refuses with its error.");
}

}  // namespace memkern::autograd
