// memkern::cross_entropy_rows_ and memkern::cross_entropy_block_grad_ on CPU, on the per-row
// math the CUDA kernels run (csrc/cuda/kernels/cross_entropy_math.h): the online softmax over
// a row's tiles, its merge across lanes, the loss, the gradient element. The CPU takes 8 lanes
// per row (independent accumulators, so the exponentials of neighbouring tiles overlap); a GPU
// takes one lane per thread. The target range check reads the targets here, so it costs no
// extra ops and no host read. The per-row statistics (entropy, is-top-1, mean logit) come
// from the same pass, the entropy's running sum kept only when asked (a template flag).
// Contracts: memkern/ops/cross_entropy.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "../cross_entropy_checks.h"
#include "../cuda/kernels/cross_entropy_math.h"
#include "flat_math.h"

namespace memkern::cpu {
namespace {

namespace ce = memkern::cross_entropy;
namespace checks = memkern::cross_entropy_checks;

constexpr int kLanes = 8;

// Logits per tile: one 16-byte vector, as on the GPU.
template <typename scalar_t>
constexpr int kTile = static_cast<int>(16 / sizeof(scalar_t));

// A logit in the math type, soft-capped when Capped (a template flag, so that the loops without
// a cap hold no call of tanh and vectorise); its slope in *slope.
template <bool Capped, typename scalar_t, typename acc_t>
inline acc_t logit(scalar_t v, acc_t cap, acc_t* slope) {
  if constexpr (Capped) {
    return ce::capped(widen(v), cap, slope);
  } else {
    *slope = acc_t(1);
    return widen(v);
  }
}

// The online softmax normaliser of one row (with Entropy, its moment too), over kLanes lanes
// merged in order at the end: the
// head tile (when the row starts unaligned) goes to lane 0, then full tile b of the rest to
// lane b % kLanes — a loop over the lanes for each round of kLanes tiles, which the compiler
// vectorises across the lanes (their state kept as three arrays) — and the tail tile to the
// next lane in turn.
template <bool Capped, bool Entropy, typename scalar_t, typename acc_t>
MEMKERN_VECTOR_CLONES ce::Online<acc_t> row_normaliser(const scalar_t* row, int64_t V, acc_t cap) {
  constexpr int Tile = kTile<scalar_t>;
  const ce::RowTiles<Tile> tiles{V, ce::head_of(reinterpret_cast<uintptr_t>(row),
                                                sizeof(scalar_t), V)};
  acc_t max[kLanes], sum[kLanes], total[kLanes], moment[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    const ce::Online<acc_t> start = ce::online_start<acc_t>();
    max[l] = start.max, sum[l] = start.sum, total[l] = start.total, moment[l] = start.moment;
  }
  acc_t slope;
  const auto add = [&](int l, const acc_t (&z)[Tile], int k) {
    ce::Online<acc_t> lane{max[l], sum[l], total[l], moment[l]};
    ce::online_add<Entropy>(lane, z, k);
    max[l] = lane.max, sum[l] = lane.sum, total[l] = lane.total, moment[l] = lane.moment;
  };
  const auto add_tile = [&](int64_t tile, int l) {
    const scalar_t* first = row + tiles.first(tile);
    const int k = tiles.size(tile);
    acc_t z[Tile] = {};
    for (int j = 0; j < k; ++j) z[j] = logit<Capped>(first[j], cap, &slope);
    add(l, z, k);
  };
  int64_t i = 0;
  if (tiles.head > 0) add_tile(i++, 0);
  const int64_t rounds = (tiles.n - tiles.head) / (kLanes * Tile);
  for (int64_t round = 0; round < rounds; ++round, i += kLanes) {
    const scalar_t* first = row + tiles.first(i);
    for (int l = 0; l < kLanes; ++l) {
      acc_t z[Tile];
#pragma GCC unroll 16
      for (int j = 0; j < Tile; ++j) z[j] = logit<Capped>(first[l * Tile + j], cap, &slope);
      add(l, z, Tile);
    }
  }
  for (int l = 0; i < tiles.count(); ++i, ++l) add_tile(i, l);
  ce::Online<acc_t> row_stats{max[0], sum[0], total[0], moment[0]};
  for (int l = 1; l < kLanes; ++l) {
    ce::online_merge<Entropy>(row_stats, {max[l], sum[l], total[l], moment[l]});
  }
  return row_stats;
}

// Whether the target column t is the row's first maximum (torch.argmax's choice): it is at the
// maximum, and no earlier column is (read only for a target at the maximum).
template <bool Capped, typename scalar_t, typename acc_t>
bool first_max_at(const scalar_t* row, int64_t t, acc_t max, acc_t cap) {
  acc_t slope;
  if (!ce::at_max(logit<Capped>(row[t], cap, &slope), max)) return false;
  for (int64_t c = 0; c < t; ++c) {
    if (ce::at_max(logit<Capped>(row[c], cap, &slope), max)) return false;
  }
  return true;
}

// What the two ops share: the row settings of one call.
template <typename acc_t>
struct RowMath {
  int64_t num_classes;
  int64_t ignore_index;
  acc_t eps;
  acc_t cap;

