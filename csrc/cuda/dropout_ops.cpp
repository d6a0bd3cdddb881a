// The CUDA kernel of memkern::dropout, registered for the CUDA dispatch key: checks the tensors
// (the CPU kernel's checks: ../layer_checks.h), allocates the output with torch's caching
// allocator and calls the torch-free launcher of dropout_launch.h on the current stream.
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../layer_checks.h"
#include "dropout_launch.h"
#include "ops_common.h"

namespace {

using memkern::DType;
using memkern::cuda_ops::check_launch;
using memkern::cuda_ops::layer_dtype;
using memkern::cuda_ops::stream;

at::Tensor dropout_cuda(const at::Tensor& x, const at::Tensor& seed, double p) {
  constexpr const char* op = "dropout";
  memkern::check_dropout_args(x, seed, p);
  const DType dtype = layer_dtype(op, "x", x);
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor y = at::empty_like(x);
  check_launch(op, memkern::layer_ops::dropout(x.const_data_ptr(), y.data_ptr(), dtype,
                                               x.numel(), seed.const_data_ptr<int64_t>(), p,
                                               stream()));
  return y;
}

}  // namespace

// The schema is defined in memkern/ops/dropout.py.
TORCH_LIBRARY_IMPL(memkern, CUDA, m) {
  m.impl("dropout", TORCH_FN(dropout_cuda));
}
