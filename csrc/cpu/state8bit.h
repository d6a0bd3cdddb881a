// The block-wise 8-bit optimizer-state format on the CPU backend, shared by every 8-bit
// optimizer kernel (adamw8bit.cpp, sgd8bit.cpp): the block size, the two code maps, the
// quantizer of one block and the parallel loop over the blocks. Format and map, defined and justified: memkern/ops/adamw8bit.py; constants:
// memkern/kernels/state8bit.py.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "flat_math.h"

namespace memkern::cpu {

// memkern/kernels/state8bit.py: block size and, per code type, code range and power.
constexpr int64_t kQBlock = 256;
constexpr float kSignedCodes = 127.0f;    // int8:  sign(c) * (|c| / 127)^2 * absmax
constexpr float kUnsignedCodes = 255.0f;  // uint8: (c / 255)^4 * absmax

// Always inlined: the callers are compiled per ISA (MEMKERN_VECTOR_CLONES) and these must be
// compiled, and vectorised, with them.
#define MEMKERN_INLINE [[gnu::always_inline]] inline

// Written for GCC's vectoriser, in the callers' per-block loops of kQBlock elements (why plain
// loops and not intrinsics: flat_math.h): no division per element (the per-block factors
// below depend on the absmax only, so the compiler hoists them out of the loop), an integer
// max for the absmax, and a truncating conversion for the rounding (SSE2 has one; a
// vectorised floor needs SSE4.1). Each direction is the map of memkern/ops/adamw8bit.py in
// another order of float32 roundings: values within a few ulp of the reference's, codes equal
// but for a value within an ulp of a code boundary.

// The value of a signed code (first moments, momentum): sign(c) * (|c| / 127)^2 * absmax as
// (c |c| 2^-14) (exact) times absmax 2^14 / 127^2.
MEMKERN_INLINE float dequantize(int8_t code, float absmax) {
  const float c = static_cast<float>(code);
  constexpr float kFactor = 0x1p14f / (kSignedCodes * kSignedCodes);
  return ((c * std::fabs(c)) * 0x1p-14f) * (absmax * kFactor);
}

// The value of an unsigned code (second moments, >= 0): (c / 255)^4 * absmax as
// ((c / 256)^2)^2 (the square exact) times absmax (256 / 255)^4; the powers of two keep the
// per-block factor as far from underflow as absmax itself.
MEMKERN_INLINE float dequantize(uint8_t code, float absmax) {
  const float q = static_cast<float>(code) * 0x1p-8f;
  const float q2 = q * q;
  constexpr float kFactor = static_cast<float>(0x1p32 / (255.0 * 255.0 * 255.0 * 255.0));
  return (q2 * q2) * (absmax * kFactor);
}

// The absmax of n values as the bits of a float: the largest |x| (inf and NaN bits order above
// every finite value, so a result >= kInfBits means the block holds a non-finite value).
constexpr int32_t kInfBits = 0x7f800000;

MEMKERN_INLINE int32_t absmax_bits(const float* __restrict x, int64_t n) {
  int32_t amax = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t bits = static_cast<int32_t>(float_to_bits(x[i]) & 0x7fffffffu);
    amax = bits > amax ? bits : amax;
  }
  return amax;
}

// Stores the absmax of a block of n <= kQBlock values and returns it, or stores NaN (a value
// is not finite) or 0 (all are zero) with zero codes and returns 0: no codes left to compute.
template <typename code_t>
MEMKERN_INLINE float store_absmax(const float* __restrict x, int64_t n,
                                  code_t* __restrict codes, float* absmax) {
  const int32_t amax_bits = absmax_bits(x, n);
  if (amax_bits >= kInfBits || amax_bits == 0) {
    for (int64_t i = 0; i < n; ++i) codes[i] = 0;
    *absmax = amax_bits == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    return 0.0f;
  }
  *absmax = bits_to_float(static_cast<uint32_t>(amax_bits));
  return *absmax;
}

