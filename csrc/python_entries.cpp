// Direct Python entry points of memkern's layer ops: memkern.nn.functional calls these, in
// eager mode, instead of torch.ops.memkern.<op>. A torch.ops call converts every argument to
// a boxed IValue against the schema and back (a layer op with a norm recipe has ten); a
// pybind11 function reaches the same op through a typed dispatcher handle, so the op, its
// autograd and its kernels are the ones torch.ops runs. Each entry also makes the checks that
// decide whether the op serves the call at all, which in Python cost more than the op's
// dispatch; where it does not, the entry returns None and the Python path takes the call.
#include "python_entries.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include "autograd/norm.h"
#include "autograd/recomputed_ops.h"
#include "autograd/saved_input.h"
#include "layer_constants.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace memkern {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;
using autograd::NormRecipe;
using autograd::WeakNormRecipe;

// kNormRecipeAttr, as an interned Python string.
PyObject* recipe_attr() {
  static PyObject* const name = PyUnicode_InternFromString(kNormRecipeAttr);
  return name;
}

// obj.<name>, or a null object when obj has no such attribute. Every layer call asks its input
// for a recipe and most inputs have none: this asks without raising (and clearing) an
// AttributeError, through CPython's call for it, public only from 3.13 (the private name
// before it is the same function).
py::object optional_attr(py::handle obj, PyObject* name) {
  PyObject* value = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  const int found = PyObject_GetOptionalAttr(obj.ptr(), name, &value);
#else
  const int found = _PyObject_LookupAttr(obj.ptr(), name, &value);
#endif
  if (found < 0) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(value);
}

// The tensor `obj` is, or null when it is not one (the Python path then raises torch's error).
const at::Tensor* as_tensor(py::handle obj) {
  return THPVariable_Check(obj.ptr()) ? &THPVariable_Unpack(obj.ptr()) : nullptr;
}

// What a GEMM layer saves of its input `x` (the Python object `x_obj`): the recipe a memkern
// norm left on it while still valid (neither x nor the norm's tensors modified in place or
// freed since), else an empty recipe (kNoNorm: x itself).
NormRecipe input_recipe(py::handle x_obj, const at::Tensor& x) {
  const py::object held = optional_attr(x_obj, recipe_attr());
  if (!held || x._version() != 0) {
    return NormRecipe{};
  }
  return held.cast<const WeakNormRecipe&>().lock().value_or(NormRecipe{});
}

// Whether autocast is on for `device` (false for a device type autocast does not know, such as
// meta, where asking would throw).
bool autocast_on(c10::DeviceType device) {
  return at::autocast::is_autocast_available(device) && at::autocast::is_autocast_enabled(device);
}

bool one_dtype(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias) {
  return weight.scalar_type() == x.scalar_type() &&
         (!bias.has_value() || !bias->defined() || bias->scalar_type() == x.scalar_type());
}

// Whether a GEMM layer's op serves a call of its memkern.nn.functional function: x with at
// least one dimension, the last equal to the first weight's in_features (`in_dim`: its
// dimension holding them), and, without autocast on x's device, one dtype for x and every
// (weight, bias) pair. The function raises its error for the rest.
bool gemm_layer_call(const at::Tensor& x,
                     std::initializer_list<std::pair<const at::Tensor*, const OptTensor*>> params,
                     int64_t in_dim) {
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
// nullopt when the function must raise its error (x not a tensor, gemm_layer_call refuses it).
struct GemmInput {
  const at::Tensor& x;
  NormRecipe recipe;
};

std::optional<GemmInput> gemm_input(
    py::handle x_obj,
    std::initializer_list<std::pair<const at::Tensor*, const OptTensor*>> params,
    int64_t in_dim) {
  const at::Tensor* x = as_tensor(x_obj);
  if (x == nullptr || !gemm_layer_call(*x, params, in_dim)) {
    return std::nullopt;
  }
  return GemmInput{*x, input_recipe(x_obj, *x)};
}

// Whether a Linear call of one dtype without autocast is torch's own linear: when memkern
// does nothing differently (no recipe to save instead of x, not transposed, no weight.grad to
// add into).
bool linear_is_torch_linear(bool has_recipe, bool transposed, bool weight_has_grad) {
  return !has_recipe && !transposed && !weight_has_grad;
}

// memkern.nn.functional.linear in eager mode: memkern::linear_layer with x's norm recipe
// (gemm_input), or torch's own linear (linear_is_torch_linear). None for a call
// memkern.nn.functional.linear refuses with its error.
OptTensor linear_layer(py::handle x_obj, const at::Tensor& weight, const OptTensor& bias,
                       bool transposed) {
  const auto in = gemm_input(x_obj, {{&weight, &bias}}, transposed ? 0 : 1);
  if (!in) {
    return std::nullopt;
  }
  const NormRecipe& recipe = in->recipe;
  if (!autocast_on(in->x.device().type()) &&
      linear_is_torch_linear(recipe.kind != autograd::kNoNorm, transposed,
                             weight.grad().defined())) {
    return at::linear(in->x, weight, bias);
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::linear_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool,
                            const OptTensor&, const OptTensor&, const OptTensor&, int64_t,
                            int64_t, double)>();
  return op.call(in->x, weight, bias, transposed, recipe.x, recipe.weight, recipe.bias,
                 recipe.kind, recipe.dims, recipe.eps);
}

// memkern.nn.functional.mlp in eager mode: memkern::mlp_layer with x's norm recipe, or None
// for a call that function refuses with its error (gemm_input).
OptTensor mlp_layer(py::handle x_obj, const at::Tensor& fc1_weight, const OptTensor& fc1_bias,
              const at::Tensor& fc2_weight, const OptTensor& fc2_bias,
              const std::string& activation, const std::string& recompute, bool transposed) {
  const auto in =
      gemm_input(x_obj, {{&fc1_weight, &fc1_bias}, {&fc2_weight, &fc2_bias}}, transposed ? 0 : 1);
  if (!in) {
    return std::nullopt;
  }
  const NormRecipe& recipe = in->recipe;
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::mlp_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const at::Tensor&, const OptTensor&, c10::string_view,
                            c10::string_view, bool, const OptTensor&, const OptTensor&,
                            const OptTensor&, int64_t, int64_t, double)>();
  return op.call(in->x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, recompute,
                 transposed, recipe.x, recipe.weight, recipe.bias, recipe.kind, recipe.dims,
                 recipe.eps);
}

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

