// The mask of memkern::dropout (contract: memkern/ops/dropout.py), shared by the CPU kernel
// (csrc/cpu/dropout.cpp) and the CUDA kernel (csrc/cuda/dropout.cu): element i of n is kept when
// word i / n4 of Philox4x32-10 counter i % n4 (n4 = ceil(n / 4)) under key seed is >= threshold.
// Integer math only, so both produce the reference's masks bit for bit.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../math/host_device.h"

namespace memkern::math {

// Philox4x32-10 (Salmon et al., 2011) constants, as tl.randint4x and the reference use them.
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u, kPhiloxKeyB = 0xBB67AE85u;
constexpr uint32_t kPhiloxRoundA = 0xD2511F53u, kPhiloxRoundB = 0xCD9E8D57u;
constexpr int kPhiloxRounds = 10;

// The four 32-bit output words of counter (counter low word, high word, 0, 0) under key
// (k0, k1).
MEMKERN_HOST_DEVICE void philox4x32(uint64_t counter, uint32_t k0, uint32_t k1,
                                    uint32_t out[4]) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  for (int r = 0; r < kPhiloxRounds; ++r) {
    const uint64_t pb = uint64_t{kPhiloxRoundB} * c2, pa = uint64_t{kPhiloxRoundA} * c0;
    const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
    const uint32_t n1 = static_cast<uint32_t>(pb);
    const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
    const uint32_t n3 = static_cast<uint32_t>(pa);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

// The Philox key of an int64 seed: (low word, high word).
struct PhiloxKey {
  uint32_t k0, k1;
};
MEMKERN_HOST_DEVICE PhiloxKey philox_key(int64_t seed) {
  const auto s = static_cast<uint64_t>(seed);
  return {static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32)};
}

// Counters of a tensor of n elements: ceil(n / 4), each feeding four elements.
MEMKERN_HOST_DEVICE int64_t dropout_counters(int64_t n) { return (n + 3) / 4; }

// Words below this are dropped: round(p * 2**32) (nearest, ties to even, as Python's round),
// in [0, 2**32]. Host only (the launchers pass it to the kernels).
inline uint64_t dropout_threshold(double p) {
  const double t = std::nearbyint(p * 4294967296.0);
  if (t <= 0.0) return 0;
  return t >= 4294967296.0 ? uint64_t{1} << 32 : static_cast<uint64_t>(t);
}

// The multiplier of kept elements (0 when everything is dropped). Host only.
inline double dropout_scale(double p) { return p >= 1.0 ? 0.0 : 1.0 / (1.0 - p); }

// Element value (in the compute type: float for 16-bit and float32 x, double for float64) of
// an element whose mask word is `word`: x * scale when kept, else 0 — also where x is NaN/inf.
template <typename compute_t>
MEMKERN_HOST_DEVICE compute_t dropout_element(uint32_t word, uint64_t threshold, compute_t x,
                                              compute_t scale) {
  return uint64_t{word} >= threshold ? x * scale : compute_t(0);
}

}  // namespace memkern::math
