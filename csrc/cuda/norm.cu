// memkern::norm_forward / norm_backward on CUDA, torch-free — LayerNorm and RMSNorm over the rows
// of a [rows, D] tensor, with per-row statistics in the math type (float32; float64 for float64 x).
// Contract: memkern/ops/norm.py; the statistics and each element's output come from the row sums by
// the CPU kernels' math (norm_math.h).
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
//
// The launchers (norm_launch.h) pick the path and block size from D and the buffers' alignment,
// the parameter type's instantiation and the weight-gradient chunks.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/layer_common.cuh"
#include "kernels/norm_math.h"
#include "launch.cuh"
#include "norm_launch.h"

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

namespace memkern::layer_ops {

namespace {

using device::kColumnTile;
using device::kRowLanes;
using device::kWarpSize;

// Threads per row: about four columns each, a whole number of warps, at most kMaxThreads (a
// wider row loops: thread t takes columns t, t + blockDim.x, ...).
constexpr int kMaxThreads = 512;
static_assert(kMaxThreads / kWarpSize <= device::kMaxWarpsPerBlock, "block_sum's scratch");
int row_threads(int64_t D) {
  const int64_t warps = ((D + 3) / 4 + kWarpSize - 1) / kWarpSize;
  return static_cast<int>(std::clamp<int64_t>(warps * kWarpSize, kWarpSize, kMaxThreads));
}

// Blocks per multiprocessor the row grids are capped at (they stride over further rows).
constexpr int kRowBlocksPerSm = 16;

// The weight gradients sum over fixed chunks of rows (at least kMinChunkRows rows each, at
// most kMaxChunks chunks), so the summation order depends on `rows` only, not on the GPU.
constexpr int64_t kMinChunkRows = 32;
constexpr int64_t kMaxChunks = 256;
int64_t chunk_count(int64_t rows) {
  return std::min((rows + kMinChunkRows - 1) / kMinChunkRows, kMaxChunks);
}

constexpr int64_t kMaxGridX = int64_t{1} << 16;

// The vector path's shape for rows of D elements of T (the vector kernels above): `slots` vectors
// per thread and `threads` per block; slots = 0 where D is not a whole number of vectors or is
// wider than kRowSlots * kMaxVecThreads vectors (the general path takes those; float64 rows always
// take it). One slot up to kOneSlotVectors vectors, two up to 2 * kMaxVecThreads, else four: a
// block's reduction per row (shuffles, two barriers) is then spread over 16 elements per thread at
// 4096 bf16 instead of 8 (RMSNorm's row loop: 19 SASS instructions per element forward, 33
// backward, against 29 and 44 with one slot on 512 threads), for the same bytes in flight per
// multiprocessor; four slots only past 1024 vectors, where the 16-bit backward spills.
constexpr int64_t kOneSlotVectors = 256;
struct VecShape {
  int64_t vectors = 0;
  int slots = 0;
  int threads = 0;
};
template <typename T>
VecShape vec_shape(int64_t D) {
  constexpr int W = device::kRowVecWidth<T>;
  if (D % W != 0 || D / W > device::kRowSlots * device::kMaxVecThreads) {
    return {};
  }
  const int64_t nvec = D / W;
  const int slots = nvec <= kOneSlotVectors ? 1 : nvec <= 2 * device::kMaxVecThreads ? 2 : 4;
  const int64_t per_slot = (nvec + slots - 1) / slots;
  return {nvec, slots, static_cast<int>((per_slot + kWarpSize - 1) / kWarpSize * kWarpSize)};
}

// The vector backward runs one block per row chunk (at most kMaxChunks): for rows of fewer
// vectors its grid holds too few loads in flight (at width 768 bf16, 256 blocks of 96
// threads: 6 warps per multiprocessor), and the general path, whose grid holds many more
// blocks, takes the rows.
constexpr int64_t kMinVecBackwardVectors = 256;

// Whether every buffer allows the vector path's accesses: rows of T, parameters of P (null
// passes).
template <typename T, typename P>
bool vec_aligned(std::initializer_list<const void*> rows,
                 std::initializer_list<const void*> params) {
  constexpr int W = device::kRowVecWidth<T>;
  return std::all_of(rows.begin(), rows.end(),
                     [](const void* p) { return launch::vector_aligned<T>(p, W); }) &&
         std::all_of(params.begin(), params.end(),
                     [](const void* p) { return launch::vector_aligned<P>(p, W); });
}

// Calls fn(std::integral_constant<int, S>{}) for slots = S in {1, 2, 4}.
template <typename Fn>
cudaError_t with_slots(int slots, Fn&& fn) {
  switch (slots) {
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    case 4:
      return fn(std::integral_constant<int, 4>{});
  }
  return cudaErrorInvalidValue;
}

// Calls fn(TypeTag<T>{}, TypeTag<P>{}) for x's element type T and the parameters' P, which is
// T or T's math type (a parameter of another type is converted by the caller).
template <typename Fn>
cudaError_t with_norm_types(DType x_dtype, DType param_dtype, Fn&& fn) {
  return launch::with_dtype<true>(x_dtype, [&](auto x_tag) {
    using T = typename decltype(x_tag)::type;
    using Acc = device::compute_t<T>;
    if (param_dtype == x_dtype) {
      return fn(x_tag, x_tag);
    }
    if (param_dtype == (std::is_same_v<Acc, double> ? DType::f64 : DType::f32)) {
      return fn(x_tag, launch::TypeTag<Acc>{});
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace

cudaError_t norm_forward(const void* x, DType x_dtype, const void* weight, const void* bias,
                         DType param_dtype, void* y, void* mean, void* rstd, int64_t rows,
                         int64_t D, double eps, bool rms, cudaStream_t stream) {
  if ((bias != nullptr && weight == nullptr) || (!rms && rows > 0 && mean == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || D == 0) {
    return cudaSuccess;
  }
  int grid = 0;
  if (const cudaError_t err = launch::capped_grid(rows, kRowBlocksPerSm, &grid);
      err != cudaSuccess) {
    return err;
  }
  return with_norm_types(x_dtype, param_dtype, [&](auto x_tag, auto param_tag) {
    using T = typename decltype(x_tag)::type;
    using P = typename decltype(param_tag)::type;
    using Acc = device::compute_t<T>;
    const auto* xs = static_cast<const T*>(x);
    const auto* ws = static_cast<const P*>(weight);
    const auto* bs = static_cast<const P*>(bias);
    auto* ys = static_cast<T*>(y);
    if constexpr (!std::is_same_v<T, double>) {
      const VecShape shape = vec_shape<T>(D);
      if (shape.slots > 0 && vec_aligned<T, P>({x, y}, {weight, bias})) {
        return with_slots(shape.slots, [&](auto slots) {
          device::norm_forward_vec_kernel<T, P, decltype(slots)::value>
              <<<grid, shape.threads, 0, stream>>>(xs, ws, bs, ys, static_cast<Acc*>(mean),
                                                   static_cast<Acc*>(rstd), rows, D,
                                                   static_cast<Acc>(eps), rms);
          return cudaGetLastError();
        });
      }
    }
    device::norm_forward_kernel<T, P><<<grid, row_threads(D), 0, stream>>>(
        xs, ws, bs, ys, static_cast<Acc*>(mean), static_cast<Acc*>(rstd), rows, D,
        static_cast<Acc>(eps), rms);
    return cudaGetLastError();
  });
}

int64_t norm_backward_workspace(int64_t rows, int64_t D) { return 2 * chunk_count(rows) * D; }

cudaError_t norm_backward(const void* dy, const void* x, DType x_dtype, const void* weight,
                          DType param_dtype, const void* mean, const void* rstd, void* dx,
                          void* dweight, void* dbias, void* workspace, int64_t rows, int64_t D,
                          bool rms, cudaStream_t stream) {
  const bool weight_grads = weight != nullptr;
  if (weight_grads && D > 0 && (dweight == nullptr || dbias == nullptr ||
                                (rows > 0 && workspace == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (D == 0) {
    return cudaSuccess;
  }
  int sms = 0;
  if (const cudaError_t err = launch::sm_count(&sms); err != cudaSuccess) {
    return err;
  }
  return with_norm_types(x_dtype, param_dtype, [&](auto x_tag, auto param_tag) {
    using T = typename decltype(x_tag)::type;
    using P = typename decltype(param_tag)::type;
    using Acc = device::compute_t<T>;
    const auto* mean_data = static_cast<const Acc*>(mean);
    const auto* rstd_data = static_cast<const Acc*>(rstd);
    auto* partials = static_cast<Acc*>(workspace);
    const int64_t chunks = rows > 0 ? chunk_count(rows) : 0;
    const int64_t tiles = (D + kColumnTile - 1) / kColumnTile;
    const dim3 block(kColumnTile, kRowLanes);
    bool fused = false;  // dx and the weight gradients' partial sums by the vector path
    if constexpr (!std::is_same_v<T, double>) {
      const VecShape shape = vec_shape<T>(D);
      if (rows > 0 && shape.slots > 0 && shape.vectors >= kMinVecBackwardVectors &&
          vec_aligned<T, P>({dy, x, dx}, {weight}) &&
          launch::vector_aligned<Acc>(workspace, device::kRowVecWidth<T>)) {
        // One block per chunk of rows: the weight gradients' fixed chunks (every one, an empty
        // chunk's partial sums are 0), or without them about as many as the general path's grid.
        const int64_t wanted =
            weight_grads ? chunks : std::min<int64_t>(rows, int64_t{sms} * kRowBlocksPerSm);
        const int64_t rows_per_chunk = (rows + wanted - 1) / wanted;
        const int64_t blocks = weight_grads ? chunks : (rows + rows_per_chunk - 1) / rows_per_chunk;
        if (const cudaError_t err = with_slots(shape.slots, [&](auto slots) {
              device::norm_backward_vec_kernel<T, P, decltype(slots)::value>
                  <<<static_cast<unsigned>(blocks), shape.threads, 0, stream>>>(
                      static_cast<const T*>(dy), static_cast<const T*>(x),
                      static_cast<const P*>(weight), mean_data, rstd_data,
                      static_cast<T*>(dx), weight_grads ? partials : nullptr, rows, D,
                      rows_per_chunk, rms);
              return cudaGetLastError();
            });
            err != cudaSuccess) {
          return err;
        }
        fused = true;
      }
    }
    if (rows > 0 && !fused) {
      const int grid = static_cast<int>(std::min<int64_t>(rows, int64_t{sms} * kRowBlocksPerSm));
      device::norm_input_grad_kernel<T, P><<<grid, row_threads(D), 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const P*>(weight),
          mean_data, rstd_data, static_cast<T*>(dx), rows, D, rms);
      if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
        return err;
      }
    }
    if (!weight_grads) {
      return cudaSuccess;
    }
    if (chunks > 0 && !fused) {
      const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
      const dim3 grid(static_cast<unsigned>(std::min(tiles, kMaxGridX)),
                      static_cast<unsigned>(chunks));
      device::norm_weight_grad_partials_kernel<T><<<grid, block, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), mean_data, rstd_data, partials,
          rows, D, rows_per_chunk, chunks, rms);
      if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
        return err;
      }
    }
    device::norm_weight_grad_sum_kernel<Acc>
        <<<static_cast<unsigned>(std::min(tiles, kMaxGridX)), block, 0, stream>>>(
            partials, static_cast<Acc*>(dweight), static_cast<Acc*>(dbias), D, chunks);
    return cudaGetLastError();
  });
}

}  // namespace memkern::layer_ops
