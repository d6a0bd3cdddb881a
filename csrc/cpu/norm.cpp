// memkern::norm_forward / memkern::norm_backward on CPU: LayerNorm and RMSNorm over the rows of a
// [rows, D] tensor, with per-row float32 statistics (float64 for float64 x). Contract:
// memkern/ops/norm.py. The math runs in the statistics' dtype; 16-bit rows are widened into an
// L1-resident buffer first (one conversion per element, then plain float loops that vectorise).
//
// The statistics and each element's output come from the sums by the math the CUDA kernels
// share (csrc/cuda/kernels/norm_math.h).
//
// Row sums (mean, mean square, the backward's two dot products) run over kLanes independent
// lanes, so the loops vectorise without reassociating one sum. The weight and bias gradients
// are sums over rows: each task of kRowChunk rows (a fixed count, not one per thread) writes its
// own partial sums and the partials are added in chunk order, so the result does not depend on
// the number of threads.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../cuda/kernels/norm_math.h"
#include "../layer_checks.h"
#include "flat_math.h"

namespace memkern::cpu {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowChunk = 32;

template <typename acc_t>
inline acc_t fold(const acc_t (&lanes)[kLanes]) {
  acc_t total = 0;
  for (acc_t lane : lanes) total += lane;
  return total;
}

// sum(a[i] * b[i]) (b == nullptr: sum(a[i])), over kLanes lanes.
template <typename acc_t>
MEMKERN_VECTOR_CLONES acc_t lane_dot(const acc_t* __restrict a, const acc_t* __restrict b,
                                     int64_t n) {
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  if (b == nullptr) {
    for (; i + kLanes <= n; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) lanes[j] += a[i + j];
    }
    for (int j = 0; i < n; ++i, ++j) lanes[j] += a[i];
  } else {
    for (; i + kLanes <= n; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * b[i + j];
    }
    for (int j = 0; i < n; ++i, ++j) lanes[j] += a[i] * b[i];
  }
  return fold(lanes);
}

// The weight or bias as a contiguous tensor of the math's dtype (a no-op when it already is).
std::optional<at::Tensor> as_acc(const std::optional<at::Tensor>& t, at::ScalarType acc) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return t->to(acc).contiguous();
}

template <typename scalar_t, typename acc_t>
void forward_rows(const scalar_t* __restrict x, const acc_t* __restrict w,
                  const acc_t* __restrict b, scalar_t* __restrict y, acc_t* __restrict mean,
                  acc_t* __restrict rstd, int64_t D, acc_t eps, bool rms, int64_t first,
                  int64_t last) {
  std::vector<acc_t> row(D);
  acc_t* __restrict xr = row.data();
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  for (int64_t r = first; r < last; ++r) {
    const scalar_t* xrow = x + r * D;
    for (int64_t i = 0; i < D; ++i) xr[i] = widen(xrow[i]);
    if (!rms) {
      const acc_t mu = math::norm_mean(lane_dot<acc_t>(xr, nullptr, D), inv_d);
      for (int64_t i = 0; i < D; ++i) xr[i] -= mu;  // two passes: the variance of x - mean
      mean[r] = mu;
    }
    const acc_t rs = math::norm_rstd(lane_dot<acc_t>(xr, xr, D), inv_d, eps);
    rstd[r] = rs;
    scalar_t* yrow = y + r * D;
    const bool has_w = w != nullptr, has_b = b != nullptr;
    for (int64_t i = 0; i < D; ++i) {
      yrow[i] = narrow<scalar_t>(math::norm_output(xr[i], rs, has_w, has_w ? w[i] : acc_t(1),
                                                   has_b, has_b ? b[i] : acc_t(0)));
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool rms) {
  check_norm_input("norm_forward", x);
  check_norm_param("norm_forward", "weight", weight, x);
  check_norm_param("norm_forward", "bias", bias, x);
  const at::ScalarType acc = layer_acc_type(x);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), D = x.size(1);
  const auto w = as_acc(weight, acc);
  const auto b = as_acc(bias, acc);
  at::Tensor y = at::empty_like(xc);
  at::Tensor mean = at::empty({rms ? 0 : rows}, x.options().dtype(acc));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(acc));
  if (rows == 0 || D == 0) return {y, mean, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_forward", [&] {
    using acc_t = acc_type<scalar_t>;
    const acc_t* wp = w ? w->const_data_ptr<acc_t>() : nullptr;
    const acc_t* bp = b ? b->const_data_ptr<acc_t>() : nullptr;
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / D), [&](int64_t first, int64_t last) {
      forward_rows(xc.const_data_ptr<scalar_t>(), wp, bp, y.data_ptr<scalar_t>(),
                   rms ? nullptr : mean.data_ptr<acc_t>(), rstd.data_ptr<acc_t>(), D,
                   static_cast<acc_t>(eps), rms, first, last);
    });
  });
  return {y, mean, rstd};
}

