// The block-wise 8-bit optimizer-state format, element by element, shared by the CPU kernels
// (csrc/cpu/state8bit.h) and the CUDA kernels (csrc/cuda/kernels/state8bit.cuh): the block
// size, the two code maps in both directions, and the per-block factors they use. The same
// bits on both (host_device.h says how). Format and map, defined and justified:
// memkern/ops/adamw8bit.py; constants: memkern/kernels/state8bit.py.
//
// Each direction is the map in another order of float32 roundings than the reference's:
// products by per-block factors and one square root per code, no division per element. Values
// within a few ulp of the reference's; codes equal but for a value within an ulp of a code
// boundary (the oracle tests' tolerance). How a block finds its absmax is the backends' own
// (a vectorised integer max on the CPU, a warp reduction on the GPU).
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace memkern::math {

constexpr int64_t kQBlock = 256;
constexpr float kSignedCodes = 127.0f;    // int8:  sign(c) * (|c| / 127)^kSignedPower * absmax
constexpr float kUnsignedCodes = 255.0f;  // uint8: (c / 255)^kUnsignedPower * absmax
// The maps below are written for these powers (a square, a square of a square); exported to
// Python so that the reference and Triton maps are checked to use the same.
constexpr int64_t kSignedPower = 2;
constexpr int64_t kUnsignedPower = 4;
static_assert(kSignedPower == 2 && kUnsignedPower == 4, "the maps below are written for 2 and 4");

// abs_bits(x) orders like |x|, and inf and NaN above every finite value: the largest abs_bits
// of a block is its absmax, or says that a value is not finite (>= kInfBits).
constexpr uint32_t kInfBits = 0x7f800000u;

MEMKERN_HOST_DEVICE uint32_t abs_bits(float x) { return float_bits(x) & 0x7fffffffu; }

// ---------------------------------------------------------------------------- dequantize
// The per-block factor of a signed code's value (first moments, momentum): absmax 2^14 / 127^2.
MEMKERN_HOST_DEVICE float signed_value_factor(float absmax) {
  return absmax * (0x1p14f / (kSignedCodes * kSignedCodes));
}

// sign(c) (|c| / 127)^2 absmax as (c |c| 2^-14) (exact) times the block's factor.
MEMKERN_HOST_DEVICE float dequantize(int8_t code, float factor) {
  const float c = static_cast<float>(code);
  return mul_rn(mul_rn(mul_rn(c, std::fabs(c)), 0x1p-14f), factor);
}

// The per-block factor of an unsigned code's value (second moments): absmax (256 / 255)^4.
MEMKERN_HOST_DEVICE float unsigned_value_factor(float absmax) {
  constexpr double codes = kUnsignedCodes;
  return absmax * static_cast<float>(0x1p32 / (codes * codes * codes * codes));
}

// (c / 255)^4 absmax as ((c / 256)^2)^2 (the square exact) times the block's factor; the
// powers of two keep the factor as far from underflow as absmax itself.
MEMKERN_HOST_DEVICE float dequantize(uint8_t code, float factor) {
  const float q = mul_rn(static_cast<float>(code), 0x1p-8f);
  const float q2 = mul_rn(q, q);
  return mul_rn(mul_rn(q2, q2), factor);
}

// ------------------------------------------------------------------------------ quantize
// The code k in [0, C] whose k^2 is nearest to y = a * factor in [0, C^2] (y = C^2 |m| /
// absmax, or C^2 sqrt(v) / sqrt(absmax)), in closed form: the midpoint of k^2 and (k + 1)^2 is
// (k + 1/2)^2 + 1/4, so the code is round(sqrt(y - 1/4)), to the even code on an exact
// midpoint; below 1/4 the root of |y - 1/4| is at most 1/2, which rounds to 0 as well (no
// clamp, which would be a branch on the CPU). The rounding adds 1.5 * 2^23 to the root with
// sign_bit copied onto it: the code then sits in the low bits of the sum, two's complement for
// a negative one (SSE2 has no vector rounding; on the GPU it is as cheap as rintf). a and
// factor must be finite.
MEMKERN_HOST_DEVICE uint32_t square_code_bits(float a, float factor, uint32_t sign_bit) {
  const float root = sqrt_rn(std::fabs(fma_rn(a, factor, -0.25f)));
  return float_bits(bits_float(float_bits(root) | sign_bit) + 0x1.8p23f);
}

// A block's factor for signed codes: C^2 / absmax, of values and absmax scaled by
// signed_code_prescale(absmax) (below 2^-100, C^2 / absmax could overflow: 2^64, exact).
MEMKERN_HOST_DEVICE float signed_code_prescale(float absmax) {
  return absmax < 0x1p-100f ? 0x1p64f : 1.0f;
}

MEMKERN_HOST_DEVICE float signed_code_factor(float scaled_absmax) {
  return div_rn(kSignedCodes * kSignedCodes, scaled_absmax);
}

// The signed code (first moments, momentum) of x (times the block's prescale): the nearest in
// (|c| / C)^2.
MEMKERN_HOST_DEVICE int8_t signed_code(float scaled_x, float factor) {
  return static_cast<int8_t>(
      square_code_bits(std::fabs(scaled_x), factor, float_bits(scaled_x) & 0x80000000u));
}

// A block's factor for unsigned codes: C^2 / sqrt(absmax).
MEMKERN_HOST_DEVICE float unsigned_code_factor(float absmax) {
  return div_rn(kUnsignedCodes * kUnsignedCodes, sqrt_rn(absmax));
}

// The unsigned code (second moments, x >= 0) from sqrt(x), which the AdamW update has at hand:
// the code whose value's root is nearest to the root the update divides by.
MEMKERN_HOST_DEVICE uint8_t unsigned_code(float sqrt_x, float factor) {
  return static_cast<uint8_t>(square_code_bits(sqrt_x, factor, 0u));
}

}  // namespace memkern::math
