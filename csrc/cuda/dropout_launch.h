// The host-side launchers of memkern's dropout CUDA kernel (dropout.cu), torch-free:
// dropout_ops.cpp checks the tensors, allocates the outputs and calls them; CI compiles them with
// plain nvcc (CMakeLists.txt). Buffers, dtypes, streams and the returned status: layer_launch.h.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "layer_launch.h"

namespace memkern::layer_ops {

// memkern::dropout (memkern/ops/dropout.py): y[i] = x[i] / (1 - p) where element i's Philox
// word is >= round(p * 2**32), else 0; n elements of x and y. seed: one int64 in device
// memory, read by the kernel.
cudaError_t dropout(const void* x, void* y, DType dtype, int64_t n, const int64_t* seed,
                    double p, cudaStream_t stream);

}  // namespace memkern::layer_ops
