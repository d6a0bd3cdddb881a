// memkern::dropout on CPU: the mask of element i is a pure function of (seed, i), Philox4x32-10
// exactly as the reference and the Triton kernel draw it. Contract: memkern/ops/dropout.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "flat_math.h"

namespace memkern::cpu {
namespace {

constexpr uint32_t kKeyA = 0x9E3779B9u, kKeyB = 0xBB67AE85u;
constexpr uint32_t kRoundA = 0xD2511F53u, kRoundB = 0xCD9E8D57u;
constexpr int kRounds = 10;

// The four 32-bit output words of counter (c_lo, c_hi, 0, 0) under key (k0, k1).
inline void philox4x32(uint64_t counter, uint32_t k0, uint32_t k1, uint32_t out[4]) {
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  for (int r = 0; r < kRounds; ++r) {
    const uint64_t pb = uint64_t(kRoundB) * c2, pa = uint64_t(kRoundA) * c0;
    const uint32_t n0 = uint32_t(pb >> 32) ^ c1 ^ k0, n1 = uint32_t(pb);
    const uint32_t n2 = uint32_t(pa >> 32) ^ c3 ^ k1, n3 = uint32_t(pa);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += kKeyA;
    k1 += kKeyB;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

inline double to_compute(double x) { return x; }
template <typename T>
inline float to_compute(T x) { return to_float(x); }
inline double from_compute(double x, double) { return x; }
template <typename T>
inline T from_compute(float x, T) { return from_float<T>(x); }

template <typename scalar_t, typename compute_t>
void dropout_range(const scalar_t* x, scalar_t* y, int64_t n, int64_t n4, int64_t begin,
                   int64_t end, uint32_t k0, uint32_t k1, uint64_t threshold, compute_t scale) {
  uint32_t words[4];
  for (int64_t c = begin; c < end; ++c) {
    philox4x32(uint64_t(c), k0, k1, words);
    for (int w = 0; w < 4; ++w) {
      const int64_t i = c + w * n4;
      if (i >= n) break;
      const bool keep = uint64_t(words[w]) >= threshold;
      y[i] = keep ? from_compute(to_compute(x[i]) * scale, scalar_t{}) : scalar_t(0);
    }
  }
}

at::Tensor dropout_cpu(const at::Tensor& x, const at::Tensor& seed, double p) {
  TORCH_CHECK(x.is_contiguous(), "memkern.dropout: x must be contiguous; pass x.contiguous()");
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.is_cpu(),
              "memkern.dropout: seed must be a one-element int64 CPU tensor, got ",
              seed.scalar_type(), " of shape ", seed.sizes(), " on ", seed.device());
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "memkern.dropout: p=", p, " must be a probability in [0, 1]");
  const auto s = uint64_t(seed.item<int64_t>());
  const uint32_t k0 = uint32_t(s), k1 = uint32_t(s >> 32);
  // round(p * 2**32) (nearest, ties to even, as Python's round), in [0, 2**32].
  const double t = std::nearbyint(p * 4294967296.0);
  const uint64_t threshold = t <= 0.0 ? 0 : (t >= 4294967296.0 ? (uint64_t(1) << 32) : uint64_t(t));
  const double scale = p >= 1.0 ? 0.0 : 1.0 / (1.0 - p);
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.numel(), n4 = (n + 3) / 4;
  if (n == 0) return y;
  auto run = [&](auto tag, auto compute_scale) {
    using scalar_t = decltype(tag);
    const auto* xp = static_cast<const scalar_t*>(x.data_ptr());
    auto* yp = static_cast<scalar_t*>(y.data_ptr());
    at::parallel_for(0, n4, kGrain / 4, [&](int64_t begin, int64_t end) {
      dropout_range(xp, yp, n, n4, begin, end, k0, k1, threshold, compute_scale);
    });
  };
  switch (x.scalar_type()) {
    case at::kDouble: run(double{}, scale); break;
    case at::kFloat: run(float{}, float(scale)); break;
    case at::kBFloat16: run(c10::BFloat16{}, float(scale)); break;
    case at::kHalf: run(c10::Half{}, float(scale)); break;
    default:
      TORCH_CHECK(false, "memkern.dropout: x has dtype ", x.scalar_type(),
                  "; expected float32, bfloat16, float16 or float64");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("dropout", &dropout_cpu); }

}  // namespace memkern::cpu
