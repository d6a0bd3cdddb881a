// Host-side launchers of the cross-entropy CUDA kernels (cross_entropy.cu): plain C++
// over raw device pointers, no torch; cross_entropy_ops.cpp checks the tensors and calls them.
// Contracts: memkern/ops/cross_entropy.py. `Acc` buffers (row_scale, loss, lse) are float32,
// float64 for float64 logits. Nothing here synchronises with the host: targets are read by the
// kernels, and one outside [0, V) (other than ignore_index) is never used as an index.
//
// Each launcher enqueues its kernel on `stream` (on the current device) and returns the launch
// status: cudaSuccess, the error from cudaGetLastError, or cudaErrorInvalidValue for a bad
// DType.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "dtype.h"

namespace memkern::cross_entropy_launch {

// logits [n, V] contiguous; row_scale (nullable) [n]; loss, lse [n] written; `outputs` a mask
// of the kRow* bits (kernels/cross_entropy_math.h), each statistic asked written to its row of
// `stats` (nullable when outputs is 0), element r of row s at stats[s * stats_stride + r].
cudaError_t rows(void* logits, DType type, int64_t n, int64_t V, const int64_t* target,
                 const void* row_scale, void* loss, void* lse, int64_t ignore_index,
                 double label_smoothing, double softcap, bool compute_grad, int outputs,
                 void* stats, int64_t stats_stride, cudaStream_t stream);

// logits [n, width] contiguous: classes class_offset .. class_offset + width - 1 of
// num_classes; lse [n]; row_scale[r * scale_stride] scales row r (stride 0: one scale);
// entropy (nullable: no entropy term) [n] and entropy_scale[r * entropy_scale_stride].
cudaError_t block_grad(void* logits, DType type, int64_t n, int64_t width,
                       const void* lse, const int64_t* target, const void* row_scale,
                       int64_t scale_stride, int64_t class_offset, int64_t num_classes,
                       int64_t ignore_index, double label_smoothing, double softcap,
                       const void* entropy, const void* entropy_scale,
                       int64_t entropy_scale_stride, cudaStream_t stream);

}  // namespace memkern::cross_entropy_launch
