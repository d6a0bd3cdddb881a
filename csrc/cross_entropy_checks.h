// Argument checks of the cross-entropy row ops, shared by their CPU (csrc/cpu/cross_entropy.cpp)
// and CUDA (csrc/cuda/cross_entropy_ops.cpp) kernels. Each message names the argument, says
// what was wrong and what to do; the Python entries (memkern/ops/cross_entropy.py) check the
// same first, so these guard direct calls of torch.ops.memkern.*.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "cuda/kernels/cross_entropy_math.h"

namespace memkern::cross_entropy_checks {

// The float type of the rows' results: float64 for float64 logits, else float32.
inline at::ScalarType acc_dtype(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void logits(const char* op, const at::Tensor& z) {
  const auto dtype = z.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ||
                  dtype == at::kDouble,
              op, ": logits have dtype ", dtype,
              "; expected float32, bfloat16, float16 or float64");
  TORCH_CHECK(z.dim() == 2 && z.is_contiguous(), op,
              ": logits must be a contiguous 2-D [n, V] tensor, got shape ", z.sizes(),
              "; pass logits.contiguous()");
}

inline void target(const char* op, const at::Tensor& t, const at::Tensor& z) {
  const int64_t n = z.size(0);
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == n &&
                  t.is_contiguous() && t.device() == z.device(),
              op, ": target must be a contiguous int64 tensor of shape (", n, ",) on ",
              z.device(), ", got ", t.scalar_type(), " of shape ", t.sizes(), " on ",
              t.device());
}

// A float32 (float64 for float64 logits) [n] tensor on the logits' device; `contiguous`, or
// any stride (an expanded scalar).
inline void rows(const char* op, const char* name, const at::Tensor& t, const at::Tensor& z,
                 bool contiguous) {
  const int64_t n = z.size(0);
  const auto acc = acc_dtype(z);
  TORCH_CHECK(t.scalar_type() == acc && t.dim() == 1 && t.size(0) == n &&
                  t.device() == z.device() && (!contiguous || t.is_contiguous()),
              op, ": ", name, " must be a ", contiguous ? "contiguous " : "", acc,
              " tensor of shape (", n, ",) on ", z.device(), ", got ", t.scalar_type(),
              " of shape ", t.sizes(), " on ", t.device());
}

inline void settings(const char* op, double label_smoothing, double softcap) {
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing=",
              label_smoothing, " must be in [0, 1]");
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), op, ": softcap=", softcap,
              " must be a finite number >= 0 (0: no soft-capping)");
}

// A block of `width` columns starting at class `class_offset` lies within the classes.
inline void block(const char* op, int64_t class_offset, int64_t width, int64_t num_classes) {
  TORCH_CHECK(class_offset >= 0 && class_offset + width <= num_classes, op,
              ": the block's columns are classes [", class_offset, ", ", class_offset + width,
              ") but num_classes=", num_classes, "; the block must lie within the classes");
}

// The per-row statistics asked of the rows op: `outputs` a mask of the kRow* bits, and then
// `stats` a float32 (float64) [3, n] tensor on the logits' device whose rows are contiguous.
inline void row_stats(const char* op, int64_t outputs, const std::optional<at::Tensor>& stats,
                      const at::Tensor& z) {
  namespace ce = memkern::cross_entropy;
  const int64_t all = ce::kRowEntropy | ce::kRowIsTop1 | ce::kRowMeanLogit;
  TORCH_CHECK(outputs >= 0 && (outputs & ~all) == 0, op, ": outputs=", outputs,
              " must be a mask of ROW_ENTROPY, ROW_IS_TOP1 and ROW_MEAN_LOGIT");
  const bool given = stats.has_value() && stats->defined();
  TORCH_CHECK(given == (outputs != 0), op, ": pass stats exactly when outputs is not 0 (got ",
              given ? "stats" : "no stats", " with outputs=", outputs, ")");
  if (!given) return;
  const auto acc = acc_dtype(z);
  TORCH_CHECK(stats->scalar_type() == acc && stats->dim() == 2 && stats->size(0) == 3 &&
                  stats->size(1) == z.size(0) && stats->stride(1) == 1 &&
                  stats->device() == z.device(),
              op, ": stats must be a ", acc, " tensor of shape (3, ", z.size(0), ") on ",
              z.device(), " with contiguous rows, got ", stats->scalar_type(), " of shape ",
              stats->sizes(), " and strides ", stats->strides(), " on ", stats->device());
}

constexpr const char* kRowsOp = "memkern.ops.cross_entropy_rows_";
constexpr const char* kBlockGradOp = "memkern.ops.cross_entropy_block_grad_";

// Every tensor and setting of cross_entropy_rows_ (but the targets' range); returns whether
// row_scale is given.
inline bool rows_op(const at::Tensor& z, const at::Tensor& t,
                    const std::optional<at::Tensor>& row_scale, double label_smoothing,
                    double softcap) {
  logits(kRowsOp, z);
  target(kRowsOp, t, z);
  const bool scaled = row_scale.has_value() && row_scale->defined();
  if (scaled) rows(kRowsOp, "row_scale", *row_scale, z, true);
  settings(kRowsOp, label_smoothing, softcap);
  return scaled;
}

// Every tensor and setting of cross_entropy_block_grad_ (but the targets' range); returns
// whether the entropy's term is asked (entropy and entropy_scale both given).
inline bool block_grad_op(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& t,
                          const at::Tensor& row_scale, int64_t class_offset, int64_t num_classes,
                          double label_smoothing, double softcap,
                          const std::optional<at::Tensor>& entropy,
                          const std::optional<at::Tensor>& entropy_scale) {
  logits(kBlockGradOp, z);
  target(kBlockGradOp, t, z);
  rows(kBlockGradOp, "lse", lse, z, true);
  rows(kBlockGradOp, "row_scale", row_scale, z, false);
  settings(kBlockGradOp, label_smoothing, softcap);
  block(kBlockGradOp, class_offset, z.size(1), num_classes);
  const bool has_entropy = entropy.has_value() && entropy->defined();
  const bool has_scale = entropy_scale.has_value() && entropy_scale->defined();
  TORCH_CHECK(has_entropy == has_scale, kBlockGradOp,
              ": entropy and entropy_scale go together (the entropy's gradient term needs "
              "both); got only ", has_entropy ? "entropy" : "entropy_scale");
  if (has_entropy) {
    rows(kBlockGradOp, "entropy", *entropy, z, true);
    rows(kBlockGradOp, "entropy_scale", *entropy_scale, z, false);
  }
  return has_entropy;
}

}  // namespace memkern::cross_entropy_checks
