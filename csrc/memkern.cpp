// The Python module memkern._C: importing it registers the C++ (and CUDA) kernels with the
// dispatcher (their TORCH_LIBRARY_IMPL blocks in csrc/cpu and csrc/cuda); the op schemas are
// defined in memkern/ops. The module itself reports how it was built and holds the layers'
// direct entry points (each layer's file in csrc/autograd adds its own: autograd/python_entry.h,
// autograd/linear_cross_entropy.h) and the constants the Python side shares with the C++ code
// (constants.h).
#include <pybind11/pybind11.h>

#include "autograd/linear_cross_entropy.h"
#include "autograd/python_entry.h"
#include "constants.h"

#ifndef MEMKERN_CUDA_ARCHS
#define MEMKERN_CUDA_ARCHS ""
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "memkern compiled kernels (registered as torch.library ops in the memkern namespace)";
  m.def("has_cuda", [] {
#ifdef MEMKERN_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether the CUDA kernels were compiled in.");
  m.def("has_openmp", [] {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  }, "Whether the CPU kernels were compiled with OpenMP (at::parallel_for runs them on "
     "torch's intra-op threads only then).");
  m.def("cuda_archs", [] { return std::string(MEMKERN_CUDA_ARCHS); },
        "The CUDA architectures the kernels were compiled for ('' without CUDA).");
  memkern::autograd::add_shared_entries(m);
  memkern::autograd::add_norm_entries(m);
  memkern::autograd::add_modulated_norm_entries(m);
  memkern::autograd::add_dropout_entries(m);
  memkern::autograd::add_linear_entries(m);
  memkern::autograd::add_mlp_entries(m);
  memkern::autograd::add_swiglu_entries(m);
  memkern::autograd::add_lora_entries(m);
  memkern::autograd::add_swiglu_unit_entries(m);
  memkern::lce::add_entries(m);
  memkern::add_constants(m);
}
