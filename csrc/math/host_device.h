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
#include <cstdint>
#include <cstring>
#include <type_traits>

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

MEMKERN_HOST_DEVICE double fma_rn(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// a * b rounded to its type (on the GPU an explicit mul.rn, which ptxas never fuses with a
// later addition).
MEMKERN_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MEMKERN_HOST_DEVICE double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// exp(x) and sqrt(x) for float (the float functions on the device, not the double ones) and
// double.
template <typename T>
MEMKERN_HOST_DEVICE T exp_of(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) return ::expf(x); else return ::exp(x);
#else
  return std::exp(x);
#endif
}

template <typename T>
MEMKERN_HOST_DEVICE T sqrt_of(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) return ::sqrtf(x); else return ::sqrt(x);
#else
  return std::sqrt(x);
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

MEMKERN_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

MEMKERN_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// `a` where `mask` is all ones, `b` where it is zero: a bitwise blend (one LOP3 on the GPU).
// For a choice fixed per kernel call that a compiler would otherwise turn into a branch and
// unswitch, duplicating the loop around it (with a mask it cannot see to be all or nothing).
MEMKERN_HOST_DEVICE float blend(uint32_t mask, float a, float b) {
  return bits_float((float_bits(a) & mask) | (float_bits(b) & ~mask));
}

}  // namespace memkern::math