// The inner ops the node of layer op `layer` (mlp_layer, swiglu_layer) runs again in backward
// for `recompute` (recomputed_ops.h).
std::vector<std::string> recomputed_ops(const std::string& layer, const std::string& recompute) {
  const Recompute mode = parse_recompute(layer.c_str(), recompute);
  std::vector<const char*> names;
  if (layer == "mlp_layer") {
    names = autograd::mlp_recomputed_ops(mode);
  } else {
    TORCH_CHECK(layer == "swiglu_layer", "memkern._C.recomputed_ops: layer='", layer,
                "' is not 'mlp_layer' or 'swiglu_layer'");
    names = autograd::swiglu_recomputed_ops(mode);
  }
  return std::vector<std::string>(names.begin(), names.end());
}

// memkern::norm_layer.
at::Tensor norm_layer(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                      int64_t n_norm, double eps, bool rms) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::norm_layer", "")
          .typed<at::Tensor(const at::Tensor&, const OptTensor&, const OptTensor&, int64_t,
                            double, bool)>();
  return op.call(x, weight, bias, n_norm, eps, rms);
}

bool shape_is(const OptTensor& t, at::IntArrayRef shape) {
  return !t.has_value() || !t->defined() || t->sizes() == shape;
}

// `y` as a Python tensor carrying the recipe of the norm that made it from x, weight and bias
// (a WeakNormRecipe in its _memkern_recipe attribute) when it requires grad, so that its
// consumers save the norm's tensors instead of it.
py::object with_recipe(at::Tensor y, const at::Tensor& x, const OptTensor& weight,
                       const OptTensor& bias, int64_t kind, int64_t dims, double eps) {
  py::object out = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(y)));
  if (THPVariable_Unpack(out.ptr()).requires_grad() && at::GradMode::is_enabled()) {
    const py::object recipe = py::cast(WeakNormRecipe(x, weight, bias, kind, dims, eps));
    if (PyObject_SetAttr(out.ptr(), recipe_attr(), recipe.ptr()) < 0) {
      throw py::error_already_set();
    }
  }
  return out;
}

// memkern.nn.functional.layer_norm / rms_norm in eager mode: memkern::norm_layer — called as
// torch's native_layer_norm directly where the op would run that (norm_is_native_layer_norm;
// one dispatch less) — its output carrying the norm's recipe (a WeakNormRecipe in its
// _memkern_recipe attribute) when it requires grad, so its consumers save the norm's input
// instead. None for a call the Python path handles: normalized_shape not a tuple of ints,
// shapes that do not match (the Python path raises).
py::object norm(py::handle x_obj, py::handle normalized_shape, const OptTensor& weight,
                const OptTensor& bias, double eps, bool rms) {
  const at::Tensor* x = as_tensor(x_obj);
  if (x == nullptr || !PyTuple_Check(normalized_shape.ptr())) {
    return py::none();
  }
  const Py_ssize_t dims = PyTuple_GET_SIZE(normalized_shape.ptr());
  if (dims > x->dim()) {
    return py::none();
  }
  c10::SmallVector<int64_t, 4> shape;
  for (Py_ssize_t i = 0; i < dims; ++i) {
    PyObject* size = PyTuple_GET_ITEM(normalized_shape.ptr(), i);
    shape.push_back(PyLong_Check(size) ? PyLong_AsLongLong(size) : -1);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();  // a size beyond int64: the Python path reports the shape
    return py::none();
  }
  if (x->sizes().slice(x->dim() - dims) != at::IntArrayRef(shape) || !shape_is(weight, shape) ||
      !shape_is(bias, shape)) {
    return py::none();
  }
  const bool native = autograd::norm_is_native_layer_norm(*x, weight, bias, rms);
  at::Tensor y = native ? autograd::native_layer_norm(*x, weight, bias, dims, eps)
                        : norm_layer(*x, weight, bias, dims, eps, rms);
  const int64_t kind = native ? autograd::kNativeLayerNorm
                              : rms ? autograd::kRmsNorm : autograd::kLayerNorm;
  return with_recipe(std::move(y), *x, weight, bias, kind, dims, eps);
}

