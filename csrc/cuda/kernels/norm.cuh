// memkern::norm_forward / norm_backward — LayerNorm and RMSNorm over the rows of a [rows, D]
// tensor, with per-row statistics in the math type (float32; float64 for float64 x).
// Contract: memkern/ops/norm.py; the statistics and each element's output come from the row
// sums by the CPU kernels' math (norm_math.h).
//
// Forward and dx: one block per row (grid-stride over rows), each thread taking the columns
// threadIdx.x + k * blockDim.x; the row is re-read from global memory (L1/L2) for each pass
// rather than held, so any D works. The weight and bias gradients, sums over rows, are
// computed apart and deterministically: a [chunks, 2, D] buffer of partial sums over fixed
// row chunks, then one sum over the chunks per column, in chunk order.
#pragma once

#include "layer_common.cuh"
#include "norm_math.h"

namespace memkern::device {

// The weight or bias of element i in the math type; `absent` where there is none (p null).
template <typename T, typename P>
__device__ __forceinline__ compute_t<T> param_or(const P* p, int64_t i, compute_t<T> absent) {
  return p != nullptr ? static_cast<compute_t<T>>(to_compute(p[i])) : absent;
}

// x: [rows, D]; weight/bias: [D] of type P (x's type or the math type), nullable; y like x;
// mean (LayerNorm; unused for RMSNorm) and rstd: [rows]. blockDim.x a multiple of kWarpSize.
template <typename T, typename P>
__global__ void norm_forward_kernel(const T* x, const P* weight, const P* bias, T* y,
                                    compute_t<T>* mean, compute_t<T>* rstd, int64_t rows,
                                    int64_t D, compute_t<T> eps, bool rms) {
  using acc_t = compute_t<T>;
  __shared__ acc_t scratch[kMaxWarpsPerBlock];
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  const bool has_w = weight != nullptr, has_b = bias != nullptr;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * D;
    acc_t mu = 0;
    if (!rms) {
      acc_t sum[1] = {0};
      for (int64_t i = threadIdx.x; i < D; i += blockDim.x) sum[0] += to_compute(xr[i]);
      block_sum(sum, scratch);
      mu = math::norm_mean(sum[0], inv_d);
    }
    acc_t sum_sq[1] = {0};
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const acc_t c = to_compute(xr[i]) - mu;
      sum_sq[0] += c * c;
    }
    block_sum(sum_sq, scratch);
    const acc_t rs = math::norm_rstd(sum_sq[0], inv_d, eps);
    if (threadIdx.x == 0) {
      if (!rms) mean[r] = mu;
      rstd[r] = rs;
    }
    T* yr = y + r * D;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      yr[i] = from_compute<T>(math::norm_output(to_compute(xr[i]) - mu, rs, has_w,
                                                param_or<T>(weight, i, acc_t(1)), has_b,
                                                param_or<T>(bias, i, acc_t(0))));
    }
  }
}

// dx of each row from dy, x, the weight (nullable) and the forward's statistics (mean unused
// for RMSNorm).
template <typename T, typename P>
__global__ void norm_input_grad_kernel(const T* dy, const T* x, const P* weight,
                                       const compute_t<T>* mean, const compute_t<T>* rstd,
                                       T* dx, int64_t rows, int64_t D, bool rms) {
  using acc_t = compute_t<T>;
  __shared__ acc_t scratch[2 * kMaxWarpsPerBlock];
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * D;
    const T* dyr = dy + r * D;
    const acc_t mu = rms ? acc_t(0) : mean[r];
    const acc_t rs = rstd[r];
    // sums[0]: of gw = dy * weight; sums[1]: of gw * xhat.
    acc_t sums[2] = {0, 0};
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const acc_t gw =
          math::norm_weighted_grad(to_compute(dyr[i]), param_or<T>(weight, i, acc_t(1)));
      sums[0] += gw;
      sums[1] += gw * math::norm_xhat(to_compute(xr[i]), mu, rs);
    }
    block_sum(sums, scratch);
    const acc_t mean_gw = rms ? acc_t(0) : math::norm_mean(sums[0], inv_d);
    const acc_t mean_gw_xhat = math::norm_mean(sums[1], inv_d);
    T* dxr = dx + r * D;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const acc_t gw =
          math::norm_weighted_grad(to_compute(dyr[i]), param_or<T>(weight, i, acc_t(1)));
      const acc_t xhat = math::norm_xhat(to_compute(xr[i]), mu, rs);
      dxr[i] = from_compute<T>(math::norm_input_grad(gw, xhat, rs, mean_gw, mean_gw_xhat));
    }
  }
}

