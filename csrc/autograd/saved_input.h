// The input a GEMM layer's C++ autograd (linear.cpp, mlp.cpp, swiglu.cpp, lora.cpp) saves for
// backward: the tensor itself, or — when it is a memkern norm's output — the norm's *recipe*:
// its input and parameters (storage the norm saved anyway) plus which norm, how many trailing
// dimensions it normalises and its eps, from which backward rebuilds the output bit for bit. The
// modulated LayerNorm of adaLN (modulated_norm.cpp) leaves one too: its per-sample scale and
// shift take the parameters' places; and so does SwiGLU's gated unit (swiglu_unit.cpp), the one
// producer that is not a norm: its gate and up, which it saves itself, take the input's and the
// weight's. The layer ops take it as their norm_* arguments
// (memkern/ops/_gemm_layer.py); in eager mode the layers' entry points (python_entry.h)
// find it on the input, as the WeakNormRecipe the norm's entry left there, and check it is
// still valid. (Under torch.compile tensors carry no recipe: there
// memkern/nn/_saved.py's compiled_region has the norm recomputed.)
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <optional>

namespace memkern::autograd {

// The norm_kind argument; the values of memkern/ops/_gemm_layer.py.
enum NormKind : int64_t {
  kNoNorm = 0,           // the input is saved itself
  kNativeLayerNorm = 1,  // at::native_layer_norm (torch's LayerNorm)
  kLayerNorm = 2,        // memkern::norm_forward, rms = false
  kRmsNorm = 3,          // memkern::norm_forward, rms = true
  // at::native_layer_norm without affine parameters over the last dimension, then
  // modulate(): weight = scale, bias = shift, both [batch, features] (modulated_norm.cpp)
  kModulatedLayerNorm = 4,
  // memkern::swiglu_forward(x, weight): SwiGLU's gated unit silu(gate) * up, x = gate,
  // weight = up (swiglu_unit.cpp); dims and eps unused
  kSwiGLUUnit = 5,
};

// How to rebuild the layer input from the norm's tensors (not inputs of the layer's autograd
// node: it saves them, it does not differentiate through them).
struct NormRecipe {
  std::optional<at::Tensor> x, weight, bias;
  int64_t kind = kNoNorm;
  int64_t dims = 0;  // normalised trailing dimensions of x
  double eps = 0.0;
};

// A per-sample scale or shift [batch, features] viewed to broadcast over a tensor [batch, ...,
// features] of `dim` dimensions.
at::Tensor per_sample_view(const at::Tensor& t, int64_t dim);

// adaLN's modulation of a normalised `normed` [batch, ..., features]: normed * (1 + scale) +
// shift, scale and shift [batch, features] (the two operations diffusers' blocks run, in their
// order). The modulated norm's forward and its recipe's rebuild both compute it here, so the
// rebuilt output is the forward's bit for bit.
at::Tensor modulate(const at::Tensor& normed, const at::Tensor& scale, const at::Tensor& shift);

// The norm's output rebuilt from its tensors (without building a graph) by the computation the
// norm ran (norm.h): torch's native_layer_norm (modulated, for the modulated LayerNorm), or
// memkern::norm_forward; the gated unit's, memkern::swiglu_forward.
at::Tensor rebuild_norm_output(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, int64_t kind, int64_t dims, double eps);

// A norm output's recipe as the norm leaves it for its consumers (python_entry.cpp attaches
// it to the output):
// weak references to the norm's tensors, which never keep them alive, and their version
// counters at the norm's call.
class WeakNormRecipe {
 public:
  WeakNormRecipe(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                 const std::optional<at::Tensor>& bias, int64_t kind, int64_t dims, double eps);
  // The recipe while none of the norm's tensors was freed or modified in place since; nullopt
  // otherwise. (The output itself must be unmodified too: the consumer checks that.)
  std::optional<NormRecipe> lock() const;
  int64_t kind() const { return kind_; }
  int64_t dims() const { return dims_; }
  double eps() const { return eps_; }

 private:
  struct Ref {
    // nullopt for an absent tensor (weak_intrusive_ptr has no empty state)
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> impl;
    int64_t version = 0;
  };
  static Ref ref(const at::Tensor& t);
  // The tensor while alive and unmodified, else nullopt; an absent one is an undefined tensor.
  static std::optional<at::Tensor> lock(const Ref& ref);

  Ref x_, weight_, bias_;
  int64_t kind_;
  int64_t dims_;
  double eps_;
};

// The saved input of a layer's autograd node (node.h), a member of the node.
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
