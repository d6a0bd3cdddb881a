// memkern::cross_entropy_rows_ and memkern::cross_entropy_block_grad_ on CUDA, torch-free: the
// kernels, on the per-row math of kernels/cross_entropy_math.h, which the CPU kernels run too,
// and their launchers (cross_entropy_launch.h), which pick the dtype instantiation and the grid
// and launch on the caller's stream. Contracts: memkern/ops/cross_entropy.py.
//
// Rows: one block of kRowThreads threads per row; thread j is lane j of the row's tile walk
// (cross_entropy_math.h), its tiles one aligned 16-byte load each. Pass 1 keeps each thread's
// online normaliser, merged across the block (warp shuffles, then one warp); pass 2 writes the
// gradient, each thread walking its tiles backwards so that the last ones read — the likeliest
// still in L2 — are read again first. A row is read twice and written once; an ignored row is
// only written (zeros). The per-row statistics asked (`outputs`) come from pass 1 (the
// entropy's running sum kept by the Entropy instantiation only), is-top-1 from one more read of
// the columns before the target, for a target at the row's maximum. Block gradient: one block
// per row, elementwise from the row's log-sum-exp (and entropy). 64-bit indexing throughout.
#include <algorithm>
#include <cstdint>

#include "cross_entropy_launch.h"
#include "kernels/cross_entropy_math.h"
#include "kernels/layer_common.cuh"
#include "launch.cuh"

