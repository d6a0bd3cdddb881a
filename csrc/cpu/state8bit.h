// The block-wise 8-bit optimizer-state format on the CPU backend, shared by every 8-bit
// optimizer kernel (adamw8bit.cpp, sgd8bit.cpp): the block size, the two code maps, the
// per-element quantizers with their per-block factors, and the loop over the blocks with its
// per-block part (update_qblock: staging, absmax and codes around the optimizer's update).
// Format and map, defined and justified: memkern/ops/adamw8bit.py; constants:
// memkern/kernels/state8bit.py.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

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
// loops and not intrinsics: flat_math.h): no division per element (per-block factors), an
// integer max for the absmax, and truncating conversions or an added constant for the
// rounding (SSE2 has those; a vectorised floor or round needs SSE4.1). Each direction is the
// map of memkern/ops/adamw8bit.py in another order of float32 roundings: values within a few
// ulp of the reference's, codes equal but for a value within an ulp of a code boundary.

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

// The absmax of a block, accumulated in the callers' update loops (no second pass over the
// block) as the largest abs_bits of its values: an integer max, which vectorises; inf and NaN
// bits order above every finite value, so a result >= kInfBits means a non-finite value.
constexpr int32_t kInfBits = 0x7f800000;

MEMKERN_INLINE int32_t abs_bits(float x) {
  return static_cast<int32_t>(float_to_bits(x) & 0x7fffffffu);
}

// The largest abs_bits of n values, for a caller that cannot fold it into its update loop.
MEMKERN_INLINE int32_t absmax_bits(const float* __restrict x, int64_t n) {
  int32_t amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = abs_bits(x[i]) > amax ? abs_bits(x[i]) : amax;
  return amax;
}

// Stores the absmax of a block whose largest abs_bits is amax_bits and returns it, or stores
// NaN (a value is not finite) or 0 (all are zero), zeroes the block's n staged inputs `x` of
// the code functions below and returns 0: a factor of 0 then gives zero codes (a NaN or inf
// left in x would reach a float -> int conversion, undefined in C++).
MEMKERN_INLINE float store_absmax(int32_t amax_bits, float* __restrict x, int64_t n,
                                  float* absmax) {
  if (amax_bits >= kInfBits || amax_bits == 0) {
    for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
    *absmax = amax_bits == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    return 0.0f;
  }
  *absmax = bits_to_float(static_cast<uint32_t>(amax_bits));
  return *absmax;
}

// Quantization: the code nearest in (|c| / C)^2 (memkern/ops/adamw8bit.py), no division per
// element, with per-block factors from the functions below (a constant in the callers' code
// loops). The roots are what this step's time goes to on the CPU (on the AMD EPYC host one
// 8-wide square root takes as long as ~15 other vector instructions), so each code takes one.

// The code k in [0, C] whose k^2 is nearest to y in [0, C^2] (y = C^2 |m| / absmax, or
// C^2 sqrt(v / absmax)), in closed form: the midpoint of k^2 and (k + 1)^2 is k^2 + k + 1/2 =
// (k + 1/2)^2 + 1/4, so the code is round(sqrt(y - 1/4)) (a value exactly on a midpoint in
// float32 goes to the even code). Below 1/4 the root of |y - 1/4| is at most 1/2, which rounds
// to 0 as well: no clamp at 0, which GCC turns into a branch around the root (the result is
// constant there) and then vectorises nothing. Returns that root with sign_bit copied onto it,
// plus 1.5 * 2^23: the rounded code then sits in the low bits of the float (SSE2 has no vector
// rounding).
MEMKERN_INLINE uint32_t nearest_square_code_bits(float y, uint32_t sign_bit) {
  const float root = std::sqrt(std::fabs(y - 0.25f));
  return float_to_bits(bits_to_float(float_to_bits(root) | sign_bit) + 0x1.8p23f);
}

// Signed codes (first moments, momentum; p = 2): y = |x| C^2 / absmax, the value's nearest.
MEMKERN_INLINE int8_t signed_code(float x, float factor) {
  return static_cast<int8_t>(
      nearest_square_code_bits(std::fabs(x) * factor, float_to_bits(x) & 0x80000000u));
}

// signed_code's factor for a block of n staged values x (first moments, momentum) whose
// largest abs_bits is amax_bits: C^2 / absmax, after storing the absmax (store_absmax; 0 for
// a block without codes). Below 2^-100 C^2 / absmax may overflow: the block's values and
// absmax are scaled by 2^64 first (exact), which leaves every s as it is.
MEMKERN_INLINE float signed_code_factor(int32_t amax_bits, float* __restrict x, int64_t n,
                                        float* absmax) {
  float amax = store_absmax(amax_bits, x, n, absmax);
  if (amax == 0.0f) return 0.0f;
  if (amax < 0x1p-100f) {
    for (int64_t i = 0; i < n; ++i) x[i] *= 0x1p64f;
    amax *= 0x1p64f;
  }
  return kSignedCodes * kSignedCodes / amax;
}

// Unsigned codes (second moments, x >= 0; p = 4) from sqrt(x), which the AdamW update has at
// hand: y = sqrt(x) C^2 / sqrt(absmax), the code whose value's root is nearest to the root the
// update divides by.
MEMKERN_INLINE uint8_t unsigned_code(float sqrt_x, float factor) {
  return static_cast<uint8_t>(nearest_square_code_bits(sqrt_x * factor, 0u));
}

