// Host-side launchers of the CUDA kernels of memkern's layer ops (dropout, SwiGLU, LayerNorm /
// RMSNorm): plain C++ over raw device pointers, no torch, like flat_ops.h. The torch bindings
// (layer_bindings.cpp) check the tensors, allocate the outputs and call these; CI compiles
// them with plain nvcc (CMakeLists.txt).
//
// Every buffer is contiguous, lives on the current CUDA device and holds elements of the DType
// passed with it (float32, bfloat16, float16 or float64). The math type is float32 for
// float32 and 16-bit elements and float64 for float64 ("acc" below); outputs are rounded once.
// Each launcher enqueues its kernels on `stream` without synchronising with the host and
// returns the launch status (cudaSuccess, the error from cudaGetLastError, or
// cudaErrorInvalidValue for an invalid argument). Empty inputs launch nothing.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "dtype.h"

namespace memkern::layer_ops {

// memkern::dropout (memkern/ops/dropout.py): y[i] = x[i] / (1 - p) where element i's Philox
// word is >= round(p * 2**32), else 0; n elements of x and y. seed: one int64 in device
// memory, read by the kernel.
cudaError_t dropout(const void* x, void* y, DType dtype, int64_t n, const int64_t* seed,
                    double p, cudaStream_t stream);

// memkern::swiglu_forward (memkern/ops/swiglu.py): h = silu(gate) * up over n elements.
cudaError_t swiglu_forward(const void* gate, const void* up, void* h, DType dtype, int64_t n,
                           cudaStream_t stream);

// memkern::swiglu_backward: grad_gate and grad_up of h for the incoming gradient `grad`.
cudaError_t swiglu_backward(const void* grad, const void* gate, const void* up, void* grad_gate,
                            void* grad_up, DType dtype, int64_t n, cudaStream_t stream);

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