namespace memkern::device::cross_entropy {

namespace ce = memkern::cross_entropy;

constexpr int kRowThreads = 512;
constexpr int kWarps = kRowThreads / 32;

// Logits per tile: one 16-byte vector.
template <typename T>
constexpr int kTile = static_cast<int>(16 / sizeof(T));

template <typename T>
__device__ __forceinline__ ce::RowTiles<kTile<T>> row_tiles(const T* row, int64_t n) {
  return {n, ce::head_of(reinterpret_cast<uintptr_t>(row), sizeof(T), n)};
}

// The logits of tile i, soft-capped, in the math type; returns how many.
template <typename T>
__device__ __forceinline__ int load_tile(const T* row, const ce::RowTiles<kTile<T>>& tiles,
                                         int64_t i, compute_t<T> cap, compute_t<T>* z) {
  using A = compute_t<T>;
  constexpr int Tile = kTile<T>;
  const int64_t first = tiles.first(i);
  A slope;
  if (tiles.full(i)) {
    const Vec<T, Tile> v = load<Tile>(row, first);
#pragma unroll
    for (int j = 0; j < Tile; ++j) z[j] = ce::capped(to_compute(v.v[j]), cap, &slope);
    return Tile;
  }
  const int k = tiles.size(i);
  for (int j = 0; j < k; ++j) z[j] = ce::capped(to_compute(row[first + j]), cap, &slope);
  return k;
}

// What writing a row's gradient needs besides its logits: its normaliser (max, log_sum) — or
// (lse, 0) for a saved log-sum-exp — and the row's settings.
template <typename A>
struct GradRow {
  int64_t target;
  int64_t class_offset;  // the class of the row's column 0
  A max;
  A log_sum;
  A keep;    // 1 - eps
  A spread;  // eps / V
  A scale;
  A cap;
  A entropy = A(0);        // the entropy's term (block_grad_kernel<T, true>): the row's entropy
  A entropy_scale = A(0);  // and its factor
};

// Tile i of `row` overwritten with its gradient.
// One gradient element of the row `g` describes, at class `column`.
template <bool Entropy, typename A>
__device__ __forceinline__ A grad_element(A raw, int64_t column, const GradRow<A>& g) {
  A slope;
  const A z = ce::capped(raw, g.cap, &slope);
  const A hit = column == g.target ? g.keep : A(0);
  const A logp = ce::log_prob(z, g.max, g.log_sum);
  if constexpr (Entropy) {
    return ce::grad_value_entropy(logp, hit, g.spread, g.scale, slope, g.entropy,
                                  g.entropy_scale);
  } else {
    return ce::grad_value(logp, hit, g.spread, g.scale, slope);
  }
}

// Tile i of `row` overwritten with its gradient (with Entropy, the entropy's term in it).
template <bool Entropy = false, typename T>
__device__ __forceinline__ void write_grad_tile(T* row, const ce::RowTiles<kTile<T>>& tiles,
                                                int64_t i, const GradRow<compute_t<T>>& g) {
  constexpr int Tile = kTile<T>;
  const int64_t first = tiles.first(i);
  const int64_t column = g.class_offset + first;
  if (tiles.full(i)) {
    Vec<T, Tile> v = load<Tile>(row, first);
#pragma unroll
    for (int j = 0; j < Tile; ++j) {
      v.v[j] = from_compute<T>(grad_element<Entropy>(to_compute(v.v[j]), column + j, g));
    }
    store<Tile>(row, first, v);
    return;
  }
  const int k = tiles.size(i);
  for (int j = 0; j < k; ++j) {
    row[first + j] = from_compute<T>(grad_element<Entropy>(to_compute(row[first + j]),
                                                           column + j, g));
  }
}

// Whether a column before `target` in this thread's tiles of the row is at the row's maximum
// (ce::at_max): thread j reads tiles j, j + kRowThreads, ... that start before the target.
template <typename T>
__device__ __forceinline__ bool max_before(const T* row, const ce::RowTiles<kTile<T>>& tiles,
                                           int64_t target, compute_t<T> max, compute_t<T> cap) {
  using A = compute_t<T>;
  for (int64_t i = threadIdx.x; i < tiles.count() && tiles.first(i) < target; i += kRowThreads) {
    A z[kTile<T>] = {};
    const int k = load_tile(row, tiles, i, cap, z);
    const int64_t first = tiles.first(i);
    for (int j = 0; j < k; ++j) {
      if (first + j < target && ce::at_max(z[j], max)) return true;
    }
  }
  return false;
}

template <typename T>
__device__ __forceinline__ void zero_tile(T* row, const ce::RowTiles<kTile<T>>& tiles,
                                          int64_t i) {
  constexpr int Tile = kTile<T>;
  const int64_t first = tiles.first(i);
  if (tiles.full(i)) {
    Vec<T, Tile> v;
#pragma unroll
    for (int j = 0; j < Tile; ++j) v.v[j] = from_compute<T>(compute_t<T>(0));
    store<Tile>(row, first, v);
    return;
  }
  const int k = tiles.size(i);
  for (int j = 0; j < k; ++j) row[first + j] = from_compute<T>(compute_t<T>(0));
}

template <typename A>
__device__ __forceinline__ ce::Online<A> shuffle_xor(const ce::Online<A>& a, int offset) {
  return {__shfl_xor_sync(0xffffffffu, a.max, offset), __shfl_xor_sync(0xffffffffu, a.sum, offset),
          __shfl_xor_sync(0xffffffffu, a.total, offset),
          __shfl_xor_sync(0xffffffffu, a.moment, offset)};
}

template <bool Entropy, typename A>
__device__ __forceinline__ void warp_merge(ce::Online<A>& a) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    ce::online_merge<Entropy>(a, shuffle_xor(a, offset));
  }
}

// The normaliser of the whole block's lanes, in thread 0.
template <bool Entropy, typename A>
__device__ __forceinline__ ce::Online<A> block_merge(ce::Online<A> a, ce::Online<A>* shared) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  warp_merge<Entropy>(a);
  if (lane == 0) shared[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < kWarps ? shared[lane] : ce::online_start<A>();
    warp_merge<Entropy>(a);
  }
  return a;
}

