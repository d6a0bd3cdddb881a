// What the host-side launchers of memkern's layer-op CUDA kernels (dropout_launch.h,
// swiglu_launch.h, norm_launch.h) have in common: plain C++ over raw device pointers, no torch.
//
// Every buffer is contiguous, lives on the current CUDA device and holds elements of the DType
// passed with it (float32, bfloat16, float16 or float64). The math type is float32 for
// float32 and 16-bit elements and float64 for float64 ("acc" in the launchers' comments);
// outputs are rounded once. Each launcher enqueues its kernels on `stream` without
// synchronising with the host and returns the launch status (cudaSuccess, the error from
// cudaGetLastError, or cudaErrorInvalidValue for an invalid argument). Empty inputs launch
// nothing.
#pragma once

#include <cuda_runtime_api.h>

#include "dtype.h"
