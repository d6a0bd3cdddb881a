// Launchers declared in flat_ops.h: pick the dtype instantiation, the vectorised or scalar
// path and the grid, then launch on the caller's stream. No host synchronisation.
#include "flat_ops.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/adamw.cuh"
#include "kernels/adamw8bit.cuh"
#include "kernels/common.cuh"
#include "kernels/l2_norm.cuh"
#include "kernels/sgd.cuh"
#include "kernels/sgd8bit.cuh"
#include "kernels/step_counter.cuh"
#include "kernels/unscale.cuh"
#include "launch.cuh"

namespace memkern::flat_ops {
namespace {

using device::kThreadsPerBlock;
static_assert(device::kQBlock == kQuantBlock, "one quantization block size for kernel and host");
using device::kVecWidth;

using launch::TypeTag;
using launch::with_dtype;

// Calls fn(TypeTag<G>{}, TypeTag<P>{}) with the element types of grads and params.
template <typename Fn>
cudaError_t with_dtypes(DType grads_dtype, DType params_dtype, Fn&& fn) {
  return with_dtype(grads_dtype, [&](auto grads_tag) {
    return with_dtype(params_dtype, [&](auto params_tag) { return fn(grads_tag, params_tag); });
  });
}

// Whether `buffer` (a T array) allows kVecWidth-element vector accesses; null passes.
template <typename T>
bool vector_aligned(const void* buffer) {
  return launch::vector_aligned<T>(buffer, kVecWidth);
}

int64_t blocks_for(int64_t n) {
  constexpr int64_t kElementsPerBlock = int64_t{kThreadsPerBlock} * kVecWidth;
  return std::max<int64_t>((n + kElementsPerBlock - 1) / kElementsPerBlock, 1);
}

// Grid of an elementwise kernel: enough blocks for one kVecWidth chunk per thread, capped at
// the blocks of `kernel` the current device holds resident at once; the grid-stride loops
// cover the rest, so a block's fixed costs (the AdamW bias corrections) are paid once per
// resident block and no partial second wave is left at the end.
template <typename Kernel>
cudaError_t elementwise_grid(Kernel kernel, int64_t n, int* grid) {
  int device = 0;
  int sm_count = 0;
  int blocks_per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  }
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                        kThreadsPerBlock, 0);
  }
  if (err != cudaSuccess) {
    return err;
  }
  const int64_t resident_blocks = std::max<int64_t>(int64_t{sm_count} * blocks_per_sm, 1);
  *grid = static_cast<int>(std::min(blocks_for(n), resident_blocks));
  return cudaSuccess;
}

// kernel<<<its elementwise grid for n elements, kThreadsPerBlock>>>(args...) on `stream`.
template <typename... Params, typename... Args>
cudaError_t launch_elementwise(void (*kernel)(Params...), int64_t n, cudaStream_t stream,
                               Args... args) {
  int grid = 0;
  if (const cudaError_t err = elementwise_grid(kernel, n, &grid); err != cudaSuccess) {
    return err;
  }
  kernel<<<grid, kThreadsPerBlock, 0, stream>>>(args...);
  return cudaGetLastError();
}

cudaError_t launch_advance_step(float* step, const float* found_inf, cudaStream_t stream) {
  device::advance_step_kernel<<<1, 1, 0, stream>>>(step, found_inf);
  return cudaGetLastError();
}

// The frame of both optimizer steps: launch(grads_tag, params_tag) for the buffers' dtypes
// (without params any instantiation serves; reusing the grads dtype adds none), then the step
// counter's advance, ordered after the main kernel on the stream.
template <typename Launch>
cudaError_t launch_step(int64_t n, DType grads_dtype, const void* params, DType params_dtype,
                        float* step, const float* found_inf, cudaStream_t stream,
                        const Launch& launch) {
  if (n > 0) {
    const DType written_dtype = params != nullptr ? params_dtype : grads_dtype;
    if (const cudaError_t err = with_dtypes(grads_dtype, written_dtype, launch);
        err != cudaSuccess) {
      return err;
    }
  }
  return launch_advance_step(step, found_inf, stream);
}

