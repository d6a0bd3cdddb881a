// The direct Python entry of memkern's linear cross-entropy (python_entries.cpp); the other
// layers' are in their files in csrc/autograd (python_entry.h).
#pragma once

#include <pybind11/pybind11.h>

namespace memkern {

// Adds the entry points to the module memkern._C.
void add_layer_entries(pybind11::module_& m);

}  // namespace memkern