  acc_t keep() const { return acc_t(1) - eps; }
  acc_t spread() const { return eps / static_cast<acc_t>(num_classes); }
};

// The entropy's part of a row's gradient (cross_entropy_block_grad_ with entropy given): the
// row's entropy and its factor.
template <typename acc_t>
struct EntropyTerm {
  acc_t entropy;
  acc_t scale;
};

// Columns [0, n) of a row whose column c is class `offset + c`: the gradient written over the
// logits, from the row's normaliser (max, log_sum) — or (lse, 0) for a saved log-sum-exp; with
// Entropy, plus the entropy's term.
template <bool Capped, bool Entropy, typename scalar_t, typename acc_t>
MEMKERN_VECTOR_CLONES void write_grad_row(scalar_t* row, int64_t n, int64_t offset,
                                          int64_t target, acc_t max, acc_t log_sum, acc_t scale,
                                          const RowMath<acc_t>& math, EntropyTerm<acc_t> term) {
  const acc_t keep = math.keep(), spread = math.spread(), cap = math.cap;
  for (int64_t c = 0; c < n; ++c) {
    acc_t slope;
    const acc_t z = logit<Capped>(row[c], cap, &slope);
    const acc_t hit = offset + c == target ? keep : acc_t(0);
    const acc_t logp = ce::log_prob(z, max, log_sum);
    if constexpr (Entropy) {
      row[c] = narrow<scalar_t>(ce::grad_value_entropy(logp, hit, spread, scale, slope,
                                                       term.entropy, term.scale));
    } else {
      row[c] = narrow<scalar_t>(ce::grad_value(logp, hit, spread, scale, slope));
    }
  }
}

// The row functions with the cap and entropy flags chosen once per row.
template <typename scalar_t, typename acc_t>
ce::Online<acc_t> normaliser(const scalar_t* row, int64_t V, acc_t cap, bool entropy) {
  if (cap > acc_t(0)) {
    return entropy ? row_normaliser<true, true>(row, V, cap)
                   : row_normaliser<true, false>(row, V, cap);
  }
  return entropy ? row_normaliser<false, true>(row, V, cap)
                 : row_normaliser<false, false>(row, V, cap);
}

template <typename scalar_t, typename acc_t>
bool first_max(const scalar_t* row, int64_t t, acc_t max, acc_t cap) {
  return cap > acc_t(0) ? first_max_at<true>(row, t, max, cap)
                        : first_max_at<false>(row, t, max, cap);
}

// `term` nullptr: the gradient without the entropy's term.
template <typename scalar_t, typename acc_t>
void write_grad(scalar_t* row, int64_t n, int64_t offset, int64_t target, acc_t max,
                acc_t log_sum, acc_t scale, const RowMath<acc_t>& math,
                const EntropyTerm<acc_t>* term = nullptr) {
  const EntropyTerm<acc_t> none{acc_t(0), acc_t(0)};
  if (math.cap > acc_t(0)) {
    if (term != nullptr) {
      write_grad_row<true, true>(row, n, offset, target, max, log_sum, scale, math, *term);
    } else {
      write_grad_row<true, false>(row, n, offset, target, max, log_sum, scale, math, none);
    }
  } else if (term != nullptr) {
    write_grad_row<false, true>(row, n, offset, target, max, log_sum, scale, math, *term);
  } else {
    write_grad_row<false, false>(row, n, offset, target, max, log_sum, scale, math, none);
  }
}

template <typename scalar_t>
void zero_row(scalar_t* row, int64_t n) {
  std::fill(row, row + n, scalar_t(0));
}

// The check both ops make on the CPU before writing anything: every target is ignore_index or
// a class.
void check_targets(const char* op, const int64_t* t, int64_t n, int64_t V, int64_t ignore_index) {
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK_VALUE(t[r] == ignore_index || (t[r] >= 0 && t[r] < V), op, ": target[", r,
                      "] = ", t[r], " is not a class index in [0, ", V,
                      ") nor ignore_index=", ignore_index);
  }
}

// Calls f(scalar_t{}) for the logits' dtype (checks::logits accepted it).
template <typename F>
void dispatch_logits(const at::Tensor& logits, const F& f) {
  switch (logits.scalar_type()) {
    case at::kDouble: return f(double{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: return f(float{});
  }
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_cpu(
    at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& row_scale,
    int64_t ignore_index, double label_smoothing, bool compute_grad, double softcap,
    int64_t outputs, const std::optional<at::Tensor>& stats) {
  const bool scaled = checks::rows_op(logits, target, row_scale, label_smoothing, softcap);
  checks::row_stats(checks::kRowsOp, outputs, stats, logits);
  const int64_t n = logits.size(0), V = logits.size(1);
  const auto acc = checks::acc_dtype(logits);
  const int64_t* t = target.const_data_ptr<int64_t>();
  check_targets(checks::kRowsOp, t, n, V, ignore_index);  // before any row is written
  at::Tensor loss = at::empty({n}, logits.options().dtype(acc));
  at::Tensor lse = at::empty({n}, logits.options().dtype(acc));
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(V, 1));
  dispatch_logits(logits, [&](auto tag) {
    using scalar_t = decltype(tag);
    using acc_t = acc_type<scalar_t>;
    auto* z = static_cast<scalar_t*>(logits.data_ptr());
    const acc_t* rs = scaled ? row_scale->const_data_ptr<acc_t>() : nullptr;
    acc_t* loss_out = loss.data_ptr<acc_t>();
    acc_t* lse_out = lse.data_ptr<acc_t>();
    acc_t* stats_out = outputs != 0 ? stats->data_ptr<acc_t>() : nullptr;
    const int64_t stride = outputs != 0 ? stats->stride(0) : 0;
    const bool entropy = (outputs & ce::kRowEntropy) != 0;
    const bool top1 = (outputs & ce::kRowIsTop1) != 0;
    const bool mean = (outputs & ce::kRowMeanLogit) != 0;
    const RowMath<acc_t> math{V, ignore_index, acc_t(label_smoothing), acc_t(softcap)};
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = z + r * V;
        if (t[r] == ignore_index) {
          loss_out[r] = lse_out[r] = acc_t(0);
          if (entropy) stats_out[ce::kEntropyRow * stride + r] = acc_t(0);
          if (top1) stats_out[ce::kIsTop1Row * stride + r] = acc_t(0);
          if (mean) stats_out[ce::kMeanLogitRow * stride + r] = acc_t(0);
          if (compute_grad) zero_row(row, V);
          continue;
        }
        const ce::Online<acc_t> stats = normaliser(row, V, math.cap, entropy);
        const acc_t row_lse = ce::online_lse(stats);
        acc_t slope;
        const acc_t z_t = ce::capped(widen(row[t[r]]), math.cap, &slope);
        loss_out[r] = ce::row_loss(row_lse, true, z_t, stats.total, V, math.eps);
        lse_out[r] = row_lse;
        if (entropy) stats_out[ce::kEntropyRow * stride + r] = ce::online_entropy(stats);
        if (top1) {
          stats_out[ce::kIsTop1Row * stride + r] =
              first_max(row, t[r], stats.max, math.cap) ? acc_t(1) : acc_t(0);
        }
        if (mean) stats_out[ce::kMeanLogitRow * stride + r] = stats.total / static_cast<acc_t>(V);
        if (compute_grad) {
          write_grad(row, V, 0, t[r], stats.max, ce::log_of(stats.sum),
                         rs == nullptr ? acc_t(1) : rs[r], math);
        }
      }
    });
  });
  return {loss, lse};
}