// The launch of an 8-bit step kernel, whose parameters are (master, moments..., grads, params,
// n, step, grad_multiplier, found_inf, constants): kernel_for(grads_tag, params_tag,
// vector_tag) names its instantiation for the buffers' dtypes and whether they allow vector
// accesses (the absmax buffers need no alignment: one float per block).
template <typename KernelFor, typename Constants, typename... code_t>
cudaError_t launch_qblock_step(const KernelFor& kernel_for, float* master, const void* grads,
                               DType grads_dtype, void* params, DType params_dtype, int64_t n,
                               float* step, const float* grad_multiplier,
                               const float* found_inf, const Constants& constants,
                               cudaStream_t stream, device::QMoment<code_t>... moments) {
  const auto launch = [&](auto grads_tag, auto params_tag) {
    using G = typename decltype(grads_tag)::type;
    using P = typename decltype(params_tag)::type;
    const bool vectorised = vector_aligned<float>(master) && vector_aligned<G>(grads) &&
                            vector_aligned<P>(params) &&
                            (vector_aligned<code_t>(moments.codes) && ...);
    const auto launch_with = [&](auto vector_tag) {
      return launch_elementwise(kernel_for(grads_tag, params_tag, vector_tag), n, stream,
                                master, moments..., static_cast<const G*>(grads),
                                static_cast<P*>(params), n, step, grad_multiplier, found_inf,
                                constants);
    };
    return vectorised ? launch_with(std::true_type{}) : launch_with(std::false_type{});
  };
  return launch_step(n, grads_dtype, params, params_dtype, step, found_inf, stream, launch);
}

device::AdamWConstants adamw_constants(double lr, double beta1, double beta2, double eps,
                                       double weight_decay) {
  const math::AdamWHyper hyper{lr, beta1, beta2, eps, weight_decay};
  return device::AdamWConstants{hyper, math::adamw_coefficients(hyper, 1.0f)};
}

}  // namespace

cudaError_t unscale(void* grads, DType grads_dtype, int64_t n, float* found_inf,
                    const float* inv_scale, cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  return with_dtype(grads_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_elementwise(device::unscale_kernel<T>, n, stream, static_cast<T*>(grads), n,
                              vector_aligned<T>(grads), found_inf, inv_scale);
  });
}

int64_t l2_norm_partial_count(int64_t n) {
  return std::min<int64_t>(blocks_for(n), device::kL2NormMaxPartials);
}

cudaError_t l2_norm(const void* grads, DType grads_dtype, int64_t n, float* partials,
                    float* norm, cudaStream_t stream) {
  // At least one partial block even for n == 0: it writes a zero sum, so the norm is 0.
  const int partial_count = static_cast<int>(l2_norm_partial_count(n));
  return with_dtype(grads_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    device::l2_norm_partials_kernel<T><<<partial_count, kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(grads), n, vector_aligned<T>(grads), partials);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
      return err;
    }
    device::l2_norm_finalize_kernel<<<1, kThreadsPerBlock, 0, stream>>>(partials,
                                                                         partial_count, norm);
    return cudaGetLastError();
  });
}

cudaError_t adamw_step(float* master, float* exp_avg, float* exp_avg_sq, const void* grads,
                       DType grads_dtype, void* params, DType params_dtype, int64_t n,
                       float* step, const float* grad_multiplier, const float* found_inf,
                       double lr, double beta1, double beta2, double eps, double weight_decay,
                       cudaStream_t stream) {
  const device::AdamWConstants constants = adamw_constants(lr, beta1, beta2, eps, weight_decay);
  const auto launch = [&](auto grads_tag, auto params_tag) {
    using G = typename decltype(grads_tag)::type;
    using P = typename decltype(params_tag)::type;
    const bool vectorised = vector_aligned<float>(master) && vector_aligned<float>(exp_avg) &&
                            vector_aligned<float>(exp_avg_sq) && vector_aligned<G>(grads) &&
                            vector_aligned<P>(params);
    return launch_elementwise(device::adamw_step_kernel<G, P>, n, stream, master, exp_avg,
                              exp_avg_sq, static_cast<const G*>(grads), static_cast<P*>(params),
                              n, vectorised, step, grad_multiplier, found_inf, constants);
  };
  return launch_step(n, grads_dtype, params, params_dtype, step, found_inf, stream, launch);
}

