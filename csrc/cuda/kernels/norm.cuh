// memkern::norm_forward / norm_backward — LayerNorm and RMSNorm over the rows of a [rows, D]
// tensor, with per-row statistics in the math type (float32; float64 for float64 x).
// Contract: memkern/ops/norm.py; the statistics and each element's output come from the row
// sums by the CPU kernels' math (norm_math.h).
//
// Two paths. The vector path (norm_*_vec_kernel), for rows of 16-bit or float32 elements whose
// width D is a whole number of 16-byte vectors, every buffer aligned to them, and at most
// kRowSlots * kMaxVecThreads vectors: each thread holds its vectors of a row in registers (vector
// threadIdx.x + k * blockDim.x in slot k), so a row is read once and written once; the weight
// and bias, the same columns in every row, are loaded once per block. Its backward takes one
// fixed chunk of rows per block and adds each column's dy * xhat and dy over the chunk in
// registers as it computes dx, loading the next row while it reduces this one: x and dy are
// read once in all. The general path (any D, any alignment, float64): one block per row, each
// thread taking the columns threadIdx.x + k * blockDim.x, the row re-read from L1/L2 for each
// pass; its weight gradients are a kernel apart that reads x and dy again.
//
// Both compute the weight and bias gradients deterministically: a [chunks, 2, D] buffer of
// partial sums over fixed row chunks, then one sum over the chunks per column, in chunk order.
#pragma once

#include "layer_common.cuh"
#include "norm_math.h"

