// memkern's C++ autograd nodes are torch::autograd::Node subclasses, made the way torch's own
// generated nodes (e.g. AddmmBackward0) are: collect_next_edges, SavedVariable, set_history.
// Why not torch::autograd::Function, the documented extension API: its per-call bookkeeping
// (a context with a string-keyed map, per-input and per-output metadata, a lock in backward)
// made a layer call cost more host time than the torch layer it replaces (a Linear forward +
// backward on an [8, 64] input: Function 141 us, Node 127 us, F.linear 131 us; benchmarks/NOTES.md).
// These are the autograd engine's C++ interfaces, which torch's codegen and its C++ frontend
// use; the one thing that has changed across releases is the node pointer type
// (std::shared_ptr<Node>, c10::intrusive_ptr<Node> in newer torch), which make_node hides.
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <type_traits>

namespace memkern::autograd {

// A new node of type T, held by the pointer type torch's graph edges use.
template <typename T>
auto make_node() {
  using NodePtr = decltype(torch::autograd::Edge::function);
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

// A backward that builds a graph (create_graph=True) is refused, as torch's
// @once_differentiable refuses it: these backwards add into .grad in place and return
// gradients that are not differentiable.
inline void check_not_double_backward(const char* layer) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "memkern ", layer,
              ": backward with create_graph=True (double backward) is not supported; compute "
              "higher-order gradients with the torch layer instead");
}

}  // namespace memkern::autograd