// unsigned_code's factor for a block of n staged sqrt_x whose x have the largest abs_bits
// amax_bits: C^2 / sqrt(absmax), after storing the absmax (store_absmax; 0 for a block
// without codes).
MEMKERN_INLINE float unsigned_code_factor(int32_t amax_bits, float* __restrict sqrt_x,
                                          int64_t n, float* absmax) {
  const float amax = store_absmax(amax_bits, sqrt_x, n, absmax);
  return amax == 0.0f ? 0.0f : kUnsignedCodes * kUnsignedCodes / std::sqrt(amax);
}

// One moment of an 8-bit optimizer state: its codes (int8: the signed map, staged as the value;
// uint8: the unsigned map, staged as the value's square root, which the AdamW update has at
// hand) and the absmax of each block.
template <typename code_t>
struct QMoment {
  code_t* codes;
  float* absmax;
};

// The factor of a block's codes and their code function, per code type (see above).
MEMKERN_INLINE float code_factor(int8_t, int32_t amax_bits, float* __restrict x, int64_t n,
                                 float* absmax) {
  return signed_code_factor(amax_bits, x, n, absmax);
}
MEMKERN_INLINE float code_factor(uint8_t, int32_t amax_bits, float* __restrict x, int64_t n,
                                 float* absmax) {
  return unsigned_code_factor(amax_bits, x, n, absmax);
}
MEMKERN_INLINE int8_t to_code(int8_t, float x, float factor) { return signed_code(x, factor); }
MEMKERN_INLINE uint8_t to_code(uint8_t, float x, float factor) {
  return unsigned_code(x, factor);
}

// update_qblock's staging: fn(rows) with K separate kQBlock-float arrays. Separate arrays, not
// rows of one: with rows of one array GCC steps the AdamW master loop with two induction
// variables, one instruction more per vector (callgrind: +1% instructions per AdamW step).
template <size_t K, typename Fn>
MEMKERN_INLINE void with_staging(const Fn& fn) {
  static_assert(K == 1 || K == 2, "an 8-bit optimizer keeps one or two moments");
  alignas(64) float first[kQBlock];
  if constexpr (K == 1) {
    fn(std::array<float*, 1>{first});
  } else {
    alignas(64) float second[kQBlock];
    fn(std::array<float*, 2>{first, second});
  }
}

// Block b of an 8-bit optimizer step, n <= kQBlock elements from begin = b * kQBlock, its K
// moments given by `moments`. update(b, begin, n, staged) is the optimizer's part: it
// dequantizes and updates the elements (master, params) and leaves each moment's new values
// in staged[k] (as QMoment says), returning their largest abs_bits per moment. Here: each
// moment's absmax and factor, then every moment's codes in one loop (their roots interleave
// with each other's other instructions). The lambdas are always inlined like the rest: left
// to GCC, n was no longer the constant kQBlock in them (+4% instructions per step).
template <typename BlockUpdate, typename... code_t, size_t... k>
MEMKERN_INLINE void update_qblock(const BlockUpdate& update, int64_t b, int64_t n,
                                  std::index_sequence<k...>, QMoment<code_t>... moments) {
  with_staging<sizeof...(k)>([&](const std::array<float*, sizeof...(k)>& staged)
                                 __attribute__((always_inline)) {
    const int64_t begin = b * kQBlock;
    const std::array<int32_t, sizeof...(k)> amax_bits = update(b, begin, n, staged);
    const float factors[] = {code_factor(code_t{}, amax_bits[k], staged[k], n,
                                         moments.absmax + b)...};
    [&](code_t* __restrict... out) __attribute__((always_inline)) {
      for (int64_t i = 0; i < n; ++i) {
        ((out[i] = to_code(code_t{}, staged[k][i], factors[k])), ...);
      }
    }(moments.codes + begin...);
  });
}

// The blocks [first, last) of an n-element buffer: update_qblock for each, with n the constant
// kQBlock but for the buffer's last, partial block. Everything per block is always inlined
// here: this is the function compiled per ISA, and a constant n makes each of its loops a
// fixed-size one, which vectorises without a tail. `update` is taken by value: a local copy's
// coefficients cannot change under the stores to the buffers, so GCC hoists their run-time
// branches out of the loops (with a reference, the SGD step vectorised nothing: 6.3x the
// instructions).
template <typename BlockUpdate, typename... code_t>
MEMKERN_VECTOR_CLONES void update_qblocks(const BlockUpdate update, int64_t n, int64_t first,
                                          int64_t last, QMoment<code_t>... moments) {
  const auto each = std::index_sequence_for<code_t...>{};
  const int64_t full = n / kQBlock < last ? n / kQBlock : last;
  for (int64_t b = first; b < full; ++b) update_qblock(update, b, kQBlock, each, moments...);
  if (full < last) update_qblock(update, full, n - full * kQBlock, each, moments...);
}

// update_qblocks over every block of an n-element buffer, on ATen's intra-op thread pool.
template <typename BlockUpdate, typename... code_t>
inline void parallel_update_qblocks(int64_t n, const BlockUpdate& update,
                                    QMoment<code_t>... moments) {
  const int64_t blocks = (n + kQBlock - 1) / kQBlock;
  at::parallel_for(0, blocks, kGrain / kQBlock, [&](int64_t first, int64_t last) {
    update_qblocks(update, n, first, last, moments...);
  });
}

}  // namespace memkern::cpu
