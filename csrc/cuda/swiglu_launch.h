// The host-side launchers of memkern's SwiGLU CUDA kernels (swiglu.cu), torch-free: swiglu_ops.cpp
// checks the tensors, allocates the outputs and calls them; CI compiles them with plain nvcc
// (CMakeLists.txt). Buffers, dtypes, streams and the returned status: layer_launch.h.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "layer_launch.h"

namespace memkern::layer_ops {

// memkern::swiglu_forward (memkern/ops/swiglu.py): h = silu(gate) * up over n elements.
cudaError_t swiglu_forward(const void* gate, const void* up, void* h, DType dtype, int64_t n,
                           cudaStream_t stream);

// memkern::swiglu_backward: grad_gate and grad_up of h for the incoming gradient `grad`.
cudaError_t swiglu_backward(const void* grad, const void* gate, const void* up, void* grad_gate,
                            void* grad_up, DType dtype, int64_t n, cudaStream_t stream);

}  // namespace memkern::layer_ops
