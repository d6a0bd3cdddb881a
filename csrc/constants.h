// The constants memkern._C exports for the Python modules that repeat them, which check at
// import that they are these (memkern/_extension.py, check_same_in_cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace memkern {

// Adds them to the module memkern._C.
void add_constants(pybind11::module_& m);

}  // namespace memkern
