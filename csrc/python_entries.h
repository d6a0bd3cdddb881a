// Direct Python entry points of memkern's layer ops (python_entries.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace memkern {

// The attribute of a memkern norm's output that holds its recipe (memkern._C.NormRecipe): the
// norm's entry sets it, the GEMM layers' entries read it (and memkern/nn/functional/_saved.py,
// for the layers that still have a Python Function).
inline constexpr const char* kNormRecipeAttr = "_memkern_recipe";

// Adds the entry points to the module memkern._C.
void add_layer_entries(pybind11::module_& m);

}  // namespace memkern
