// Launchers declared in cross_entropy_launch.h: pick the dtype instantiation and the grid, then
// launch on the caller's stream.
#include "cross_entropy_launch.h"

#include <algorithm>
#include <cstdint>

#include "kernels/cross_entropy.cuh"
#include "launch.cuh"

namespace memkern::cross_entropy_launch {
namespace {

namespace kernels = memkern::device::cross_entropy;

// One block per row, up to the grid's limit (the kernels loop over the rest).
unsigned int row_blocks(int64_t n) {
  return static_cast<unsigned int>(std::min<int64_t>(n, int64_t{1} << 30));
}

}  // namespace

cudaError_t rows(void* logits, DType type, int64_t n, int64_t V, const int64_t* target,
                 const void* row_scale, void* loss, void* lse, int64_t ignore_index,
                 double label_smoothing, double softcap, bool compute_grad,
                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launch::with_dtype<true>(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = device::compute_t<T>;
    kernels::rows_kernel<T><<<row_blocks(n), kernels::kRowThreads, 0, stream>>>(
        static_cast<T*>(logits), n, V, target, static_cast<const A*>(row_scale),
        static_cast<A*>(loss), static_cast<A*>(lse), ignore_index, static_cast<A>(label_smoothing),
        static_cast<A>(softcap), compute_grad);
    return cudaGetLastError();
  });
}

cudaError_t block_grad(void* logits, DType type, int64_t n, int64_t width,
                       const void* lse, const int64_t* target, const void* row_scale,
                       int64_t scale_stride, int64_t class_offset, int64_t num_classes,
                       int64_t ignore_index, double label_smoothing, double softcap,
                       cudaStream_t stream) {
  if (n == 0 || width == 0) return cudaSuccess;
  return launch::with_dtype<true>(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = device::compute_t<T>;
    // a thread per tile of a row (plus the head), in whole warps, at most 256
    const int64_t tiles = width / kernels::kTile<T> + 2;
    const int threads = static_cast<int>(std::min<int64_t>(256, (tiles + 31) / 32 * 32));
    kernels::block_grad_kernel<T><<<row_blocks(n), threads, 0, stream>>>(
        static_cast<T*>(logits), n, width, static_cast<const A*>(lse), target,
        static_cast<const A*>(row_scale), scale_stride, class_offset, num_classes,
        ignore_index, static_cast<A>(label_smoothing), static_cast<A>(softcap));
    return cudaGetLastError();
  });
}

}  // namespace memkern::cross_entropy_launch
