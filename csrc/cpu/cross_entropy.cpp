// memkern::cross_entropy_rows_ on CPU: the reference's math (log-softmax once for the loss, its
// exp for the gradient written over the logits, float32 or float64 for float64 logits) with the
// same roundings, as two vectorised ATen ops and one loop instead of ~10 ops and a Python call.
// The target range check reads the targets here, so it costs no extra ops and no host read.
// Contract: memkern/ops/cross_entropy.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_log_softmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/exp.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>

#include "flat_math.h"

namespace memkern::cpu {
namespace {

template <typename T>
inline T from_acc(double x) { return x; }
template <typename T>
inline T from_acc(float x) { return from_float<T>(x); }

// Rows [begin, end): the loss from the row's log-softmax, and (when grad is given: the exp of
// the log-softmax, i.e. the softmax) the gradient written over the logits, in the reference's
// order of roundings: softmax - eps / V, then - (1 - eps) at the target, then * row_scale.
template <typename scalar_t, typename acc_t>
void rows_range(scalar_t* z, const acc_t* logp, const acc_t* grad, const int64_t* target,
                const acc_t* row_scale, acc_t* loss, int64_t V, int64_t ignore_index, acc_t eps,
                int64_t begin, int64_t end) {
  const acc_t keep = acc_t(1) - eps, spread = eps / acc_t(V);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t t = target[r];
    scalar_t* row = z + r * V;
    if (t == ignore_index) {
      loss[r] = acc_t(0);
      if (grad != nullptr) {
        for (int64_t c = 0; c < V; ++c) row[c] = scalar_t(0);
      }
      continue;
    }
    const acc_t* lp = logp + r * V;
    acc_t row_loss = -keep * lp[t];
    if (eps > acc_t(0)) {
      acc_t sum = 0;
      for (int64_t c = 0; c < V; ++c) sum += lp[c];
      row_loss -= eps * (sum / acc_t(V));
    }
    loss[r] = row_loss;
    if (grad == nullptr) continue;
    const acc_t* g = grad + r * V;
    const acc_t scale = row_scale == nullptr ? acc_t(1) : row_scale[r];
    for (int64_t c = 0; c < V; ++c) {
      acc_t v = g[c];
      if (eps > acc_t(0)) v -= spread;
      if (c == t) v += -keep;
      if (row_scale != nullptr) v *= scale;
      row[c] = from_acc<scalar_t>(v);
    }
  }
}

at::Tensor cross_entropy_rows_cpu(at::Tensor& logits, const at::Tensor& target,
                                  const std::optional<at::Tensor>& row_scale,
                                  int64_t ignore_index, double label_smoothing,
                                  bool compute_grad) {
  const char* op = "memkern.ops.cross_entropy_rows_";
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), op,
              ": logits must be a contiguous 2-D [n, V] tensor, got shape ", logits.sizes());
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == n &&
                  target.is_contiguous() && target.is_cpu(),
              op, ": target must be a contiguous int64 CPU tensor of shape (", n, ",), got ",
              target.scalar_type(), " of shape ", target.sizes());
  const bool wide = logits.scalar_type() == at::kDouble;
  const auto acc_type = wide ? at::kDouble : at::kFloat;
  const bool scaled = row_scale.has_value() && row_scale->defined();
  if (scaled) {
    TORCH_CHECK(row_scale->scalar_type() == acc_type && row_scale->dim() == 1 &&
                    row_scale->size(0) == n && row_scale->is_contiguous() && row_scale->is_cpu(),
                op, ": row_scale must be a contiguous ", acc_type, " CPU tensor of shape (", n,
                ",), got ", row_scale->scalar_type(), " of shape ", row_scale->sizes());
  }
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing=",
              label_smoothing, " must be in [0, 1]");
  const int64_t* t = target.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {  // before any row is written: a bad call changes nothing
    TORCH_CHECK_VALUE(t[r] == ignore_index || (t[r] >= 0 && t[r] < V), op, ": target[", r,
                      "] = ", t[r], " is not a class index in [0, ", V,
                      ") nor ignore_index=", ignore_index);
  }
  at::Tensor loss = at::empty({n}, logits.options().dtype(acc_type));
  if (n == 0) return loss;
  // torch's vectorised log_softmax and exp (one pass each); the rest is the loop below.
  const bool in_acc = logits.scalar_type() == acc_type;
  const at::Tensor logp = at::_log_softmax(in_acc ? logits : logits.to(acc_type), 1, false);
  at::Tensor grad;
  if (compute_grad) {
    grad = in_acc ? logits : at::empty_like(logp);
    at::exp_out(grad, logp);
  }
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(V, 1));
  auto run = [&](auto tag, auto acc_tag) {
    using scalar_t = decltype(tag);
    using acc_t = decltype(acc_tag);
    auto* z = static_cast<scalar_t*>(logits.data_ptr());
    const auto* lp = static_cast<const acc_t*>(logp.data_ptr());
    const acc_t* g = compute_grad ? static_cast<const acc_t*>(grad.data_ptr()) : nullptr;
    const acc_t* rs = scaled ? static_cast<const acc_t*>(row_scale->data_ptr()) : nullptr;
    auto* out = static_cast<acc_t*>(loss.data_ptr());
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      rows_range<scalar_t, acc_t>(z, lp, g, t, rs, out, V, ignore_index, acc_t(label_smoothing),
                                  begin, end);
    });
  };
  switch (logits.scalar_type()) {
    case at::kDouble: run(double{}, double{}); break;
    case at::kFloat: run(float{}, float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}, float{}); break;
    case at::kHalf: run(c10::Half{}, float{}); break;
    default:
      TORCH_CHECK(false, op, ": logits have dtype ", logits.scalar_type(),
                  "; expected float32, bfloat16, float16 or float64");
  }
  return loss;
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("cross_entropy_rows_", &cross_entropy_rows_cpu); }

}  // namespace memkern::cpu