namespace memkern::device {

// The weight or bias of element i in the math type; `absent` where there is none (p null).
template <typename T, typename P>
__device__ __forceinline__ compute_t<T> param_or(const P* p, int64_t i, compute_t<T> absent) {
  return p != nullptr ? static_cast<compute_t<T>>(to_compute(p[i])) : absent;
}

// rstd of row r from each thread's part of the row's centred sum of squares (summed over the
// block), written by thread 0 with the row's mean mu (LayerNorm; not for RMSNorm).
template <typename acc_t>
__device__ __forceinline__ acc_t row_rstd(acc_t sum_sq, acc_t* scratch, acc_t mu, acc_t inv_d,
                                          acc_t eps, bool rms, acc_t* mean, acc_t* rstd,
                                          int64_t r) {
  acc_t total[1] = {sum_sq};
  block_sum(total, scratch);
  const acc_t rs = math::norm_rstd(total[0], inv_d, eps);
  if (threadIdx.x == 0) {
    if (!rms) mean[r] = mu;
    rstd[r] = rs;
  }
  return rs;
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
    acc_t sum_sq = 0;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const acc_t c = to_compute(xr[i]) - mu;
      sum_sq += c * c;
    }
    const acc_t rs = row_rstd(sum_sq, scratch, mu, inv_d, eps, rms, mean, rstd, r);
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

// ---------------------------------------------------------------------------------------------
// The vector path.

// Elements of T in one 16-byte access: the vector path's width.
template <typename T>
constexpr int kRowVecWidth = 16 / static_cast<int>(sizeof(T));
// The most vectors a thread holds of one row (the launcher picks 1, 2 or 4), and the most
// threads of a block.
constexpr int kRowSlots = 4;
constexpr int kMaxVecThreads = 512;

// W elements of S as the 32-bit words a vector load leaves in registers; each is unpacked
// where it is used. (Held as Vec<S, W>, every 16-bit element took a register of its own, and
// ptxas spilled the backward's prefetched row.)
template <typename S, int W>
struct alignas(sizeof(S) * W) Packed {
  static_assert(sizeof(S) * W % 4 == 0, "whole 32-bit words");
  uint32_t word[sizeof(S) * W / 4];
};

// Element e of p in the math type: exact, as to_compute.
template <typename S, int W>
__device__ __forceinline__ compute_t<S> unpack(const Packed<S, W>& p, int e) {
  if constexpr (std::is_same_v<S, float>) {
    return __uint_as_float(p.word[e]);
  } else if constexpr (std::is_same_v<S, __nv_bfloat16>) {  // the high half of a float
    const uint32_t w = p.word[e / 2];
    return __uint_as_float(e % 2 == 0 ? w << 16 : w & 0xffff0000u);
  } else {
    static_assert(std::is_same_v<S, __half>, "the vector path takes float, bfloat16, float16");
    const uint32_t w = p.word[e / 2];
    return __half2float(__ushort_as_half(static_cast<unsigned short>(e % 2 == 0 ? w : w >> 16)));
  }
}

// Loads this thread's live slots of `row` (nvec vectors of W elements of S); the others are
// left as they are.
template <int Slots, int W, typename S>
__device__ __forceinline__ void load_slots(const S* row, int64_t nvec,
                                           Packed<S, W> (&out)[Slots]) {
#pragma unroll
  for (int k = 0; k < Slots; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (v < nvec) out[k] = *reinterpret_cast<const Packed<S, W>*>(row + v * W);
  }
}

// Stores this thread's live slots into `row`.
template <int Slots, int W, typename S>
__device__ __forceinline__ void store_slots(S* row, int64_t nvec, const Vec<S, W> (&in)[Slots]) {
#pragma unroll
  for (int k = 0; k < Slots; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (v < nvec) store<W>(row, v * W, in[k]);
  }
}

// Calls fn(k, e) for element e of each live slot k, unrolled.
template <int Slots, int W, typename Fn>
__device__ __forceinline__ void for_each_slot_element(int64_t nvec, Fn&& fn) {
#pragma unroll
  for (int k = 0; k < Slots; ++k) {
    if (threadIdx.x + static_cast<int64_t>(k) * blockDim.x < nvec) {
#pragma unroll
      for (int e = 0; e < W; ++e) fn(k, e);
    }
  }
}

// As norm_forward_kernel, on the vector path: Slots vectors per thread, D = nvec * W. (Without
// the bound, four slots took 142 registers: too many for a block of 512 threads to launch.)
template <typename T, typename P, int Slots>
__global__ void __launch_bounds__(kMaxVecThreads)
    norm_forward_vec_kernel(const T* x, const P* weight, const P* bias, T* y, compute_t<T>* mean,
                            compute_t<T>* rstd, int64_t rows, int64_t D, compute_t<T> eps,
                            bool rms) {
  using acc_t = compute_t<T>;
  constexpr int W = kRowVecWidth<T>;
  __shared__ acc_t scratch[kMaxWarpsPerBlock];
  const int64_t nvec = D / W;
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  const bool has_w = weight != nullptr, has_b = bias != nullptr;
  Packed<P, W> w[Slots], b[Slots];
  if (has_w) load_slots(weight, nvec, w);
  if (has_b) load_slots(bias, nvec, b);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    Packed<T, W> xv[Slots];
    load_slots(x + r * D, nvec, xv);
    acc_t mu = 0;
    if (!rms) {
      acc_t sum[1] = {0};
      for_each_slot_element<Slots, W>(nvec, [&](int k, int e) { sum[0] += unpack(xv[k], e); });
      block_sum(sum, scratch);
      mu = math::norm_mean(sum[0], inv_d);
    }
    acc_t sum_sq = 0;
    for_each_slot_element<Slots, W>(nvec, [&](int k, int e) {
      const acc_t c = unpack(xv[k], e) - mu;
      sum_sq += c * c;
    });
    const acc_t rs = row_rstd(sum_sq, scratch, mu, inv_d, eps, rms, mean, rstd, r);
    Vec<T, W> yv[Slots];
    for_each_slot_element<Slots, W>(nvec, [&](int k, int e) {
      yv[k].v[e] = from_compute<T>(math::norm_output(
          unpack(xv[k], e) - mu, rs, has_w, has_w ? unpack(w[k], e) : acc_t(1),
          has_b, has_b ? unpack(b[k], e) : acc_t(0)));
    });
    store_slots(y + r * D, nvec, yv);
  }
}

