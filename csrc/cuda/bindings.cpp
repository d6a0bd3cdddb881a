// The CUDA kernels of the memkern ops, registered for the CUDA dispatch key. The schemas are
// defined in Python (memkern/ops/*.py); this file checks the tensors, picks the device and
// stream, and calls the torch-free launchers of flat_ops.h. It is the only CUDA file that
// includes torch.
#include <cstdint>
#include <optional>
#include <utility>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "flat_ops.h"

namespace {

using memkern::check_flat;
using memkern::check_float32_state;
using memkern::check_scalar;
using memkern::DType;

// The dtype of a gradient or parameter buffer, as the kernels name it.
DType kernel_dtype(const char* op, const char* name, const at::Tensor& t) {
  const at::ScalarType dtype = t.scalar_type();
  if (dtype == at::kFloat) {
    return DType::f32;
  }
  if (dtype == at::kBFloat16) {
    return DType::bf16;
  }
  memkern::check_float_kind(op, name, t);
  return DType::f16;
}

// The optional low-precision parameter copy: its data and dtype (null and the grads' dtype when
// absent: the kernels then write no copy).
std::pair<void*, DType> params_or_none(const char* op, const std::optional<at::Tensor>& params,
                                       DType grads_dtype) {
  if (!params.has_value()) {
    return {nullptr, grads_dtype};
  }
  return {params->data_ptr(), kernel_dtype(op, "params", *params)};
}

// Pointer to an optional one-element float32 tensor's value; null when absent.
const float* optional_scalar(const char* op, const char* name,
                             const std::optional<at::Tensor>& t, const at::Tensor& like) {
  if (!t.has_value()) {
    return nullptr;
  }
  check_scalar(op, name, *t, like);
  return t->data_ptr<float>();
}

// What every optimizer-step launcher takes besides the state (flat_ops.h), from tensors that
// memkern::check_step_args accepted.
struct StepArgs {
  const void* grads;
  DType grads_dtype;
  void* params;
  DType params_dtype;
  int64_t n;
  float* step;
  const float* grad_multiplier;
  const float* found_inf;
};

StepArgs step_args(const char* op, const at::Tensor& master, const at::Tensor& grads,
                   const std::optional<at::Tensor>& params, at::Tensor& step,
                   const std::optional<at::Tensor>& grad_multiplier,
                   const std::optional<at::Tensor>& found_inf) {
  const DType grads_dtype = kernel_dtype(op, "grads", grads);
  const auto [params_data, params_dtype] = params_or_none(op, params, grads_dtype);
  return {grads.data_ptr(),
          grads_dtype,
          params_data,
          params_dtype,
          master.numel(),
          step.data_ptr<float>(),
          optional_scalar(op, "grad_multiplier", grad_multiplier, master),
          optional_scalar(op, "found_inf", found_inf, master)};
}

void check_launch(const char* op, cudaError_t status) {
  TORCH_CHECK(status == cudaSuccess, "memkern.", op, ": CUDA kernel launch failed: ",
              cudaGetErrorString(status));
}

void unscale_cuda(at::Tensor& grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  constexpr const char* op = "unscale_";
  check_flat(op, "grads", grads, grads);
  const DType grads_dtype = kernel_dtype(op, "grads", grads);
  check_scalar(op, "found_inf", found_inf, grads);
  check_scalar(op, "inv_scale", inv_scale, grads);

  const c10::cuda::CUDAGuard device_guard(grads.device());
  check_launch(op, memkern::flat_ops::unscale(grads.data_ptr(), grads_dtype, grads.numel(),
                                              found_inf.data_ptr<float>(),
                                              inv_scale.data_ptr<float>(),
                                              c10::cuda::getCurrentCUDAStream()));
}

at::Tensor l2_norm_cuda(const at::Tensor& grads) {
  constexpr const char* op = "l2_norm";
  check_flat(op, "grads", grads, grads);
  const DType grads_dtype = kernel_dtype(op, "grads", grads);

  const c10::cuda::CUDAGuard device_guard(grads.device());
  const int64_t n = grads.numel();
  const at::TensorOptions float32 = grads.options().dtype(at::kFloat);
  // Per-block sums of squares of the first pass. The caching allocator may hand this memory
  // to the next allocation on this stream once it is freed here, which is safe: that work is
  // ordered after these kernels.
  const at::Tensor partials = at::empty({memkern::flat_ops::l2_norm_partial_count(n)}, float32);
  at::Tensor norm = at::empty({}, float32);
  check_launch(op, memkern::flat_ops::l2_norm(grads.data_ptr(), grads_dtype, n,
                                              partials.data_ptr<float>(),
                                              norm.data_ptr<float>(),
                                              c10::cuda::getCurrentCUDAStream()));
  return norm;
}

void adamw_step_cuda(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                     const at::Tensor& grads, const std::optional<at::Tensor>& params,
                     at::Tensor& step, const std::optional<at::Tensor>& grad_multiplier,
                     const std::optional<at::Tensor>& found_inf, double lr, double beta1,
                     double beta2, double eps, double weight_decay) {
  constexpr const char* op = "adamw_step_";
  memkern::check_step_args(op, master, grads, params, step, grad_multiplier, found_inf);
  check_float32_state(op, "exp_avg", exp_avg, master);
  check_float32_state(op, "exp_avg_sq", exp_avg_sq, master);
  const StepArgs a = step_args(op, master, grads, params, step, grad_multiplier, found_inf);

  const c10::cuda::CUDAGuard device_guard(master.device());
  check_launch(op, memkern::flat_ops::adamw_step(
                       master.data_ptr<float>(), exp_avg.data_ptr<float>(),
                       exp_avg_sq.data_ptr<float>(), a.grads, a.grads_dtype, a.params,
                       a.params_dtype, a.n, a.step, a.grad_multiplier, a.found_inf, lr, beta1,
                       beta2, eps, weight_decay, c10::cuda::getCurrentCUDAStream()));
}

void adamw8bit_step_cuda(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_absmax,
                         at::Tensor& exp_avg_sq, at::Tensor& exp_avg_sq_absmax,
                         const at::Tensor& grads, const std::optional<at::Tensor>& params,
                         at::Tensor& step, const std::optional<at::Tensor>& grad_multiplier,
                         const std::optional<at::Tensor>& found_inf, double lr, double beta1,
                         double beta2, double eps, double weight_decay) {
  constexpr const char* op = "adamw8bit_step_";
  memkern::check_adamw8bit_step_args(master, exp_avg, exp_avg_absmax, exp_avg_sq,
                                     exp_avg_sq_absmax, grads, params, step, grad_multiplier,
                                     found_inf, memkern::flat_ops::kQuantBlock);
  const StepArgs a = step_args(op, master, grads, params, step, grad_multiplier, found_inf);

  const c10::cuda::CUDAGuard device_guard(master.device());
  check_launch(op, memkern::flat_ops::adamw8bit_step(
                       master.data_ptr<float>(), static_cast<int8_t*>(exp_avg.data_ptr()),
                       exp_avg_absmax.data_ptr<float>(),
                       static_cast<uint8_t*>(exp_avg_sq.data_ptr()),
                       exp_avg_sq_absmax.data_ptr<float>(), a.grads, a.grads_dtype, a.params,
                       a.params_dtype, a.n, a.step, a.grad_multiplier, a.found_inf, lr, beta1,
                       beta2, eps, weight_decay, c10::cuda::getCurrentCUDAStream()));
}

void sgd_step_cuda(at::Tensor& master, const std::optional<at::Tensor>& momentum_buffer,
                   const at::Tensor& grads, const std::optional<at::Tensor>& params,
                   at::Tensor& step, const std::optional<at::Tensor>& grad_multiplier,
                   const std::optional<at::Tensor>& found_inf, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov) {
  constexpr const char* op = "sgd_step_";
  memkern::check_step_args(op, master, grads, params, step, grad_multiplier, found_inf);
  memkern::check_momentum_buffer(op, momentum, momentum_buffer, master);
  // As in the reference, the buffer is only used with momentum.
  float* momentum_buffer_data =
      momentum != 0.0 ? momentum_buffer->data_ptr<float>() : nullptr;
  const StepArgs a = step_args(op, master, grads, params, step, grad_multiplier, found_inf);

  const c10::cuda::CUDAGuard device_guard(master.device());
  check_launch(op, memkern::flat_ops::sgd_step(
                       master.data_ptr<float>(), momentum_buffer_data, a.grads, a.grads_dtype,
                       a.params, a.params_dtype, a.n, a.step, a.grad_multiplier, a.found_inf,
                       lr, momentum, dampening, weight_decay, nesterov,
                       c10::cuda::getCurrentCUDAStream()));
}

void sgd8bit_step_cuda(at::Tensor& master, at::Tensor& momentum_buffer,
                       at::Tensor& momentum_absmax, const at::Tensor& grads,
                       const std::optional<at::Tensor>& params, at::Tensor& step,
                       const std::optional<at::Tensor>& grad_multiplier,
                       const std::optional<at::Tensor>& found_inf, double lr, double momentum,
                       double dampening, double weight_decay, bool nesterov) {
  constexpr const char* op = "sgd8bit_step_";
  memkern::check_sgd8bit_step_args(master, momentum_buffer, momentum_absmax, grads, params, step,
                                   grad_multiplier, found_inf, momentum,
                                   memkern::flat_ops::kQuantBlock);
  const StepArgs a = step_args(op, master, grads, params, step, grad_multiplier, found_inf);

  const c10::cuda::CUDAGuard device_guard(master.device());
  check_launch(op, memkern::flat_ops::sgd8bit_step(
                       master.data_ptr<float>(), static_cast<int8_t*>(momentum_buffer.data_ptr()),
                       momentum_absmax.data_ptr<float>(), a.grads, a.grads_dtype, a.params,
                       a.params_dtype, a.n, a.step, a.grad_multiplier, a.found_inf, lr,
                       momentum, dampening, weight_decay, nesterov,
                       c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CUDA, m) {
  m.impl("unscale_", TORCH_FN(unscale_cuda));
  m.impl("l2_norm", TORCH_FN(l2_norm_cuda));
  m.impl("adamw_step_", TORCH_FN(adamw_step_cuda));
  m.impl("adamw8bit_step_", TORCH_FN(adamw8bit_step_cuda));
  m.impl("sgd_step_", TORCH_FN(sgd_step_cuda));
  m.impl("sgd8bit_step_", TORCH_FN(sgd8bit_step_cuda));
}
