// The launchers of memkern::norm_forward / norm_backward's CUDA kernels (layer_ops.h): the
// path (vector or general, norm.cuh) and block size from D and the buffers' alignment, the
// parameter type's instantiation, the weight-gradient chunks.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/norm.cuh"
#include "launch.cuh"
#include "layer_ops.h"

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

// The vector path's shape for rows of D elements of T (norm.cuh): `slots` vectors per thread
// and `threads` per block; slots = 0 where D is not a whole number of vectors or is wider than
// kRowSlots * kMaxVecThreads vectors (the general path takes those; float64 rows always take
// it). One slot up to kOneSlotVectors vectors, two up to 2 * kMaxVecThreads, else four: a
// block's reduction per row (shuffles, two barriers) is then spread over 16 elements per
// thread at 4096 bf16 instead of 8 (RMSNorm's row loop: 19 SASS instructions per element
// forward, 33 backward, against 29 and 44 with one slot on 512 threads), for the same bytes
// in flight per multiprocessor; four slots only past 1024 vectors, where the 16-bit backward
// spills.
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
