// See weight_grad.h.
#include "weight_grad.h"

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <mutex>
#include <tuple>

namespace memkern::autograd {
namespace {

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

// Whether anything watches the weight's AccumulateGrad node run: a hook on the node (pre or
// post: DDP's reducer adds one) or one run after accumulation
// (register_post_accumulate_grad_hook: memkern's GradBuffer and ShardedOptimizer, FSDP).
bool accumulation_watched(const at::Tensor& weight) {
  auto node = torch::autograd::impl::try_get_grad_accumulator(weight);
  return torch::autograd::impl::post_acc_grad_hooks(weight) != nullptr ||
         (node && (!node->pre_hooks().empty() || !node->post_hooks().empty()));
}

// One read-only zero per dtype and device: a fresh one would be a fill launch per call.
// Never freed (a static destructor could run after the CUDA context is gone). Under a Python
// dispatch mode (FakeTensorMode: memkern.profile's planner) or for a tensor subclass the zero
// is made fresh: a cached one would belong to another mode, or be real among fake tensors.
at::Tensor cached_zero(const at::Tensor& like) {
  const at::TensorOptions options = like.options();
  if (like.key_set().has(c10::DispatchKey::Python) ||
      c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return at::zeros({}, options);
  }
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

}  // namespace

at::Tensor weight_grad(const at::Tensor& weight, const at::Tensor& a, const at::Tensor& b) {
  at::Tensor grad = accumulable_grad(weight, a);
  if (!grad.defined()) {
    return at::mm(a, b);
  }
  grad.addmm_(a, b);
  if (!accumulation_watched(weight)) {
    return {};  // the engine skips the node: no `grad += 0` pass over the gradient
  }
  return cached_zero(weight).expand(grad.sizes());  // in the weight's dtype: no cast
}

}  // namespace memkern::autograd