// Threads of the weight-gradient kernels: kColumnTile columns by kRowLanes lanes.
constexpr int kColumnTile = 32;
constexpr int kRowLanes = 8;

// Sums over the blockDim.y lanes of each column's two values, in lane order; the result is
// valid in lane 0. scratch: 2 * kRowLanes * kColumnTile values.
template <typename acc_t>
__device__ __forceinline__ void sum_lanes(acc_t& a, acc_t& b, acc_t* scratch) {
  const int col = threadIdx.x, lane = threadIdx.y;
  scratch[lane * kColumnTile + col] = a;
  scratch[(kRowLanes + lane) * kColumnTile + col] = b;
  __syncthreads();
  if (lane == 0) {
    for (int l = 1; l < kRowLanes; ++l) {
      a += scratch[l * kColumnTile + col];
      b += scratch[(kRowLanes + l) * kColumnTile + col];
    }
  }
  __syncthreads();
}

// partials[c][0][j] = sum of dy * xhat and partials[c][1][j] = sum of dy over column j of the
// rows of chunk c ([c * rows_per_chunk, (c + 1) * rows_per_chunk)). Block (kColumnTile,
// kRowLanes); grid (column tiles, chunks), grid-stride over both.
template <typename T>
__global__ void norm_weight_grad_partials_kernel(const T* dy, const T* x,
                                                 const compute_t<T>* mean,
                                                 const compute_t<T>* rstd,
                                                 compute_t<T>* partials, int64_t rows,
                                                 int64_t D, int64_t rows_per_chunk,
                                                 int64_t chunks, bool rms) {
  using acc_t = compute_t<T>;
  __shared__ acc_t scratch[2 * kRowLanes * kColumnTile];
  const int64_t tiles = (D + kColumnTile - 1) / kColumnTile;
  for (int64_t c = blockIdx.y; c < chunks; c += gridDim.y) {
    const int64_t first = c * rows_per_chunk;
    const int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int64_t j = tile * kColumnTile + threadIdx.x;
      acc_t dw = 0, db = 0;
      if (j < D) {
        for (int64_t r = first + threadIdx.y; r < last; r += kRowLanes) {
          const acc_t g = to_compute(dy[r * D + j]);
          dw += g * math::norm_xhat(to_compute(x[r * D + j]), rms ? acc_t(0) : mean[r], rstd[r]);
          db += g;
        }
      }
      sum_lanes(dw, db, scratch);
      if (threadIdx.y == 0 && j < D) {
        partials[(2 * c) * D + j] = dw;
        partials[(2 * c + 1) * D + j] = db;
      }
    }
  }
}

// dweight[j] and dbias[j]: the chunks' partial sums of column j added in chunk order (each
// lane takes every kRowLanes-th chunk, then the lanes are added in order). Block
// (kColumnTile, kRowLanes); grid over column tiles, grid-stride.
template <typename acc_t>
__global__ void norm_weight_grad_sum_kernel(const acc_t* partials, acc_t* dweight,
                                            acc_t* dbias, int64_t D, int64_t chunks) {
  __shared__ acc_t scratch[2 * kRowLanes * kColumnTile];
  const int64_t tiles = (D + kColumnTile - 1) / kColumnTile;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t j = tile * kColumnTile + threadIdx.x;
    acc_t dw = 0, db = 0;
    if (j < D) {
      for (int64_t c = threadIdx.y; c < chunks; c += kRowLanes) {
        dw += partials[(2 * c) * D + j];
        db += partials[(2 * c + 1) * D + j];
      }
    }
    sum_lanes(dw, db, scratch);
    if (threadIdx.y == 0 && j < D) {
      dweight[j] = dw;
      dbias[j] = db;
    }
  }
}

}  // namespace memkern::device
