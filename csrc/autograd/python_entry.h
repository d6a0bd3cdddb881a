// What the layers' direct Python entries share (memkern._C.norm, .linear_layer, ...: each is
// defined in its layer's file here, beside the layer's autograd node, and added to memkern._C
// by that file's add_*_entries, declared below). An entry is called by memkern.nn in eager mode
// instead of torch.ops.memkern.<op>: a torch.ops call converts every argument to a boxed IValue
// against the schema and back (a layer op with a norm recipe has ten); a pybind11 function
// reaches the same op through a typed dispatcher handle, so the op, its autograd and its
// kernels are the ones torch.ops runs. Each entry also makes the checks that decide whether the
// op serves the call at all, which in Python cost more than the op's dispatch; where it does
// not, the entry returns None and the Python path takes the call.
#pragma once

// Before ATen: pybind11 declares its classes hidden (GCC visibility); c10/util/intrusive_ptr.h
// declares pybind11::class_ without that, and a py::class_ (NormRecipe's, python_entry.cpp,
// which includes this header first) declared that way first warns (-Wattributes).
#include <pybind11/pybind11.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <initializer_list>
#include <optional>
#include <utility>

#include "saved_input.h"

namespace memkern::autograd {

// The attribute of a memkern norm's output that holds its recipe (memkern._C.NormRecipe): the
// norm's entry sets it (with_recipe), the GEMM layers' entries read it (gemm_input).
inline constexpr const char* kNormRecipeAttr = "_memkern_recipe";

// The tensor `obj` is, or null when it is not one (the Python path then raises torch's error).
inline const at::Tensor* as_tensor(pybind11::handle obj) {
  return THPVariable_Check(obj.ptr()) ? &THPVariable_Unpack(obj.ptr()) : nullptr;
}

// Whether autocast is on for `device` (false for a device type autocast does not know, such as
// meta, where asking would throw).
inline bool autocast_on(c10::DeviceType device) {
  return at::autocast::is_autocast_available(device) && at::autocast::is_autocast_enabled(device);
}

// Whether weight and bias (absent or undefined: no constraint) have x's dtype.
inline bool one_dtype(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  return weight.scalar_type() == x.scalar_type() &&
         (!bias.has_value() || !bias->defined() || bias->scalar_type() == x.scalar_type());
}

// What a GEMM layer saves of its input `x` (the Python object `x_obj`): the recipe a memkern
// norm left on it while still valid (neither x nor the norm's tensors modified in place or
// freed since), else an empty recipe (kNoNorm: x itself).
NormRecipe input_recipe(pybind11::handle x_obj, const at::Tensor& x);

// A GEMM layer's (weight, bias) pairs, as its entry hands them to gemm_input.
using GemmParams =
    std::initializer_list<std::pair<const at::Tensor*, const std::optional<at::Tensor>*>>;

// Whether a GEMM layer's op serves a call of its memkern.nn function: x with at least one
// dimension, the last equal to the first weight's in_features (`in_dim`: its dimension holding
// them), and, without autocast on x's device, one dtype for x and every (weight, bias) pair. The
// function raises its error for the rest.
inline bool gemm_layer_call(const at::Tensor& x, GemmParams params, int64_t in_dim) {
  const at::Tensor& first = *params.begin()->first;
  if (x.dim() < 1 || first.dim() != 2 || x.size(-1) != first.size(in_dim)) {
    return false;
  }
  if (autocast_on(x.device().type())) {
    return true;
  }
  for (const auto& [weight, bias] : params) {
    if (!one_dtype(x, *weight, *bias)) {
      return false;
    }
  }
  return true;
}

// A GEMM layer's input when its op serves the call (gemm_layer_call): the tensor `x_obj` is,
// and what to save of it: the recipe of the memkern norm whose output it is (input_recipe).
struct GemmInput {
  const at::Tensor& x;
  NormRecipe recipe;
};

// The GemmInput of a GEMM layer's call; nullopt when its function must raise its error (x not a
// tensor, gemm_layer_call refuses it).
inline std::optional<GemmInput> gemm_input(pybind11::handle x_obj, GemmParams params,
                                           int64_t in_dim) {
  const at::Tensor* x = as_tensor(x_obj);
  if (x == nullptr || !gemm_layer_call(*x, params, in_dim)) {
    return std::nullopt;
  }
  return GemmInput{*x, input_recipe(x_obj, *x)};
}

// `y` as a Python tensor carrying the recipe of the norm that made it from x, weight and bias
// (a WeakNormRecipe in its kNormRecipeAttr attribute) when it requires grad, so that its
// consumers save the norm's tensors instead of it.
pybind11::object with_recipe(at::Tensor y, const at::Tensor& x,
                             const std::optional<at::Tensor>& weight,
                             const std::optional<at::Tensor>& bias, int64_t kind, int64_t dims,
                             double eps);

// Each adds its entries to the module memkern._C (called by its init, csrc/memkern.cpp; the
// linear cross-entropy's is lce::add_entries, linear_cross_entropy.h).
// python_entry.cpp: the NormRecipe class, recomputed_ops.
void add_shared_entries(pybind11::module_& m);
void add_norm_entries(pybind11::module_& m);            // norm.cpp
void add_modulated_norm_entries(pybind11::module_& m);  // modulated_norm.cpp
void add_dropout_entries(pybind11::module_& m);         // dropout.cpp
void add_linear_entries(pybind11::module_& m);          // linear.cpp
void add_mlp_entries(pybind11::module_& m);             // mlp.cpp
void add_swiglu_entries(pybind11::module_& m);          // swiglu.cpp
void add_lora_entries(pybind11::module_& m);            // lora.cpp
void add_swiglu_unit_entries(pybind11::module_& m);     // swiglu_unit.cpp

}  // namespace memkern::autograd
