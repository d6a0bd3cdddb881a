// Direct Python entry points of memkern's layer ops (python_entries.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace memkern {

// Adds the entry points to the module memkern._C.
void add_layer_entries(pybind11::module_& m);

}  // namespace memkern
