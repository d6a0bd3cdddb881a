// The per-row math of memkern's cross-entropy kernels, compiled for the host and the device: the
// CUDA kernels (csrc/cuda/cross_entropy.cu) and the CPU kernels (csrc/cpu/cross_entropy.cpp) both
// include it, so the CPU test suite runs the very tile loop, rescaling and formulas a GPU runs.
// Contracts: memkern/ops/cross_entropy.py. Torch-free (plain C++ and CUDA), so CI can compile it
// with nvcc alone.
//
// A row of V logits is walked in tiles: an optional head tile (the values before the first
// 16-byte boundary, so that every later tile is one aligned vector load on the GPU), then tiles
// of `Tile` values (16 bytes of logits), the last one possibly partial. Each of `lanes` lanes
// (GPU threads; CPU accumulators) takes tiles lane, lane + lanes, lane + 2 lanes, ... and keeps
// an online softmax normaliser over them: the running maximum and the sum of exp(z - maximum),
// rescaled once per tile when the maximum grows; the lanes' normalisers are then merged.
//
// Per-row statistics beside the loss, each computed only when asked (`outputs`, a mask of the
// kRow* bits): the entropy of softmax(z) (online, from one more running sum), whether the
// target is the row's first maximum (torch.argmax's choice), and the mean logit.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MEMKERN_CE_HD __host__ __device__ __forceinline__
#else
// always inlined (as __forceinline__ on the GPU) so that the CPU compiler vectorises the loops
// that call these: a call left in a loop stops it
#define MEMKERN_CE_HD inline __attribute__((always_inline))
#endif
// The loops over one tile, fully unrolled: on the CPU the loop over lanes around them then
// vectorises. (nvcc's host pass, which runs no tile loop, takes neither pragma quietly.)
#if defined(__CUDA_ARCH__)
#define MEMKERN_CE_UNROLL _Pragma("unroll")
#elif defined(__CUDACC__)
#define MEMKERN_CE_UNROLL
#else
#define MEMKERN_CE_UNROLL _Pragma("GCC unroll 16")
#endif

