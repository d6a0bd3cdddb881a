// memkern::linear: the autograd of memkern's Linear in C++ (torch::autograd::Function), so a
// layer call costs what nn.Linear's does on the host: no Python autograd.Function per call.
//
// What it computes and saves is memkern.nn.functional.linear's LinearFunction for one dtype and
// no autocast (the Python module routes only those calls here): out = x @ W^T + b (x @ W + b
// with transposed = true, GPT-2's Conv1D); saves x (when W needs a gradient) and W. In
// backward the weight gradient is added straight into W.grad (addmm_, beta = 1: no transient
// dW) when that gives exactly what autograd would — see accumulable_grad — and the function
// then returns a zero-stride zero, so W's AccumulateGrad node and its hooks still run.
// Device-generic: only ATen ops, registered for the Autograd dispatch key.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <optional>
#include <tuple>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether the running backward will execute `weight`'s AccumulateGrad node (not so under
// torch.autograd.grad, or backward(inputs=...) leaving the weight out). torch has no public
// query; these graph-task accessors are what its Python torch._C._will_engine_execute_node
// (used by torch.utils.checkpoint) reads, and this is the one place memkern uses them.
bool engine_will_accumulate(const at::Tensor& weight) {
  auto node = torch::autograd::impl::try_get_grad_accumulator(weight);
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (!node || exec_info == nullptr || nodes == nullptr || !nodes->count(node.get())) {
    return false;
  }
  if (exec_info->empty()) {  // a plain backward(): every node in the graph runs
    return true;
  }
  auto it = exec_info->find(node.get());
  // captures_: torch.autograd.grad returns this gradient instead of accumulating it.
  return it != exec_info->end() && it->second.should_execute() && !it->second.captures_;
}

// weight.grad when adding the gradient into it in place is exactly what autograd would do:
// it exists as a dense contiguous tensor of the weight's shape, dtype and device that does
// not require grad; the backward builds no graph (create_graph); no tensor hook would see
// (and may change) the gradient first; the engine accumulates into this weight at all.
// Otherwise an undefined tensor (the gradient is returned to autograd as nn.Linear's is).
at::Tensor accumulable_grad(const at::Tensor& weight, const at::Tensor& like) {
  if (at::GradMode::is_enabled() || !weight.is_leaf() || !weight.requires_grad()) {
    return {};
  }
  const at::Tensor& grad = weight.grad();
  if (!grad.defined() || grad.layout() != at::kStrided || grad.requires_grad() ||
      grad.scalar_type() != like.scalar_type() || grad.device() != like.device() ||
      grad.sizes() != weight.sizes() || !grad.is_contiguous()) {
    return {};
  }
  auto node = torch::autograd::impl::try_get_grad_accumulator(weight);
  if (!torch::autograd::impl::hooks(weight).empty() ||
      (node && !node->tensor_pre_hooks().empty()) || !engine_will_accumulate(weight)) {
    return {};
  }
  return grad;
}

// One read-only zero per dtype and device: a fresh one would be a fill launch per call.
// Never freed (a static destructor could run after the CUDA context is gone).
const at::Tensor& cached_zero(const at::TensorOptions& options) {
  static auto* zeros = new std::map<std::tuple<int, int, int>, at::Tensor>();
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_tuple(static_cast<int>(options.dtype().toScalarType()),
                             static_cast<int>(options.device().type()),
                             static_cast<int>(options.device().index()));
  auto it = zeros->find(key);
  if (it == zeros->end()) {
    it = zeros->emplace(key, at::zeros({}, options)).first;
  }
  return it->second;
}

std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

at::Tensor forward_only(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, bool transposed) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  const at::Tensor w = transposed ? weight : weight.t();
  at::Tensor out = bias.has_value() && bias->defined() ? at::addmm(*bias, x2, w) : at::mm(x2, w);
  return out.view(with_last(x.sizes(), out.size(-1)));
}

struct LinearFunction : public torch::autograd::Function<LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool transposed) {
    ctx->save_for_backward({weight.requires_grad() ? x : at::Tensor(), weight});
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return forward_only(x, weight, bias, transposed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const bool transposed = ctx->saved_data["transposed"].toBool();
    const at::Tensor& grad_out = grad_outputs[0];
    const at::Tensor g = grad_out.reshape({-1, grad_out.size(-1)});
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      const int64_t in_features = transposed ? weight.size(0) : weight.size(1);
      dx = at::mm(g, transposed ? weight.t() : weight).view(with_last(grad_out.sizes(), in_features));
    }
    if (ctx->needs_input_grad(1)) {
      const at::Tensor x2 = x.reshape({-1, x.size(-1)});
      const at::Tensor a = transposed ? x2.t() : g.t();
      const at::Tensor b = transposed ? g : x2;
      at::Tensor grad = accumulable_grad(weight, g);
      if (grad.defined()) {
        grad.addmm_(a, b);
        dw = cached_zero(grad.options()).expand(grad.sizes());
      } else {
        dw = at::mm(a, b);
      }
    }
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      db = g.sum(0);
    }
    return {dx, dw, db, at::Tensor()};
  }
};

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, bool transposed) {
  return LinearFunction::apply(x, weight, bias, transposed);
}

}  // namespace

// The schema is defined in memkern/ops/linear.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("linear", linear_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) { m.impl("linear", forward_only); }