// Quantization: the code of nearest value (memkern/ops/adamw8bit.py) without a division per
// element, on the root r = C (|x| / absmax)^(1/p) (per-block factor C / absmax^(1/p), finite for
// every positive absmax, even a subnormal one). Its truncation lo is the code below (or one
// off where r rounds across an integer: the comparison then still picks the nearer code; lo is
// C for the absmax itself, and stays C); c = lo + 1 where r^p lies above the mean of lo^p and
// (lo + 1)^p, written in u = lo + 1/2: u^2 + 1/4 (p = 2, exact in float32) and
// u^4 + (3/2) u^2 + 1/16 (p = 4, u^2 exact). The select is on integers: GCC if-converts (and
// so vectorises) no float operation that may trap.

// Codes and absmax of one block of n <= kQBlock values of any sign: NaN and zero codes when a
// value is not finite, zero codes for an all-zero block.
MEMKERN_INLINE void quantize_block(const float* __restrict x, int64_t n,
                                   int8_t* __restrict codes, float* absmax) {
  const float amax = store_absmax(x, n, codes, absmax);
  if (amax == 0.0f) return;
  const float root_factor = kSignedCodes / std::sqrt(amax);
  for (int64_t i = 0; i < n; ++i) {
    const float root = std::sqrt(std::fabs(x[i])) * root_factor;
    const int32_t lo = static_cast<int32_t>(root);
    const float u = static_cast<float>(lo) + 0.5f;
    const int32_t c = lo + (root * root > u * u + 0.25f ? 1 : 0);
    codes[i] = static_cast<int8_t>(x[i] < 0.0f ? -c : c);
  }
}

// As above for n values >= 0 (uint8 codes), given their square roots `sqrt_x` as well: the
// AdamW update has sqrt(v) at hand, which gives r^2 = sqrt_x C^2 / sqrt(absmax) by a product.
MEMKERN_INLINE void quantize_block(const float* __restrict x, const float* __restrict sqrt_x,
                                   int64_t n, uint8_t* __restrict codes, float* absmax) {
  const float amax = store_absmax(x, n, codes, absmax);
  if (amax == 0.0f) return;
  const float square_root_factor = kUnsignedCodes * kUnsignedCodes / std::sqrt(amax);
  for (int64_t i = 0; i < n; ++i) {
    const float root2 = sqrt_x[i] * square_root_factor;
    const int32_t lo = static_cast<int32_t>(std::sqrt(root2));
    const float u = static_cast<float>(lo) + 0.5f;
    const float u2 = u * u;
    const int32_t up = root2 * root2 > (u2 + 1.5f) * u2 + 0.0625f ? 1 : 0;
    codes[i] = static_cast<uint8_t>(lo + up);
  }
}

// The blocks [first, last) of an n-element buffer: update_block(b, len) for each, with len the
// constant kQBlock but for the buffer's last, partial block. update_block is the per-optimizer
// part (dequantize, update, requantize one block), always inlined here: this is the function
// compiled per ISA, and a constant len makes each of its loops a fixed-size one, which
// vectorises without a tail.
template <typename BlockUpdate>
MEMKERN_VECTOR_CLONES void update_qblocks(BlockUpdate update_block, int64_t n, int64_t first,
                                          int64_t last) {
  const int64_t full = n / kQBlock < last ? n / kQBlock : last;
  for (int64_t b = first; b < full; ++b) update_block(b, kQBlock);
  if (full < last) update_block(full, n - full * kQBlock);
}

// update_qblocks over every block of an n-element buffer, on ATen's intra-op thread pool.
template <typename BlockUpdate>
inline void parallel_update_qblocks(int64_t n, const BlockUpdate& update_block) {
  const int64_t blocks = (n + kQBlock - 1) / kQBlock;
  at::parallel_for(0, blocks, kGrain / kQBlock, [&](int64_t first, int64_t last) {
    update_qblocks(update_block, n, first, last);
  });
}

}  // namespace memkern::cpu