void cross_entropy_block_grad_cpu(at::Tensor& logits, const at::Tensor& lse,
                                  const at::Tensor& target, const at::Tensor& row_scale,
                                  int64_t class_offset, int64_t num_classes,
                                  int64_t ignore_index, double label_smoothing, double softcap,
                                  const std::optional<at::Tensor>& entropy,
                                  const std::optional<at::Tensor>& entropy_scale) {
  const bool with_entropy = checks::block_grad_op(logits, lse, target, row_scale, class_offset,
                                                  num_classes, label_smoothing, softcap,
                                                  entropy, entropy_scale);
  const int64_t n = logits.size(0), width = logits.size(1);
  const int64_t* t = target.const_data_ptr<int64_t>();
  check_targets(checks::kBlockGradOp, t, n, num_classes, ignore_index);
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1));
  dispatch_logits(logits, [&](auto tag) {
    using scalar_t = decltype(tag);
    using acc_t = acc_type<scalar_t>;
    auto* z = static_cast<scalar_t*>(logits.data_ptr());
    const acc_t* l = lse.const_data_ptr<acc_t>();
    const acc_t* rs = row_scale.const_data_ptr<acc_t>();
    const int64_t rs_stride = row_scale.stride(0);
    const acc_t* h = with_entropy ? entropy->const_data_ptr<acc_t>() : nullptr;
    const acc_t* hs = with_entropy ? entropy_scale->const_data_ptr<acc_t>() : nullptr;
    const int64_t hs_stride = with_entropy ? entropy_scale->stride(0) : 0;
    const RowMath<acc_t> math{num_classes, ignore_index, acc_t(label_smoothing), acc_t(softcap)};
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = z + r * width;
        if (t[r] == ignore_index) {
          zero_row(row, width);
        } else if (with_entropy) {
          const EntropyTerm<acc_t> term{h[r], hs[r * hs_stride]};
          write_grad(row, width, class_offset, t[r], l[r], acc_t(0), rs[r * rs_stride], math,
                     &term);
        } else {
          write_grad(row, width, class_offset, t[r], l[r], acc_t(0), rs[r * rs_stride], math);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) {
  m.impl("cross_entropy_rows_", &cross_entropy_rows_cpu);
  m.impl("cross_entropy_block_grad_", &cross_entropy_block_grad_cpu);
}

}  // namespace memkern::cpu
