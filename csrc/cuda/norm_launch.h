// The host-side launchers of memkern's LayerNorm / RMSNorm CUDA kernels (norm.cu), torch-free:
// norm_ops.cpp checks the tensors, allocates the outputs and calls them; CI compiles them with
// plain nvcc (CMakeLists.txt). Buffers, dtypes, streams and the returned status: layer_launch.h.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "layer_launch.h"

namespace memkern::layer_ops {

// memkern::norm_forward (memkern/ops/norm.py) over `rows` rows of D elements: y (x's dtype),
// rstd ([rows] acc) and, for LayerNorm (!rms), mean ([rows] acc; may be null for RMSNorm).
// weight and bias ([D], nullable; bias only with a weight) have param_dtype, which must be x's
// dtype or the math type.
cudaError_t norm_forward(const void* x, DType x_dtype, const void* weight, const void* bias,
                         DType param_dtype, void* y, void* mean, void* rstd, int64_t rows,
                         int64_t D, double eps, bool rms, cudaStream_t stream);

// Elements (acc) of the workspace norm_backward needs for `rows` rows of D elements with a
// weight: partial sums of the weight and bias gradients over fixed chunks of rows.
int64_t norm_backward_workspace(int64_t rows, int64_t D);

// memkern::norm_backward: dx (x's dtype) from dy and x (x_dtype), the weight ([D] of
// param_dtype — x's dtype or the math type —, nullable) and the forward's mean / rstd (acc;
// mean unused for RMSNorm). With a weight, also dweight = sum over rows of dy * xhat and
// dbias = sum over rows of dy ([D] acc each), through `workspace`
// (norm_backward_workspace(rows, D) acc elements); without one, those three may be null.
cudaError_t norm_backward(const void* dy, const void* x, DType x_dtype, const void* weight,
                          DType param_dtype, const void* mean, const void* rstd, void* dx,
                          void* dweight, void* dbias, void* workspace, int64_t rows, int64_t D,
                          bool rms, cudaStream_t stream);

}  // namespace memkern::layer_ops
