// What the torch bindings of memkern's layer-op CUDA kernels (dropout_ops.cpp, swiglu_ops.cpp,
// norm_ops.cpp) share: the kernels' DType of a tensor, the checks that a tensor is on a GPU and
// that a launch succeeded, the stream they launch on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "dtype.h"

namespace memkern::cuda_ops {

// The kernels' DType of `t` (argument `name` of memkern.<op>); an error for any other dtype.
inline DType layer_dtype(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::f32;
    case at::kBFloat16:
      return DType::bf16;
    case at::kHalf:
      return DType::f16;
    case at::kDouble:
      return DType::f64;
    default:
      TORCH_CHECK(false, "memkern.", op, ": ", name, " has dtype ", t.scalar_type(),
                  "; expected float32, bfloat16, float16 or float64");
  }
}

// An error unless `t` (argument `name` of memkern.<op>) is on a GPU.
inline void check_cuda(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), "memkern.", op, ": ", name, " is on ", t.device(),
              "; the CUDA kernel needs CUDA tensors");
}

// An error naming memkern.<op> unless a launcher returned cudaSuccess.
inline void check_launch(const char* op, cudaError_t status) {
  TORCH_CHECK(status == cudaSuccess, "memkern.", op, ": CUDA kernel launch failed: ",
              cudaGetErrorString(status));
}

// The stream the kernels launch on: torch's current one.
inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

}  // namespace memkern::cuda_ops