namespace memkern::cross_entropy {

// The per-row statistics of the rows op (memkern/ops/cross_entropy.py: ROW_ENTROPY, ...): bit
// masks of its `outputs`, and the row of its [3, n] statistics each one is written to.
constexpr int kRowEntropy = 1;
constexpr int kRowIsTop1 = 2;
constexpr int kRowMeanLogit = 4;
constexpr int kEntropyRow = 0;
constexpr int kIsTop1Row = 1;
constexpr int kMeanLogitRow = 2;

// exp(x) in float32 on the host: 2^n exp(r) with n = round(x / ln 2), r = x - n ln 2 in two
// parts (Cody-Waite), exp(r) by Cephes' degree-7 polynomial (within 2 ulp of exp), 2^n applied
// in two factors so that subnormal and overflowing results come out right. Branch-free and
// call-free, so the CPU compiler vectorises the loops around it (a call of the C library's
// expf it cannot); NaN stays NaN, exp(-inf) = 0, exp(inf) = inf.
MEMKERN_CE_HD float host_expf(float x) {
  const float clamped = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float rounder = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an int
  const float n = (clamped * 1.44269504088896341f + rounder) - rounder;
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t k = static_cast<int32_t>(n);
  const int32_t half = k / 2;
  const int32_t bits1 = (half + 127) << 23, bits2 = (k - half + 127) << 23;
  float scale1, scale2;
  memcpy(&scale1, &bits1, sizeof scale1);
  memcpy(&scale2, &bits2, sizeof scale2);
  const float result = p * scale1 * scale2;
  return x != x ? x : result;
}

MEMKERN_CE_HD float exp_of(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return host_expf(x);
#endif
}
MEMKERN_CE_HD double exp_of(double x) { return exp(x); }
MEMKERN_CE_HD float log_of(float x) { return logf(x); }
MEMKERN_CE_HD double log_of(double x) { return log(x); }
MEMKERN_CE_HD float tanh_of(float x) { return tanhf(x); }
MEMKERN_CE_HD double tanh_of(double x) { return tanh(x); }

// The larger of a and b, NaN if either is NaN (as torch's max; fmax would drop the NaN).
template <typename T>
MEMKERN_CE_HD T max_nan(T a, T b) {
  return (a > b || a != a) ? a : b;
}

// A lane's online softmax normaliser over the logits it has seen, and their sum (for label
// smoothing's mean). `moment` (kept by online_add<true> only) is what the entropy needs: with
// p = softmax, entropy = log(sum) - moment / sum, two terms >= 0, so no cancellation however
// large the logits. Before any logit: max = -inf, sum = 0, total = 0, moment = 0.
template <typename T>
struct Online {
  T max;
  T sum;     // sum of exp(z - max)
  T total;   // sum of z
  T moment;  // sum of exp(z - max) (z - max), <= 0
};

template <typename T>
MEMKERN_CE_HD Online<T> online_start() {
  return {-static_cast<T>(INFINITY), T(0), T(0), T(0)};
}

// A's moment rescaled from its maximum to m >= a.max, whose factor r = exp(a.max - m) the caller
// has: r (moment + sum (a.max - m)). 0 while the lane has seen only -inf (0 (-inf) would be NaN).
template <typename T>
MEMKERN_CE_HD T moment_at(const Online<T>& a, T m, T r) {
  return a.sum == T(0) ? T(0) : r * (a.moment + a.sum * (a.max - m));
}

// Adds a tile of 1 <= k <= K logits (z[k..K) are ignored): the running sum is rescaled once, to
// the tile's new maximum. While every logit seen is -inf the sum stays 0 (exp(-inf - -inf)
// would be NaN); a NaN logit makes the sum NaN, and +inf makes it NaN through exp(inf - inf),
// as torch's log_softmax. The exponentials of the whole tile are taken first, then summed in
// order: a map the CPU compiler vectorises, and the same sum on every device.
// With Entropy, the moment too, each term exp(z - m) (z - m) taken as 0 where the exponential
// is (a -inf logit: 0 (-inf) would be NaN).
template <bool Entropy = false, typename T, int K>
MEMKERN_CE_HD void online_add(Online<T>& a, const T (&z)[K], int k) {
  T tile_max = z[0];
  MEMKERN_CE_UNROLL
  for (int i = 1; i < K; ++i) tile_max = i < k ? max_nan(tile_max, z[i]) : tile_max;
  const T m = max_nan(a.max, tile_max);
  T e[K];
  MEMKERN_CE_UNROLL
  for (int i = 0; i < K; ++i) e[i] = i < k ? exp_of(z[i] - m) : T(0);
  const T r = exp_of(a.max - m);
  T sum = a.sum * r;
  T total = a.total;
  MEMKERN_CE_UNROLL
  for (int i = 0; i < K; ++i) {
    sum += e[i];
    total += i < k ? z[i] : T(0);
  }
  if constexpr (Entropy) {
    T moment = moment_at(a, m, r);
    MEMKERN_CE_UNROLL
    for (int i = 0; i < K; ++i) moment += e[i] == T(0) ? T(0) : e[i] * (z[i] - m);
    a.moment = m == -static_cast<T>(INFINITY) ? a.moment : moment;
  }
  a.total = total;
  a.sum = m == -static_cast<T>(INFINITY) ? a.sum : sum;  // branch-free: the lanes vectorise
  a.max = m;
}

// a <- the normaliser over the logits of a and b (with Entropy, the moment too).
template <bool Entropy = false, typename T>
MEMKERN_CE_HD void online_merge(Online<T>& a, const Online<T>& b) {
  const T m = max_nan(a.max, b.max);
  a.total += b.total;
  if (m == -static_cast<T>(INFINITY)) return;
  const T ra = exp_of(a.max - m), rb = exp_of(b.max - m);
  if constexpr (Entropy) a.moment = moment_at(a, m, ra) + moment_at(b, m, rb);
  a.sum = a.sum * ra + b.sum * rb;
  a.max = m;
}

// log(sum exp(z)) of the row: -inf when every logit is -inf.
template <typename T>
MEMKERN_CE_HD T online_lse(const Online<T>& a) {
  return a.max + log_of(a.sum);
}

// The entropy -sum p log p of softmax(z) (0 log 0 = 0: a -inf logit adds nothing), from a
// normaliser kept with Entropy: NaN when a logit is NaN or +inf, or every one is -inf.
template <typename T>
MEMKERN_CE_HD T online_entropy(const Online<T>& a) {
  return log_of(a.sum) - a.moment / a.sum;
}

// Whether logit v is where torch.argmax may stop in a row whose maximum (max_nan over the row)
// is `max`: equal to it, or NaN when the row holds a NaN (argmax takes the first NaN).
template <typename T>
MEMKERN_CE_HD bool at_max(T v, T max) {
  return max != max ? v != v : v == max;
}

// The tiles of one row of n logits whose first `head` values (0 <= head < Tile) come before a
// 16-byte boundary: tile 0 is the head when head > 0, then tiles of Tile values from there,
// the last one possibly partial.
template <int Tile>
struct RowTiles {
  int64_t n;
  int64_t head;

