// Shared pieces of the CPU flat-buffer kernels: element conversions, the non-finite test,
// the ISA multiversioning attribute, and the block-parallel loop.
//
// The kernels are written as plain loops over raw pointers that GCC auto-vectorises; the
// MEMKERN_VECTOR_CLONES attribute compiles each one for AVX-512, AVX2+FMA+F16C and baseline
// x86-64 and picks the best at load time, so the wheel stays portable without giving up the
// wide vectors (ATen's own per-ISA dispatch is not available to extensions).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEMKERN_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MEMKERN_VECTOR_CLONES
#endif

namespace memkern::cpu {

// Elements per task of the parallel loops: large enough to amortise the thread hand-off,
// small enough to balance the tail.
constexpr int64_t kGrain = 1 << 15;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) { return bits_to_float(uint32_t(x.x) << 16); }

// IEEE half -> float with integer and float arithmetic only (no branches, no library call),
// so the loops around it vectorise on every ISA; exact for all 65536 inputs.
inline float to_float(c10::Half x) {
  const uint32_t w = uint32_t(x.x) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const bool is_denormal = two_w < (1u << 27);
  return bits_to_float(sign | float_to_bits(is_denormal ? denormalized : normalized));
}

template <typename T>
inline T from_float(float f);

template <>
inline float from_float<float>(float f) {
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 cast; NaN becomes the quiet NaN 0x7FC0.
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float f) {
  const uint32_t u = float_to_bits(f);
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint16_t rounded = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(is_nan ? uint16_t(0x7fc0) : rounded, c10::BFloat16::from_bits());
}

// float -> IEEE half, round to nearest even, branch-free for the same reason as to_float.
template <>
inline c10::Half from_float<c10::Half>(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const uint16_t half = uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
  return c10::Half(half, c10::Half::from_bits());
}

// The math type of the row/elementwise kernels: float32 for float32 and 16-bit inputs (rounded
// once on the way out), float64 for float64; widen/narrow convert one element to and from it.
template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
inline acc_type<scalar_t> widen(scalar_t v) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return v;
  } else {
    return to_float(v);
  }
}

template <typename scalar_t>
inline scalar_t narrow(acc_type<scalar_t> v) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return v;
  } else {
    return from_float<scalar_t>(v);
  }
}

// inf or NaN: the exponent bits are all ones.
inline bool is_non_finite(float f) { return (float_to_bits(f) & 0x7f800000u) == 0x7f800000u; }

// Runs body(begin, end) over [0, n) on ATen's intra-op thread pool.
template <typename Body>
inline void parallel_blocks(int64_t n, const Body& body) {
  at::parallel_for(0, n, kGrain, body);
}

}  // namespace memkern::cpu

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <optional>

namespace memkern::cpu {

// Stands for "no low-precision parameter copy to write" in the kernels' templates.
struct NoParams {};

template <typename F>
inline void dispatch_float_kind(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "memkern: unsupported dtype ", dtype);
  }
}

// Calls f(grad_t{}, param_t{}) for the grads' dtype and the optional params' dtype
// (NoParams when there is no parameter copy to write).
template <typename F>
inline void dispatch_grad_and_param(at::ScalarType grad_dtype,
                                    std::optional<at::ScalarType> param_dtype, const F& f) {
  dispatch_float_kind(grad_dtype, [&](auto grad_tag) {
    if (!param_dtype.has_value()) return f(grad_tag, NoParams{});
    dispatch_float_kind(*param_dtype, [&](auto param_tag) { f(grad_tag, param_tag); });
  });
}

template <typename param_t>
inline void store_param(param_t* params, int64_t i, float w) {
  if constexpr (!std::is_same_v<param_t, NoParams>) params[i] = from_float<param_t>(w);
}

// Reads a one-element float32 tensor that lives in host memory (no sync on CPU).
inline float read_scalar(const at::Tensor& t) { return *t.const_data_ptr<float>(); }

inline bool found_inf_set(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && read_scalar(*found_inf) != 0.0f;
}

template <typename T>
inline T* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? static_cast<T*>(t->data_ptr()) : nullptr;
}

// Calls f(grads_data, params_data) with the typed data of the grads and of the optional
// params (a null NoParams* when there is no parameter copy to write).
template <typename F>
inline void with_grad_and_param_data(const at::Tensor& grads,
                                     const std::optional<at::Tensor>& params, const F& f) {
  std::optional<at::ScalarType> param_dtype;
  if (params.has_value()) param_dtype = params->scalar_type();
  dispatch_grad_and_param(grads.scalar_type(), param_dtype, [&](auto grad_tag, auto param_tag) {
    using grad_t = decltype(grad_tag);
    using param_t = decltype(param_tag);
    f(static_cast<const grad_t*>(grads.const_data_ptr()), data_or_null<param_t>(params));
  });
}

// params + begin, or null (NoParams: there is no parameter copy).
template <typename param_t>
inline param_t* params_from(param_t* params, int64_t begin) {
  if constexpr (std::is_same_v<param_t, NoParams>) {
    return nullptr;
  } else {
    return params == nullptr ? nullptr : params + begin;
  }
}

}  // namespace memkern::cpu