// Rows [first, last): dx, and (partial_w != nullptr) the rows' sums of dy * xhat and dy.
template <typename scalar_t, typename acc_t>
void backward_rows(const scalar_t* __restrict dy, const scalar_t* __restrict x,
                   const acc_t* __restrict w, const acc_t* __restrict mean,
                   const acc_t* __restrict rstd, scalar_t* __restrict dx,
                   acc_t* __restrict partial_w, acc_t* __restrict partial_b, int64_t D,
                   int64_t first, int64_t last) {
  std::vector<acc_t> buffers(3 * D);
  acc_t* __restrict xhat = buffers.data();
  acc_t* __restrict g = xhat + D;
  acc_t* __restrict gw = g + D;
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  for (int64_t r = first; r < last; ++r) {
    const acc_t mu = mean == nullptr ? acc_t(0) : mean[r];
    const acc_t rs = rstd[r];
    for (int64_t i = 0; i < D; ++i) {
      xhat[i] = math::norm_xhat(widen(x[r * D + i]), mu, rs);
      g[i] = widen(dy[r * D + i]);
      gw[i] = w == nullptr ? g[i] : math::norm_weighted_grad(g[i], w[i]);
    }
    // LayerNorm: dx = rstd (gw - mean(gw) - xhat mean(gw xhat)); RMSNorm: no mean(gw) term.
    const acc_t mean_gw = mean == nullptr ? acc_t(0) : lane_dot<acc_t>(gw, nullptr, D) * inv_d;
    const acc_t mean_gw_xhat = lane_dot<acc_t>(gw, xhat, D) * inv_d;
    for (int64_t i = 0; i < D; ++i) {
      dx[r * D + i] =
          narrow<scalar_t>(math::norm_input_grad(gw[i], xhat[i], rs, mean_gw, mean_gw_xhat));
    }
    if (partial_w != nullptr) {
      for (int64_t i = 0; i < D; ++i) {
        partial_w[i] += g[i] * xhat[i];
        partial_b[i] += g[i];
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward_cpu(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& rstd, bool rms) {
  check_norm_backward_args(dy, x, mean, rstd, rms);
  check_norm_param("norm_backward", "weight", weight, x);
  const at::ScalarType acc = layer_acc_type(x);
  const int64_t rows = x.size(0), D = x.size(1);
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  const at::Tensor mc = mean.contiguous(), rc = rstd.contiguous();
  const auto w = as_acc(weight, acc);
  at::Tensor dx = at::empty_like(xc);
  const int64_t n_grad = w ? D : 0;
  at::Tensor dw = at::zeros({n_grad}, x.options().dtype(acc));
  at::Tensor db = at::zeros({n_grad}, x.options().dtype(acc));
  if (rows == 0 || D == 0) return {dx, dw, db};
  const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_backward", [&] {
    using acc_t = acc_type<scalar_t>;
    std::vector<acc_t> partials(w ? 2 * chunks * D : 0, acc_t(0));
    const acc_t* wp = w ? w->const_data_ptr<acc_t>() : nullptr;
    const acc_t* mp = rms ? nullptr : mc.const_data_ptr<acc_t>();
    at::parallel_for(0, chunks, std::max<int64_t>(1, kGrain / (kRowChunk * D)),
                     [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        acc_t* pw = w ? partials.data() + 2 * c * D : nullptr;
        backward_rows(dyc.const_data_ptr<scalar_t>(), xc.const_data_ptr<scalar_t>(), wp, mp,
                      rc.const_data_ptr<acc_t>(), dx.data_ptr<scalar_t>(), pw,
                      w ? pw + D : nullptr, D, c * kRowChunk,
                      std::min(rows, (c + 1) * kRowChunk));
      }
    });
    if (w) {
      acc_t* dwp = dw.data_ptr<acc_t>();
      acc_t* dbp = db.data_ptr<acc_t>();
      for (int64_t c = 0; c < chunks; ++c) {
        const acc_t* pw = partials.data() + 2 * c * D;
        for (int64_t i = 0; i < D; ++i) {
          dwp[i] += pw[i];
          dbp[i] += pw[D + i];
        }
      }
    }
  });
  return {dx, dw, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) {
  m.impl("norm_forward", &norm_forward_cpu);
  m.impl("norm_backward", &norm_backward_cpu);
}

}  // namespace memkern::cpu