// memkern.nn.functional.modulated_layer_norm in eager mode: memkern::modulated_norm_layer, its
// output carrying its recipe (kModulatedLayerNorm: x, scale, shift) like a norm's. None for a
// call the Python path takes: autocast on x's device (the op has none: torch's composition
// runs), mixed dtypes or shapes that do not fit (the Python path raises).
py::object modulated_norm(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                          double eps) {
  if (x.dim() < 2 || scale.dim() != 2 || scale.sizes() != shift.sizes() ||
      scale.size(0) != x.size(0) || scale.size(1) != x.size(-1) || !one_dtype(x, scale, shift) ||
      autocast_on(x.device().type())) {
    return py::none();
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::modulated_norm_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return with_recipe(op.call(x, scale, shift, eps), x, scale, shift,
                     autograd::kModulatedLayerNorm, 1, eps);
}

// memkern.nn.functional.dropout with a drawn seed: memkern::dropout_layer.
at::Tensor dropout_layer(const at::Tensor& x, double p) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::dropout_layer", "")
          .typed<at::Tensor(const at::Tensor&, const OptTensor&, double)>();
  return op.call(x, std::nullopt, p);
}

}  // namespace

void add_layer_entries(py::module_& m) {
  py::class_<WeakNormRecipe>(
          m, "NormRecipe",
          "How to rebuild a memkern norm's output (its _memkern_recipe attribute, left by "
          "memkern._C.norm), which the layers' C++ entries read: weak references to the norm's "
          "input and parameters and their versions at the call, which norm, over how many "
          "trailing dimensions, with which eps.")
          .def_property_readonly("kind", &WeakNormRecipe::kind)
          .def_property_readonly("dims", &WeakNormRecipe::dims)
          .def_property_readonly("eps", &WeakNormRecipe::eps);
  m.def("linear_layer", &linear_layer, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("transposed"),
        "memkern.nn.functional.linear's eager call: memkern::linear_layer with x's norm recipe (or "
        "torch's linear), or None for a call that function refuses with its error.");
  m.def("mlp_layer", &mlp_layer, py::arg("x"), py::arg("fc1_weight"), py::arg("fc1_bias"),
        py::arg("fc2_weight"), py::arg("fc2_bias"), py::arg("activation"), py::arg("recompute"),
        py::arg("transposed"),
        "memkern.nn.functional.mlp's eager call: memkern::mlp_layer with x's norm recipe, or "
        "None for a call that function refuses with its error.");
  m.def("swiglu_layer", &swiglu_layer, py::arg("x"), py::arg("gate_weight"), py::arg("gate_bias"),
        py::arg("up_weight"), py::arg("up_bias"), py::arg("down_weight"), py::arg("down_bias"),
        py::arg("recompute"),
        "memkern.nn.functional.swiglu's eager call: memkern::swiglu_layer with x's norm "
        "recipe, or None for a call that function refuses with its error.");
  m.def("norm", &norm, py::arg("x"), py::arg("normalized_shape"), py::arg("weight"),
        py::arg("bias"), py::arg("eps"), py::arg("rms"),
        "memkern.nn.functional.layer_norm / rms_norm's eager call: memkern::norm_layer, its "
        "output carrying the norm's recipe, or None when the Python path must take the call.");
  m.def("modulated_norm", &modulated_norm, py::arg("x"), py::arg("scale"), py::arg("shift"),
        py::arg("eps"),
        "memkern.nn.functional.modulated_layer_norm's eager call: memkern::modulated_norm_layer, "
        "its output carrying its recipe, or None when the Python path must take the call.");
  m.def("dropout_layer", &dropout_layer, py::arg("x"), py::arg("p"),
        "memkern.nn.functional.dropout's eager call with a drawn seed: memkern::dropout_layer.");
  m.def("recomputed_ops", &recomputed_ops, py::arg("layer"), py::arg("recompute"),
        "The inner ops (\"aten::mm\", \"aten::to.dtype\", ...) the node of layer op `layer` "
        "(mlp_layer, swiglu_layer) runs again in backward instead of saving, for `recompute`.");
}

}  // namespace memkern
