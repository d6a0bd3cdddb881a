// What the layers' direct Python entries share (python_entry.h), and the entries of memkern._C
// that serve several layers: the class of a norm's recipe, the recomputed ops of the GEMM
// layers.
#include "python_entry.h"

#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "../layer_constants.h"
#include "recomputed_ops.h"

namespace memkern::autograd {
namespace {

namespace py = pybind11;

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

// The inner ops the node of layer op `layer` (mlp_layer, swiglu_layer) runs again in backward
// for `recompute` (recomputed_ops.h).
std::vector<std::string> recomputed_ops(const std::string& layer, const std::string& recompute) {
  const Recompute mode = parse_recompute(layer.c_str(), recompute);
  std::vector<const char*> names;
  if (layer == "mlp_layer") {
    names = mlp_recomputed_ops(mode);
  } else {
    TORCH_CHECK(layer == "swiglu_layer", "memkern._C.recomputed_ops: layer='", layer,
                "' is not 'mlp_layer' or 'swiglu_layer'");
    names = swiglu_recomputed_ops(mode);
  }
  return std::vector<std::string>(names.begin(), names.end());
}

}  // namespace

NormRecipe input_recipe(py::handle x_obj, const at::Tensor& x) {
  const py::object held = optional_attr(x_obj, recipe_attr());
  if (!held || x._version() != 0) {
    return NormRecipe{};
  }
  return held.cast<const WeakNormRecipe&>().lock().value_or(NormRecipe{});
}

py::object with_recipe(at::Tensor y, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, int64_t kind, int64_t dims,
                       double eps) {
  py::object out = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(y)));
  if (THPVariable_Unpack(out.ptr()).requires_grad() && at::GradMode::is_enabled()) {
    const py::object recipe = py::cast(WeakNormRecipe(x, weight, bias, kind, dims, eps));
    if (PyObject_SetAttr(out.ptr(), recipe_attr(), recipe.ptr()) < 0) {
      throw py::error_already_set();
    }
  }
  return out;
}

void add_shared_entries(py::module_& m) {
  py::class_<WeakNormRecipe>(
          m, "NormRecipe",
          "How to rebuild a memkern norm's output (its _memkern_recipe attribute, left by "
          "memkern._C.norm), which the layers' C++ entries read: weak references to the norm's "
          "input and parameters and their versions at the call, which norm, over how many "
          "trailing dimensions, with which eps.")
          .def_property_readonly("kind", &WeakNormRecipe::kind)
          .def_property_readonly("dims", &WeakNormRecipe::dims)
          .def_property_readonly("eps", &WeakNormRecipe::eps);
  m.def("recomputed_ops", &recomputed_ops, py::arg("layer"), py::arg("recompute"),
        "The inner ops (\"aten::mm\", \"aten::to.dtype\", ...) the node of layer op `layer` "
        "(mlp_layer, swiglu_layer) runs again in backward instead of saving, for `recompute`.");
}

}  // namespace memkern::autograd