cudaError_t adamw8bit_step(float* master, int8_t* exp_avg, float* exp_avg_absmax,
                           uint8_t* exp_avg_sq, float* exp_avg_sq_absmax, const void* grads,
                           DType grads_dtype, void* params, DType params_dtype, int64_t n,
                           float* step, const float* grad_multiplier, const float* found_inf,
                           double lr, double beta1, double beta2, double eps,
                           double weight_decay, cudaStream_t stream) {
  const auto kernel_for = [](auto grads_tag, auto params_tag, auto vector_tag) {
    return device::adamw8bit_step_kernel<typename decltype(grads_tag)::type,
                                         typename decltype(params_tag)::type,
                                         decltype(vector_tag)::value>;
  };
  return launch_qblock_step(kernel_for, master, grads, grads_dtype, params, params_dtype, n,
                            step, grad_multiplier, found_inf,
                            adamw_constants(lr, beta1, beta2, eps, weight_decay), stream,
                            device::QMoment<int8_t>{exp_avg, exp_avg_absmax},
                            device::QMoment<uint8_t>{exp_avg_sq, exp_avg_sq_absmax});
}

cudaError_t sgd_step(float* master, float* momentum_buffer, const void* grads,
                     DType grads_dtype, void* params, DType params_dtype, int64_t n,
                     float* step, const float* grad_multiplier, const float* found_inf,
                     double lr, double momentum, double dampening, double weight_decay,
                     bool nesterov, cudaStream_t stream) {
  // An empty tensor's data pointer is null, so an empty momentum buffer is not a missing one:
  // only a non-empty step needs it (the first GPU run failed here on empty buffers).
  if (n > 0 && momentum != 0.0 && momentum_buffer == nullptr) {
    return cudaErrorInvalidValue;
  }
  const math::SgdCoefficients constants =
      math::sgd_coefficients(lr, momentum, dampening, weight_decay, nesterov);
  const auto launch = [&](auto grads_tag, auto params_tag) {
    using G = typename decltype(grads_tag)::type;
    using P = typename decltype(params_tag)::type;
    // A null momentum_buffer (momentum == 0) counts as aligned: it is never accessed.
    const bool vectorised = vector_aligned<float>(master) &&
                            vector_aligned<float>(momentum_buffer) &&
                            vector_aligned<G>(grads) && vector_aligned<P>(params);
    return launch_elementwise(device::sgd_step_kernel<G, P>, n, stream, master,
                              momentum_buffer, static_cast<const G*>(grads),
                              static_cast<P*>(params), n, vectorised, step, grad_multiplier,
                              found_inf, constants);
  };
  return launch_step(n, grads_dtype, params, params_dtype, step, found_inf, stream, launch);
}

cudaError_t sgd8bit_step(float* master, int8_t* momentum_buffer, float* momentum_absmax,
                         const void* grads, DType grads_dtype, void* params, DType params_dtype,
                         int64_t n, float* step, const float* grad_multiplier,
                         const float* found_inf, double lr, double momentum, double dampening,
                         double weight_decay, bool nesterov, cudaStream_t stream) {
  if (momentum <= 0.0) {
    return cudaErrorInvalidValue;  // without momentum there is no state: sgd_step
  }
  const auto kernel_for = [](auto grads_tag, auto params_tag, auto vector_tag) {
    return device::sgd8bit_step_kernel<typename decltype(grads_tag)::type,
                                       typename decltype(params_tag)::type,
                                       decltype(vector_tag)::value>;
  };
  return launch_qblock_step(kernel_for, master, grads, grads_dtype, params, params_dtype, n,
                            step, grad_multiplier, found_inf,
                            math::sgd_coefficients(lr, momentum, dampening, weight_decay, nesterov),
                            stream, device::QMoment<int8_t>{momentum_buffer, momentum_absmax});
}

}  // namespace memkern::flat_ops
