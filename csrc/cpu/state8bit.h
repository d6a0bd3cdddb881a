// The block-wise 8-bit optimizer-state format on the CPU backend, shared by every 8-bit
// optimizer kernel (adamw8bit.cpp, sgd8bit.cpp): the element math of csrc/math/state8bit.h
// (which the CUDA kernels run too) with its per-block factors, the absmax, and the loop over
// the blocks with its per-block part (update_qblock: staging, absmax and codes around the
// optimizer's update). Format and map, defined and justified: memkern/ops/adamw8bit.py;
// constants: memkern/kernels/state8bit.py.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "../math/state8bit.h"
#include "flat_math.h"

namespace memkern::cpu {

using math::kQBlock;
using math::kSignedCodes;
using math::kUnsignedCodes;

// Always inlined: the callers are compiled per ISA (MEMKERN_VECTOR_CLONES) and these must be
// compiled, and vectorised, with them.
#define MEMKERN_INLINE [[gnu::always_inline]] inline

// Written for GCC's vectoriser, in the callers' per-block loops of kQBlock elements (why plain
// loops and not intrinsics: flat_math.h): the element math of csrc/math/state8bit.h (no
// division per element, truncating conversions or an added constant for the rounding: SSE2
// has those; a vectorised floor or round needs SSE4.1) and an integer max for the absmax.

// The value of a code from its block's absmax (the factor is hoisted out of the loops).
MEMKERN_INLINE float dequantize(int8_t code, float absmax) {
  return math::dequantize(code, math::signed_value_factor(absmax));
}

MEMKERN_INLINE float dequantize(uint8_t code, float absmax) {
  return math::dequantize(code, math::unsigned_value_factor(absmax));
}

// The absmax of a block, accumulated in the callers' update loops (no second pass over the
// block) as the largest abs_bits of its values (math::abs_bits, as int32: a signed integer
// max vectorises on every ISA): a result >= kInfBits means a non-finite value.
constexpr int32_t kInfBits = static_cast<int32_t>(math::kInfBits);

MEMKERN_INLINE int32_t abs_bits(float x) { return static_cast<int32_t>(math::abs_bits(x)); }

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

// Quantization (math::signed_code / unsigned_code), with the per-block factors from the
// functions below (a constant in the callers' code loops). The roots are what this step's time
// goes to on the CPU (on the AMD EPYC host one 8-wide square root takes as long as ~15 other
// vector instructions), so each code takes one.

// math::signed_code's factor for a block of n staged values x (first moments, momentum) whose
// largest abs_bits is amax_bits, after storing the absmax (store_absmax; 0 for a block without
// codes); the values are scaled by the block's prescale in place.
MEMKERN_INLINE float signed_code_factor(int32_t amax_bits, float* __restrict x, int64_t n,
                                        float* absmax) {
  const float amax = store_absmax(amax_bits, x, n, absmax);
  if (amax == 0.0f) return 0.0f;
  const float pre = math::signed_code_prescale(amax);
  if (pre != 1.0f) {
    for (int64_t i = 0; i < n; ++i) x[i] *= pre;
  }
  return math::signed_code_factor(amax * pre);
}

// math::unsigned_code's factor for a block of n staged sqrt_x whose x have the largest
// abs_bits amax_bits, after storing the absmax (store_absmax; 0 for a block without codes).
MEMKERN_INLINE float unsigned_code_factor(int32_t amax_bits, float* __restrict sqrt_x,
                                          int64_t n, float* absmax) {
  const float amax = store_absmax(amax_bits, sqrt_x, n, absmax);
  return amax == 0.0f ? 0.0f : math::unsigned_code_factor(amax);
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
MEMKERN_INLINE int8_t to_code(int8_t, float x, float factor) {
  return math::signed_code(x, factor);
}
MEMKERN_INLINE uint8_t to_code(uint8_t, float x, float factor) {
  return math::unsigned_code(x, factor);
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