// With Entropy, the entropy's running sum kept (outputs holds ce::kRowEntropy).
template <typename T, bool Entropy>
__global__ void __launch_bounds__(kRowThreads)
    rows_kernel(T* logits, int64_t n, int64_t V, const int64_t* target,
                const compute_t<T>* row_scale, compute_t<T>* loss, compute_t<T>* lse, int64_t ignore_index,
                compute_t<T> eps, compute_t<T> cap, bool compute_grad, int outputs,
                compute_t<T>* stats, int64_t stats_stride) {
  using A = compute_t<T>;
  constexpr int Tile = kTile<T>;
  __shared__ ce::Online<A> warp_stats[kWarps];
  __shared__ A row_max, row_log_sum;
  __shared__ bool target_at_max;
  const bool top1 = (outputs & ce::kRowIsTop1) != 0;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    T* row = logits + r * V;
    const int64_t t = target[r];
    const ce::RowTiles<Tile> tiles = row_tiles(row, V);
    const int64_t count = tiles.count();
    if (t == ignore_index) {  // the same branch for the whole block
      if (threadIdx.x == 0) {
        loss[r] = lse[r] = A(0);
        if (Entropy) stats[ce::kEntropyRow * stats_stride + r] = A(0);
        if (top1) stats[ce::kIsTop1Row * stats_stride + r] = A(0);
        if ((outputs & ce::kRowMeanLogit) != 0) stats[ce::kMeanLogitRow * stats_stride + r] = A(0);
      }
      if (compute_grad) {
        for (int64_t i = threadIdx.x; i < count; i += kRowThreads) zero_tile(row, tiles, i);
      }
      continue;
    }
    ce::Online<A> acc = ce::online_start<A>();
#pragma unroll 2  // two tiles' loads in flight per thread
    for (int64_t i = threadIdx.x; i < count; i += kRowThreads) {
      A z[Tile] = {};
      const int k = load_tile(row, tiles, i, cap, z);
      ce::online_add<Entropy>(acc, z, k);
    }
    acc = block_merge<Entropy>(acc, warp_stats);
    if (threadIdx.x == 0) {
      const A l = ce::online_lse(acc);
      const bool in_range = t >= 0 && t < V;  // never read outside the row
      A slope;
      const A z_t = in_range ? ce::capped(to_compute(row[t]), cap, &slope) : A(0);
      loss[r] = ce::row_loss(l, in_range, z_t, acc.total, V, eps);
      lse[r] = l;
      row_max = acc.max;
      row_log_sum = ce::log_of(acc.sum);
      target_at_max = in_range && ce::at_max(z_t, acc.max);
      if (Entropy) stats[ce::kEntropyRow * stats_stride + r] = ce::online_entropy(acc);
      if ((outputs & ce::kRowMeanLogit) != 0) {
        stats[ce::kMeanLogitRow * stats_stride + r] = acc.total / static_cast<A>(V);
      }
    }
    __syncthreads();  // row_max/log_sum are read before any thread reaches the next barrier
    if (top1) {  // the same branch for the whole block: the target is the first maximum?
      const bool earlier = __syncthreads_or(
          target_at_max && max_before(row, tiles, t, row_max, cap) ? 1 : 0);
      if (threadIdx.x == 0) {
        stats[ce::kIsTop1Row * stats_stride + r] = target_at_max && !earlier ? A(1) : A(0);
      }
    }
    if (compute_grad && threadIdx.x < count) {
      const GradRow<A> g{t, 0, row_max, row_log_sum, A(1) - eps, eps / static_cast<A>(V),
                         row_scale == nullptr ? A(1) : row_scale[r], cap};
      const int64_t last = threadIdx.x + (count - 1 - threadIdx.x) / kRowThreads * kRowThreads;
      for (int64_t i = last; i >= 0; i -= kRowThreads) write_grad_tile(row, tiles, i, g);
    }
  }
}