  MEMKERN_CE_HD int64_t count() const {
    return (head > 0 ? 1 : 0) + (n - head + Tile - 1) / Tile;
  }
  // Index of the first logit of tile i, and how many it holds.
  MEMKERN_CE_HD int64_t first(int64_t i) const {
    if (head > 0) return i == 0 ? 0 : head + (i - 1) * Tile;
    return i * Tile;
  }
  MEMKERN_CE_HD int size(int64_t i) const {
    if (head > 0 && i == 0) return static_cast<int>(head);
    const int64_t left = n - first(i);
    return static_cast<int>(left < Tile ? left : Tile);
  }
  // Whether tile i is a full, aligned vector of Tile values.
  MEMKERN_CE_HD bool full(int64_t i) const {
    return !(head > 0 && i == 0) && n - first(i) >= Tile;
  }
};

// The head of a row of n logits that starts at byte address `address`, with `bytes` bytes per
// logit (a power of two <= 16): the values before the first 16-byte boundary, and never more
// than the row holds (a row shorter than a tile may end before that boundary).
MEMKERN_CE_HD int64_t head_of(uintptr_t address, int64_t bytes, int64_t n) {
  const int64_t misalignment = static_cast<int64_t>(address % 16);
  const int64_t head = misalignment == 0 ? 0 : (16 - misalignment) / bytes;
  return head < n ? head : n;
}

// Soft-capping (Gemma 2's final_logit_softcapping): the logit cap * tanh(z / cap) when cap > 0,
// with *slope its derivative 1 - tanh^2 = 4 e / (1 + e)^2, e = exp(-2 |z / cap|) — accurate
// where tanh saturates, unlike 1 - t * t of a rounded t; z itself and slope 1 when cap == 0.
template <typename T>
MEMKERN_CE_HD T capped(T z, T cap, T* slope) {
  if (!(cap > T(0))) {
    *slope = T(1);
    return z;
  }
  const T u = z / cap;
  const T e = exp_of(T(-2) * (u < T(0) ? -u : u));
  *slope = T(4) * e / ((T(1) + e) * (T(1) + e));
  return cap * tanh_of(u);
}

// The loss of a kept row: lse - (1 - eps) z[t] - eps mean(z) (the one-hot term only when the
// target is a class index in [0, V)), i.e. F.cross_entropy's -(1 - eps) logp[t] - eps mean(logp).
template <typename T>
MEMKERN_CE_HD T row_loss(T lse, bool in_range, T z_target, T total, int64_t num_classes, T eps) {
  T loss = lse;
  if (in_range) loss -= (T(1) - eps) * z_target;
  if (eps > T(0)) loss -= eps * (total / static_cast<T>(num_classes));
  return loss;
}

// log softmax(z)[c] from the row's normaliser, in torch's order: (z - max) - log(sum), whose
// first difference is exact near the maximum (z - lse would round at lse's magnitude).
template <typename T>
MEMKERN_CE_HD T log_prob(T z, T max, T log_sum) {
  return (z - max) - log_sum;
}

// One gradient element of a kept row: scale * (softmax - eps / V - (1 - eps) [c == t]), in that
// order of roundings (the reference's), times the soft-cap's slope. `logp` is log softmax(z)[c]
// (log_prob, or z - lse from a saved log-sum-exp); `hit` is 1 - eps at the target column and 0
// elsewhere; `spread` is eps / V.
template <typename T>
MEMKERN_CE_HD T grad_value(T logp, T hit, T spread, T scale, T slope) {
  T g = exp_of(logp);
  g -= spread;
  g -= hit;
  g *= scale;
  return g * slope;
}

// grad_value plus the entropy's term: the gradient of scale * loss + entropy_scale * entropy,
// d entropy / dz = -p (log p + entropy) (0 where p = 0: p log p -> 0), before the cap's slope.
template <typename T>
MEMKERN_CE_HD T grad_value_entropy(T logp, T hit, T spread, T scale, T slope, T entropy,
                                   T entropy_scale) {
  const T p = exp_of(logp);
  T g = p;
  g -= spread;
  g -= hit;
  g *= scale;
  g -= entropy_scale * (p == T(0) ? T(0) : p * (logp + entropy));
  return g * slope;
}

}  // namespace memkern::cross_entropy
