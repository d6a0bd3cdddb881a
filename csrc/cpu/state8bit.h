// The block-wise 8-bit optimizer-state format on the CPU backend, shared by every 8-bit
// optimizer kernel (adamw8bit.cpp, ...): the block size, the two code maps and the quantizer
// of one block. Format and map, defined and justified: memkern/ops/adamw8bit.py; constants:
// memkern/kernels/state8bit.py.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "flat_math.h"

namespace memkern::cpu {

// memkern/kernels/state8bit.py: block size and, per code type, code range and power.
constexpr int64_t kQBlock = 64;
constexpr float kSignedCodes = 127.0f;    // int8:  sign(c) * (|c| / 127)^2 * absmax
constexpr float kUnsignedCodes = 255.0f;  // uint8: (c / 255)^4 * absmax

// Always inlined: the callers are compiled per ISA (MEMKERN_VECTOR_CLONES) and these must be
// compiled, and vectorised, with them.
#define MEMKERN_INLINE [[gnu::always_inline]] inline

// The value of a signed code (first moments, momentum).
MEMKERN_INLINE float dequantize(int8_t code, float absmax) {
  const float q = std::fabs(static_cast<float>(code)) / kSignedCodes;
  return std::copysign((q * q) * absmax, static_cast<float>(code));
}

// The value of an unsigned code (second moments, >= 0).
MEMKERN_INLINE float dequantize(uint8_t code, float absmax) {
  const float q = static_cast<float>(code) / kUnsignedCodes;
  const float q2 = q * q;
  return (q2 * q2) * absmax;
}

// Codes and absmax of one block of n <= kQBlock values (int8 codes: any sign; uint8: >= 0):
// NaN and zero codes when a value is not finite, zero codes for an all-zero block. The absmax
// is taken on the bits of the non-negative values (ordered as the floats are), which
// vectorises; a float max would not.
template <typename code_t>
MEMKERN_INLINE void quantize_block(const float* x, int64_t n, code_t* codes, float* absmax) {
  constexpr bool kSigned = std::is_same_v<code_t, int8_t>;
  static_assert(kSigned || std::is_same_v<code_t, uint8_t>, "codes are int8 or uint8");
  uint32_t amax_bits = 0;
  int32_t non_finite = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    const bool finite = a <= FLT_MAX;
    non_finite += finite ? 0 : 1;
    const uint32_t bits = finite ? float_to_bits(a) : 0u;
    amax_bits = bits > amax_bits ? bits : amax_bits;
  }
  const float amax = bits_to_float(amax_bits);
  const bool usable = non_finite == 0 && amax > 0.0f;
  const float divisor = usable ? amax : 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    float r = std::sqrt(std::fabs(x[i]) / divisor);
    if constexpr (!kSigned) r = std::sqrt(r);
    float c = std::floor(r * (kSigned ? kSignedCodes : kUnsignedCodes) + 0.5f);
    c = usable ? c : 0.0f;
    if constexpr (kSigned) c = x[i] < 0.0f ? -c : c;
    codes[i] = static_cast<code_t>(static_cast<int32_t>(c));
  }
  *absmax = non_finite != 0 ? std::numeric_limits<float>::quiet_NaN() : amax;
}

}  // namespace memkern::cpu
