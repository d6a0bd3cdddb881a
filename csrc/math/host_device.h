// What lets one piece of per-element math compile for both the CPU kernels (csrc/cpu) and the
// CUDA kernels (csrc/cuda/kernels): the function qualifier, and the float operations whose
// rounding must not depend on the compiler.
//
// Torch-free, like the CUDA device code: CI compiles it with plain nvcc.
//
// Both compilers contract a product feeding an addition into one FMA when the target has one
// (GCC does so in C++ even with -std=c++17; nvcc by default), and whether they do depends on
// the ISA clone and on how the code was inlined. The shared math therefore never adds to a
// plain product: each such pair is written as fma_rn (rounded once on every backend), and the
// remaining products feed only divisions, other products or an fma_rn operand, where nothing
// can be contracted. That makes a shared function give the same bits on the CPU (every ISA
// clone) and on the GPU, so the CPU tests check the arithmetic the GPU runs.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define MEMKERN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEMKERN_HOST_DEVICE inline
#endif

namespace memkern::math {

// a * b + c rounded once. On a CPU without FMA instructions (the baseline x86-64 clone) the
// C library computes it exactly in software: slower, the same bits.
MEMKERN_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// a * b rounded to float32 (on the GPU an explicit mul.rn, which ptxas never fuses with a
// later addition).
MEMKERN_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// Correctly rounded division and square root, whatever -prec-div/-prec-sqrt or fast-math flag
// a build passes to nvcc.
MEMKERN_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

MEMKERN_HOST_DEVICE float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

}  // namespace memkern::math
