// Host-side launchers of the memkern CUDA kernels: plain C++ over raw device pointers, no
// torch. The torch bindings (bindings.cpp) check tensors and call these; CI builds them with
// plain nvcc (CMakeLists.txt) without torch.
//
// Every flat buffer holds `n` elements (any n >= 0, multiples of nothing). master, exp_avg,
// exp_avg_sq and momentum_buffer are float32; grads and params have the DType passed with
// them. Scalars (found_inf, inv_scale, step, grad_multiplier) are one float32 each in device
// memory and are read by the kernels, so nothing here synchronises with the host.
//
// The buffers must live on the current CUDA device (the grid is sized for it). grads and params
// may have different DTypes.
//
// Each launcher enqueues its kernels on `stream` and returns the launch status
// (cudaSuccess, or the error from cudaGetLastError / an invalid DType as cudaErrorInvalidValue).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "dtype.h"

namespace memkern::flat_ops {

// grads and params are float32, bfloat16 or float16 (DType::f64: cudaErrorInvalidValue).
using memkern::DType;

// grads[i] = round(float(grads[i]) * *inv_scale); *found_inf = 1 if any input element is
// inf or NaN, else left unchanged.
cudaError_t unscale(void* grads, DType grads_dtype, int64_t n, float* found_inf,
                    const float* inv_scale, cudaStream_t stream);

// Number of floats the l2_norm workspace `partials` must hold for a buffer of n elements.
int64_t l2_norm_partial_count(int64_t n);

// *norm = sqrt(sum(float(grads[i])^2)) in float32; 0 for n == 0. Deterministic.
cudaError_t l2_norm(const void* grads, DType grads_dtype, int64_t n, float* partials,
                    float* norm, cudaStream_t stream);

// One torch.optim.AdamW step with t = *step + 1, then *step = t. params (nullable) receives
// round(master). grad_multiplier (nullable) scales every gradient. When found_inf (nullable)
// is non-zero nothing is written at all, the step counter included.
cudaError_t adamw_step(float* master, float* exp_avg, float* exp_avg_sq, const void* grads,
                       DType grads_dtype, void* params, DType params_dtype, int64_t n,
                       float* step, const float* grad_multiplier, const float* found_inf,
                       double lr, double beta1, double beta2, double eps, double weight_decay,
                       cudaStream_t stream);

// Elements per quantization block of the 8-bit optimizer state (memkern/kernels/state8bit.py,
// kernels/state8bit.cuh).
constexpr int64_t kQuantBlock = 256;

// adamw_step with the moments stored block-wise in 8 bits (memkern/ops/adamw8bit.py): int8
// codes of m and uint8 codes of v (n each) with one float32 absmax per block of kQuantBlock
// elements (ceil(n / kQuantBlock) each), all rewritten by the step.
cudaError_t adamw8bit_step(float* master, int8_t* exp_avg, float* exp_avg_absmax,
                           uint8_t* exp_avg_sq, float* exp_avg_sq_absmax, const void* grads,
                           DType grads_dtype, void* params, DType params_dtype, int64_t n,
                           float* step, const float* grad_multiplier, const float* found_inf,
                           double lr, double beta1, double beta2, double eps,
                           double weight_decay, cudaStream_t stream);

// One torch.optim.SGD step, then *step += 1; the momentum buffer is initialised from the
// update when *step == 0. momentum_buffer may be null when momentum == 0; params,
// grad_multiplier and found_inf are nullable as for adamw_step.
cudaError_t sgd_step(float* master, float* momentum_buffer, const void* grads,
                     DType grads_dtype, void* params, DType params_dtype, int64_t n,
                     float* step, const float* grad_multiplier, const float* found_inf,
                     double lr, double momentum, double dampening, double weight_decay,
                     bool nesterov, cudaStream_t stream);

// sgd_step with the momentum buffer stored block-wise in 8 bits (memkern/ops/sgd8bit.py): int8
// codes (n) with one float32 absmax per kQuantBlock-element block, both rewritten by the step.
// momentum must be > 0 (cudaErrorInvalidValue otherwise: without momentum there is no state).
cudaError_t sgd8bit_step(float* master, int8_t* momentum_buffer, float* momentum_absmax,
                         const void* grads, DType grads_dtype, void* params, DType params_dtype,
                         int64_t n, float* step, const float* grad_multiplier,
                         const float* found_inf, double lr, double momentum, double dampening,
                         double weight_decay, bool nesterov, cudaStream_t stream);

}  // namespace memkern::flat_ops