// dx as norm_input_grad_kernel and, where partials is given, the weight-gradient partial sums
// as norm_weight_grad_partials_kernel, on the vector path: block c takes the rows
// [c * rows_per_chunk, (c + 1) * rows_per_chunk) (grid: one block per chunk), each column's
// sums in the registers of the thread that holds it, added in row order.
// Registers: at most 64 with one slot (the prefetched row and the sums fit: ptxas spilled
// neither), at most 128 with two or four (what a block of 512 threads may hold); at 4096 bf16,
// two slots on 256 threads, two blocks fit a multiprocessor, so a grid of 256 chunks runs in
// one wave on 128 or more.
template <typename T, typename P, int Slots>
__global__ void __launch_bounds__(kMaxVecThreads, Slots == 1 ? 2 : 1)
    norm_backward_vec_kernel(const T* dy, const T* x, const P* weight, const compute_t<T>* mean,
                             const compute_t<T>* rstd, T* dx, compute_t<T>* partials,
                             int64_t rows, int64_t D, int64_t rows_per_chunk, bool rms) {
  using acc_t = compute_t<T>;
  constexpr int W = kRowVecWidth<T>;
  __shared__ acc_t scratch[2 * kMaxWarpsPerBlock];
  const int64_t nvec = D / W;
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  const bool has_w = weight != nullptr;
  Vec<acc_t, W> dw[Slots] = {}, db[Slots] = {};
  const int64_t c = blockIdx.x;
  const int64_t first = c * rows_per_chunk;
  const int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  // With one or two slots the next row's loads are in flight during this row's reduction;
  // with four the registers of a second row are not there (ptxas spilled the accumulators).
  constexpr bool kPrefetch = Slots <= 2;
  Packed<T, W> dy_next[Slots] = {}, x_next[Slots] = {};
  if (kPrefetch && first < last) {
    load_slots(dy + first * D, nvec, dy_next);
    load_slots(x + first * D, nvec, x_next);
  }
  for (int64_t r = first; r < last; ++r) {
    Packed<T, W> dyv[Slots], xv[Slots];
    if constexpr (kPrefetch) {
#pragma unroll
      for (int k = 0; k < Slots; ++k) {
        dyv[k] = dy_next[k];
        xv[k] = x_next[k];
      }
      if (r + 1 < last) {
        load_slots(dy + (r + 1) * D, nvec, dy_next);
        load_slots(x + (r + 1) * D, nvec, x_next);
      }
    } else {
      load_slots(dy + r * D, nvec, dyv);
      load_slots(x + r * D, nvec, xv);
    }
    // The weight is re-read for each row (from L1): held across rows, its registers spilled.
    Packed<P, W> w[Slots];
    if (has_w) load_slots(weight, nvec, w);
    const acc_t mu = rms ? acc_t(0) : mean[r];
    const acc_t rs = rstd[r];
    // sums[0]: of gw = dy * weight; sums[1]: of gw * xhat.
    acc_t sums[2] = {0, 0};
    for_each_slot_element<Slots, W>(nvec, [&](int k, int e) {
      const acc_t g = unpack(dyv[k], e);
      const acc_t xhat = math::norm_xhat(unpack(xv[k], e), mu, rs);
      const acc_t gw = math::norm_weighted_grad(g, has_w ? unpack(w[k], e) : acc_t(1));
      sums[0] += gw;
      sums[1] += gw * xhat;
      dw[k].v[e] += g * xhat;
      db[k].v[e] += g;
    });
    block_sum(sums, scratch);
    const acc_t mean_gw = rms ? acc_t(0) : math::norm_mean(sums[0], inv_d);
    const acc_t mean_gw_xhat = math::norm_mean(sums[1], inv_d);
    Vec<T, W> dxv[Slots];
    for_each_slot_element<Slots, W>(nvec, [&](int k, int e) {
      const acc_t gw = math::norm_weighted_grad(unpack(dyv[k], e),
                                                has_w ? unpack(w[k], e) : acc_t(1));
      const acc_t xhat = math::norm_xhat(unpack(xv[k], e), mu, rs);
      dxv[k].v[e] = from_compute<T>(math::norm_input_grad(gw, xhat, rs, mean_gw, mean_gw_xhat));
    });
    store_slots(dx + r * D, nvec, dxv);
  }
  if (partials != nullptr) {
    store_slots(partials + 2 * c * D, nvec, dw);
    store_slots(partials + (2 * c + 1) * D, nvec, db);
  }
}

}  // namespace memkern::device
