// The CUDA kernels of memkern::swiglu_forward / swiglu_backward, registered for the CUDA
// dispatch key: check the tensors (the CPU kernels' checks: ../layer_checks.h), allocate the
// outputs with torch's caching allocator and call the torch-free launchers of swiglu_launch.h on
// the current stream.
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../layer_checks.h"
#include "swiglu_launch.h"
#include "ops_common.h"

namespace {

using memkern::DType;
using memkern::cuda_ops::check_launch;
using memkern::cuda_ops::layer_dtype;
using memkern::cuda_ops::stream;

at::Tensor swiglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up) {
  constexpr const char* op = "swiglu_forward";
  memkern::check_like_gate(op, "up", up, gate);
  const DType dtype = layer_dtype(op, "gate", gate);
  const c10::cuda::CUDAGuard device_guard(gate.device());
  const at::Tensor a = gate.contiguous(), b = up.contiguous();
  at::Tensor h = at::empty_like(a);
  check_launch(op, memkern::layer_ops::swiglu_forward(a.const_data_ptr(), b.const_data_ptr(),
                                                      h.data_ptr(), dtype, a.numel(), stream()));
  return h;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad,
                                                        const at::Tensor& gate,
                                                        const at::Tensor& up) {
  constexpr const char* op = "swiglu_backward";
  memkern::check_like_gate(op, "up", up, gate);
  memkern::check_like_gate(op, "grad", grad, gate);
  const DType dtype = layer_dtype(op, "gate", gate);
  const c10::cuda::CUDAGuard device_guard(gate.device());
  const at::Tensor g = grad.contiguous(), a = gate.contiguous(), b = up.contiguous();
  at::Tensor grad_gate = at::empty_like(a), grad_up = at::empty_like(b);
  check_launch(op, memkern::layer_ops::swiglu_backward(
                       g.const_data_ptr(), a.const_data_ptr(), b.const_data_ptr(),
                       grad_gate.data_ptr(), grad_up.data_ptr(), dtype, a.numel(), stream()));
  return {grad_gate, grad_up};
}

}  // namespace

// The schemas are defined in memkern/ops/swiglu.py.
TORCH_LIBRARY_IMPL(memkern, CUDA, m) {
  m.impl("swiglu_forward", TORCH_FN(swiglu_forward_cuda));
  m.impl("swiglu_backward", TORCH_FN(swiglu_backward_cuda));
}
