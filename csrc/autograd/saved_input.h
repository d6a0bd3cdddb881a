// The input a GEMM layer's C++ autograd (linear.cpp, mlp.cpp, swiglu.cpp) saves for backward:
// the tensor itself, or — when it is a memkern norm's output — the norm's *recipe*: its input
// and parameters (storage the norm saved anyway) plus which norm, how many trailing dimensions
// it normalises and its eps, from which backward rebuilds the output bit for bit. This is the
// C++ side of memkern/nn/functional/_saved.py: the Python caller checks that the recipe is
// still valid (no tensor freed or modified in place since) and passes it as the ops'
// norm_* arguments (memkern/ops/_norm_recipe.py), or none.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <optional>
#include <vector>

namespace memkern::autograd {

// The norm_kind argument; the values of memkern/ops/_norm_recipe.py.
enum NormKind : int64_t {
  kNoNorm = 0,           // the input is saved itself
  kNativeLayerNorm = 1,  // at::native_layer_norm (torch's LayerNorm)
  kLayerNorm = 2,        // memkern::norm_forward, rms = false
  kRmsNorm = 3,          // memkern::norm_forward, rms = true
};

// How to rebuild the layer input from the norm's tensors (a non-tensor argument of
// Function::apply, so its tensors are not inputs of the layer's autograd node).
struct NormRecipe {
  std::optional<at::Tensor> x, weight, bias;
  int64_t kind = kNoNorm;
  int64_t dims = 0;  // normalised trailing dimensions of x
  double eps = 0.0;
};

// Number of save_for_backward slots the saved input takes (first, in every layer).
constexpr size_t kSavedInputSlots = 3;

// Appends the kSavedInputSlots tensors that stand for `input` to `to_save` (undefined ones
// when `input` is undefined: not needed in backward) and records the recipe in `ctx`.
void save_input(torch::autograd::AutogradContext* ctx, std::vector<at::Tensor>& to_save,
                const at::Tensor& input, const NormRecipe& recipe);

// The saved input, from saved[0 .. kSavedInputSlots): the tensor, or the norm's output rebuilt
// (without building a graph) by the op the norm ran.
at::Tensor load_input(torch::autograd::AutogradContext* ctx,
                      const torch::autograd::variable_list& saved);

// The same for a layer whose autograd is a torch::autograd::Node (node.h): the saved tensors
// and the recipe are members of the node.
class SavedInput {
 public:
  // Saves `input` (undefined: nothing, it is not needed in backward) or, when `recipe` has a
  // norm, the norm's tensors and the recipe.
  void save(const at::Tensor& input, const NormRecipe& recipe);
  // The saved input, or the norm's output rebuilt (without building a graph).
  at::Tensor load() const;
  // Frees the saved tensors (Node::release_variables, once backward has run).
  void release();

 private:
  torch::autograd::SavedVariable x_, weight_, bias_;
  int64_t kind_ = kNoNorm;
  int64_t dims_ = 0;
  double eps_ = 0.0;
};

}  // namespace memkern::autograd
