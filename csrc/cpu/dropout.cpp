// memkern::dropout on CPU: the mask of element i is a pure function of (seed, i), Philox4x32-10
// exactly as the reference, the CUDA and the Triton kernels draw it (the mask math is shared
// with the CUDA kernel: csrc/cuda/kernels/dropout_math.h). Contract: memkern/ops/dropout.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "../cuda/kernels/dropout_math.h"
#include "../layer_checks.h"
#include "flat_math.h"

namespace memkern::cpu {
namespace {

inline double to_compute(double x) { return x; }
template <typename T>
inline float to_compute(T x) { return to_float(x); }
inline double from_compute(double x, double) { return x; }
template <typename T>
inline T from_compute(float x, T) { return from_float<T>(x); }

template <typename scalar_t, typename compute_t>
void dropout_range(const scalar_t* x, scalar_t* y, int64_t n, int64_t n4, int64_t begin,
                   int64_t end, math::PhiloxKey key, uint64_t threshold, compute_t scale) {
  uint32_t words[4];
  for (int64_t c = begin; c < end; ++c) {
    math::philox4x32(uint64_t(c), key.k0, key.k1, words);
    for (int w = 0; w < 4; ++w) {
      const int64_t i = c + w * n4;
      if (i >= n) break;
      y[i] = from_compute(math::dropout_element(words[w], threshold, to_compute(x[i]), scale),
                          scalar_t{});
    }
  }
}

at::Tensor dropout_cpu(const at::Tensor& x, const at::Tensor& seed, double p) {
  check_dropout_args(x, seed, p);
  const math::PhiloxKey key = math::philox_key(*seed.const_data_ptr<int64_t>());
  const uint64_t threshold = math::dropout_threshold(p);
  const double scale = math::dropout_scale(p);
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.numel(), n4 = math::dropout_counters(n);
  if (n == 0) return y;
  auto run = [&](auto tag, auto compute_scale) {
    using scalar_t = decltype(tag);
    const auto* xp = static_cast<const scalar_t*>(x.data_ptr());
    auto* yp = static_cast<scalar_t*>(y.data_ptr());
    at::parallel_for(0, n4, kGrain / 4, [&](int64_t begin, int64_t end) {
      dropout_range(xp, yp, n, n4, begin, end, key, threshold, compute_scale);
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
