// The per-row math of memkern::norm_forward / norm_backward (LayerNorm and RMSNorm over rows of D
// elements; contract: memkern/ops/norm.py), shared by the CPU kernels (csrc/cpu/norm.cpp) and the
// CUDA kernels (csrc/cuda/norm.cu). Each kernel sums a row its own way (vector lanes on the CPU, a
// block reduction on the GPU) and hands the sums to these functions, which turn them into the
// statistics and each element's output. acc_t is the math type: float for float32 and 16-bit inputs
// (rounded once by the caller), double for float64.
#pragma once

#include "../../math/host_device.h"

namespace memkern::math {

// The row mean (LayerNorm) from the row sum; inv_d = 1 / D.
template <typename acc_t>
MEMKERN_HOST_DEVICE acc_t norm_mean(acc_t sum, acc_t inv_d) {
  return sum * inv_d;
}

// rstd = 1 / sqrt(mean square + eps), from the sum of squares of the centred row (LayerNorm:
// x - mean, computed in a second pass; RMSNorm: x itself). A correctly rounded sqrt and
// division, not an approximate rsqrt: the statistic is returned to the caller.
template <typename acc_t>
MEMKERN_HOST_DEVICE acc_t norm_rstd(acc_t centred_sum_sq, acc_t inv_d, acc_t eps) {
  return acc_t(1) / sqrt_of(centred_sum_sq * inv_d + eps);
}

// One output element from its centred value (x - mean; x for RMSNorm): centred * rstd, times
// the weight and plus the bias where given (has_weight / has_bias: whether they are).
template <typename acc_t>
MEMKERN_HOST_DEVICE acc_t norm_output(acc_t centred, acc_t rstd, bool has_weight, acc_t weight,
                                      bool has_bias, acc_t bias) {
  acc_t y = centred * rstd;
  if (has_weight) y = y * weight;
  if (has_bias) y = y + bias;
  return y;
}

// The normalised input xhat = (x - mean) * rstd (mean = 0 for RMSNorm).
template <typename acc_t>
MEMKERN_HOST_DEVICE acc_t norm_xhat(acc_t x, acc_t mean, acc_t rstd) {
  return (x - mean) * rstd;
}

// gw = dy * weight, rounded to the math type by itself: a compiler that fused the product
// into the subtraction of norm_input_grad (nvcc does, in device code) would leave its rounding
// error in dx, which a row of one element, where gw - mean(gw) is exactly 0, shows.
template <typename acc_t>
MEMKERN_HOST_DEVICE acc_t norm_weighted_grad(acc_t dy, acc_t weight) {
  return mul_rn(dy, weight);
}
// One element of dx from gw = dy * weight (dy without a weight), its xhat and the row means
// mean(gw) (0 for RMSNorm) and mean(gw * xhat):
// dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)).
template <typename acc_t>
MEMKERN_HOST_DEVICE acc_t norm_input_grad(acc_t gw, acc_t xhat, acc_t rstd, acc_t mean_gw,
                                          acc_t mean_gw_xhat) {
  return rstd * (gw - mean_gw - xhat * mean_gw_xhat);
}

}  // namespace memkern::math
