// The CUDA kernels of the memkern ops, registered for the CUDA dispatch key. The schemas are
// defined in Python (memkern/ops/*.py); this file checks the tensors, picks the device and
// stream, and calls the torch-free launchers of flat_ops.h. It is the only CUDA file that
// includes torch.
#include <cstdint>
#include <optional>

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
using memkern::flat_ops::DType;

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

// Pointer to an optional one-element float32 tensor's value; null when absent.
const float* optional_scalar(const char* op, const char* name,
                             const std::optional<at::Tensor>& t, const at::Tensor& like) {
  if (!t.has_value()) {
    return nullptr;
  }
  check_scalar(op, name, *t, like);
  return t->data_ptr<float>();
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
  check_float32_state(op, "master", master, master);
  check_float32_state(op, "exp_avg", exp_avg, master);
  check_float32_state(op, "exp_avg_sq", exp_avg_sq, master);
  check_flat(op, "grads", grads, master);
  const DType grads_dtype = kernel_dtype(op, "grads", grads);
  void* params_data = nullptr;
  DType params_dtype = grads_dtype;
  if (params.has_value()) {
    check_flat(op, "params", *params, master);
    params_dtype = kernel_dtype(op, "params", *params);
    params_data = params->data_ptr();
  }
  check_scalar(op, "step", step, master);
  const float* grad_multiplier_data = optional_scalar(op, "grad_multiplier", grad_multiplier,
                                                      master);
  const float* found_inf_data = optional_scalar(op, "found_inf", found_inf, master);

  const c10::cuda::CUDAGuard device_guard(master.device());
  check_launch(op, memkern::flat_ops::adamw_step(
                       master.data_ptr<float>(), exp_avg.data_ptr<float>(),
                       exp_avg_sq.data_ptr<float>(), grads.data_ptr(), grads_dtype, params_data,
                       params_dtype, master.numel(), step.data_ptr<float>(),
                       grad_multiplier_data, found_inf_data, lr, beta1, beta2, eps,
                       weight_decay, c10::cuda::getCurrentCUDAStream()));
}

void sgd_step_cuda(at::Tensor& master, const std::optional<at::Tensor>& momentum_buffer,
                   const at::Tensor& grads, const std::optional<at::Tensor>& params,
                   at::Tensor& step, const std::optional<at::Tensor>& grad_multiplier,
                   const std::optional<at::Tensor>& found_inf, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov) {
  constexpr const char* op = "sgd_step_";
  check_float32_state(op, "master", master, master);
  // As in the reference, the buffer is only used (and so only checked) with momentum.
  float* momentum_buffer_data = nullptr;
  if (momentum != 0.0) {
    TORCH_CHECK(momentum_buffer.has_value(), "memkern.", op, ": momentum=", momentum,
                " needs a momentum_buffer");
    check_float32_state(op, "momentum_buffer", *momentum_buffer, master);
    momentum_buffer_data = momentum_buffer->data_ptr<float>();
  }
  check_flat(op, "grads", grads, master);
  const DType grads_dtype = kernel_dtype(op, "grads", grads);
  void* params_data = nullptr;
  DType params_dtype = grads_dtype;
  if (params.has_value()) {
    check_flat(op, "params", *params, master);
    params_dtype = kernel_dtype(op, "params", *params);
    params_data = params->data_ptr();
  }
  check_scalar(op, "step", step, master);
  const float* grad_multiplier_data = optional_scalar(op, "grad_multiplier", grad_multiplier,
                                                      master);
  const float* found_inf_data = optional_scalar(op, "found_inf", found_inf, master);

  const c10::cuda::CUDAGuard device_guard(master.device());
  check_launch(op, memkern::flat_ops::sgd_step(
                       master.data_ptr<float>(), momentum_buffer_data, grads.data_ptr(),
                       grads_dtype, params_data, params_dtype, master.numel(),
                       step.data_ptr<float>(), grad_multiplier_data, found_inf_data, lr,
                       momentum, dampening, weight_decay, nesterov,
                       c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CUDA, m) {
  m.impl("unscale_", TORCH_FN(unscale_cuda));
  m.impl("l2_norm", TORCH_FN(l2_norm_cuda));
  m.impl("adamw_step_", TORCH_FN(adamw_step_cuda));
  m.impl("sgd_step_", TORCH_FN(sgd_step_cuda));
}
