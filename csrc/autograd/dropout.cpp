// memkern::dropout_layer: mk.nn.Dropout's one autograd, in C++ (a torch::autograd::Node, node.h),
// for eager calls and torch.compile (which traces it), at the host cost of nn.Dropout's call.
//
// Forward draws an int64 seed in [0, kDropoutSeedHigh) from torch's generator of x's device
// (when none is given) and runs memkern::dropout; saves the seed only (8 bytes); backward runs
// memkern::dropout on the gradient with that seed, regenerating the forward's mask. memkern::dropout is called through
// the dispatcher: the C++ CPU kernel, or the CUDA one (csrc/cuda/dropout.cu), which reads the
// seed on the device — at::randint draws it there, so a call makes no host-device copy.
//
// At the end of the file: the layer's eager entry from Python, memkern._C.dropout_layer
// (python_entry.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "../layer_constants.h"
#include "dropout.h"
#include "node.h"
#include "python_entry.h"

namespace memkern::autograd {

at::Tensor dropout_with_seed(const at::Tensor& x, const at::Tensor& seed, double p) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memkern::dropout", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x.contiguous(), seed, p);
}

at::Tensor dropout_seed(const at::Tensor& x, const std::optional<at::Tensor>& seed) {
  if (seed.has_value() && seed->defined()) {
    return *seed;
  }
  return at::randint(0, memkern::kDropoutSeedHigh, {}, x.options().dtype(at::kLong));
}

}  // namespace memkern::autograd

namespace {

using memkern::autograd::dropout_seed;
using memkern::autograd::dropout_with_seed;
using torch::autograd::variable_list;

// The backward of one call; its one input (next edge) is x.
struct DropoutBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable seed;
  double p = 0.0;

  variable_list apply(variable_list&& grads) override {
    memkern::autograd::check_not_double_backward("Dropout");
    if (!grads[0].defined()) {
      return {at::Tensor()};
    }
    return {dropout_with_seed(grads[0], seed.unpack(), p)};
  }

  void release_variables() override { seed.reset_data(); }

  std::string name() const override { return "memkern::DropoutBackward"; }
};

at::Tensor dropout_layer_autograd(const at::Tensor& x, const std::optional<at::Tensor>& seed,
                                  double p) {
  const at::Tensor s = dropout_seed(x, seed);
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = dropout_with_seed(x, s, p);
  }
  if (torch::autograd::compute_requires_grad(x)) {
    auto node = memkern::autograd::make_node<DropoutBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->seed = torch::autograd::SavedVariable(s, /*is_output=*/false);
    node->p = p;
    torch::autograd::set_history(out, node);
  }
  return out;
}

at::Tensor dropout_layer_forward(const at::Tensor& x, const std::optional<at::Tensor>& seed,
                                 double p) {
  return dropout_with_seed(x, dropout_seed(x, seed), p);
}

}  // namespace

// The schema is defined in memkern/ops/dropout_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("dropout_layer", dropout_layer_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("dropout_layer", dropout_layer_forward);
}

// The layer's eager entry from Python, memkern._C.dropout_layer (python_entry.h).
namespace memkern::autograd {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

// memkern.nn.functional.dropout with a drawn seed: memkern::dropout_layer.
at::Tensor dropout_layer(const at::Tensor& x, double p) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::dropout_layer", "")
          .typed<at::Tensor(const at::Tensor&, const OptTensor&, double)>();
  return op.call(x, std::nullopt, p);
}

}  // namespace

void add_dropout_entries(py::module_& m) {
  m.def("dropout_layer", &dropout_layer, py::arg("x"), py::arg("p"),
        "memkern.nn.functional.dropout's eager call with a drawn seed: memkern::dropout_layer.");
}

}  // namespace memkern::autograd