// With Entropy, the entropy's term too (entropy, entropy_scale given).
template <typename T, bool Entropy>
__global__ void block_grad_kernel(T* logits, int64_t n, int64_t width, const compute_t<T>* lse,
                                  const int64_t* target, const compute_t<T>* row_scale,
                                  int64_t scale_stride, int64_t class_offset,
                                  int64_t num_classes, int64_t ignore_index, compute_t<T> eps,
                                  compute_t<T> cap, const compute_t<T>* entropy,
                                  const compute_t<T>* entropy_scale,
                                  int64_t entropy_scale_stride) {
  using A = compute_t<T>;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    T* row = logits + r * width;
    const int64_t t = target[r];
    const ce::RowTiles<kTile<T>> tiles = row_tiles(row, width);
    const int64_t count = tiles.count();
    if (t == ignore_index) {
      for (int64_t i = threadIdx.x; i < count; i += blockDim.x) zero_tile(row, tiles, i);
      continue;
    }
    GradRow<A> g{t, class_offset, lse[r], A(0), A(1) - eps,
                 eps / static_cast<A>(num_classes), row_scale[r * scale_stride], cap};
    if (Entropy) {
      g.entropy = entropy[r];
      g.entropy_scale = entropy_scale[r * entropy_scale_stride];
    }
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
      write_grad_tile<Entropy>(row, tiles, i, g);
    }
  }
}

}  // namespace memkern::device::cross_entropy

namespace memkern::cross_entropy_launch {
namespace {

namespace kernels = memkern::device::cross_entropy;
namespace ce = memkern::cross_entropy;

// One block per row, up to the grid's limit (the kernels loop over the rest).
unsigned int row_blocks(int64_t n) {
  return static_cast<unsigned int>(std::min<int64_t>(n, int64_t{1} << 30));
}

}  // namespace

cudaError_t rows(void* logits, DType type, int64_t n, int64_t V, const int64_t* target,
                 const void* row_scale, void* loss, void* lse, int64_t ignore_index,
                 double label_smoothing, double softcap, bool compute_grad, int outputs,
                 void* stats, int64_t stats_stride, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launch::with_dtype<true>(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = device::compute_t<T>;
    const auto kernel = (outputs & ce::kRowEntropy) != 0 ? kernels::rows_kernel<T, true>
                                                         : kernels::rows_kernel<T, false>;
    kernel<<<row_blocks(n), kernels::kRowThreads, 0, stream>>>(
        static_cast<T*>(logits), n, V, target, static_cast<const A*>(row_scale),
        static_cast<A*>(loss), static_cast<A*>(lse), ignore_index, static_cast<A>(label_smoothing),
        static_cast<A>(softcap), compute_grad, outputs, static_cast<A*>(stats), stats_stride);
    return cudaGetLastError();
  });
}

cudaError_t block_grad(void* logits, DType type, int64_t n, int64_t width,
                       const void* lse, const int64_t* target, const void* row_scale,
                       int64_t scale_stride, int64_t class_offset, int64_t num_classes,
                       int64_t ignore_index, double label_smoothing, double softcap,
                       const void* entropy, const void* entropy_scale,
                       int64_t entropy_scale_stride, cudaStream_t stream) {
  if (n == 0 || width == 0) return cudaSuccess;
  return launch::with_dtype<true>(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = device::compute_t<T>;
    // a thread per tile of a row (plus the head), in whole warps, at most 256
    const int64_t tiles = width / kernels::kTile<T> + 2;
    const int threads = static_cast<int>(std::min<int64_t>(256, (tiles + 31) / 32 * 32));
    const auto kernel = entropy != nullptr ? kernels::block_grad_kernel<T, true>
                                           : kernels::block_grad_kernel<T, false>;
    kernel<<<row_blocks(n), threads, 0, stream>>>(
        static_cast<T*>(logits), n, width, static_cast<const A*>(lse), target,
        static_cast<const A*>(row_scale), scale_stride, class_offset, num_classes,
        ignore_index, static_cast<A>(label_smoothing), static_cast<A>(softcap),
        static_cast<const A*>(entropy), static_cast<const A*>(entropy_scale),
        entropy_scale_stride);
    return cudaGetLastError();
  });
}

}  // namespace memkern::cross_entropy_launch
