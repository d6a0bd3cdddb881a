// Argument checks shared by the CPU and CUDA kernels of the flat-buffer ops. Each message
// names the argument, says what was wrong and what to do; the Python entries check the same
// first, so these guard direct calls of torch.ops.memkern.*.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace memkern {

// A contiguous 1-D buffer with as many elements as `like`, on its device.
inline void check_flat(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "memkern.", op, ": ", name,
              " must be a contiguous 1-D flat buffer, got shape ", t.sizes(), " (contiguous=",
              t.is_contiguous() ? "True" : "False", "); pass a flat view, e.g. t.view(-1)");
  TORCH_CHECK(t.device() == like.device(), "memkern.", op, ": ", name, " is on ", t.device(),
              " but the other buffers are on ", like.device(), "; move them to one device");
  TORCH_CHECK(t.numel() == like.numel(), "memkern.", op, ": ", name, " has ", t.numel(),
              " elements but the buffers it goes with have ", like.numel(),
              "; all flat buffers of one call must be the same length");
}

// Gradients and model parameters: float32, bfloat16 or float16.
inline void check_float_kind(const char* op, const char* name, const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "memkern.",
              op, ": ", name, " has dtype ", dtype,
              "; the compiled kernels take float32, bfloat16 or float16 (float64 runs only on "
              "the reference backend, MEMKERN_BACKEND=reference)");
}

// Master weights and optimizer state: a flat float32 buffer like `like`.
inline void check_float32_state(const char* op, const char* name, const at::Tensor& t,
                                const at::Tensor& like) {
  check_flat(op, name, t, like);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "memkern.", op, ": ", name, " has dtype ",
              t.scalar_type(), "; the compiled kernels keep master weights and optimizer state "
              "in float32 only (float64 state runs only on the reference backend, "
              "MEMKERN_BACKEND=reference)");
}

// A one-element float32 tensor on the buffers' device, read by the kernels.
inline void check_scalar(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& like) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat, "memkern.", op, ": ", name,
              " must be a one-element float32 tensor on ", like.device(), ", got ",
              t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), "memkern.", op, ": ", name, " is on ", t.device(),
              ", the buffers on ", like.device(), "; keep it on the buffers' device (reading "
              "it from elsewhere would force a host sync)");
}

inline void check_scalar(const char* op, const char* name, const std::optional<at::Tensor>& t,
                         const at::Tensor& like) {
  if (t.has_value()) check_scalar(op, name, *t, like);
}

// The arguments every optimizer-step op shares: float32 master weights, gradients and the
// optional low-precision parameter copy of the same length, and the three device scalars.
inline void check_step_args(const char* op, const at::Tensor& master, const at::Tensor& grads,
                            const std::optional<at::Tensor>& params, const at::Tensor& step,
                            const std::optional<at::Tensor>& grad_multiplier,
                            const std::optional<at::Tensor>& found_inf) {
  check_float32_state(op, "master", master, master);
  check_flat(op, "grads", grads, master);
  check_float_kind(op, "grads", grads);
  if (params.has_value()) {
    check_flat(op, "params", *params, master);
    check_float_kind(op, "params", *params);
  }
  check_scalar(op, "step", step, master);
  check_scalar(op, "grad_multiplier", grad_multiplier, master);
  check_scalar(op, "found_inf", found_inf, master);
}

// 8-bit optimizer state (memkern/ops/adamw8bit.py): codes of `dtype` like `master`, and one
// float32 absmax per block of `block` elements on its device.
inline void check_codes(const char* op, const char* name, const at::Tensor& codes,
                        at::ScalarType dtype, const char* absmax_name, const at::Tensor& absmax,
                        const at::Tensor& master, int64_t block) {
  check_flat(op, name, codes, master);
  TORCH_CHECK(codes.scalar_type() == dtype, "memkern.", op, ": ", name, " has dtype ",
              codes.scalar_type(), "; expected ", dtype);
  const int64_t blocks = (master.numel() + block - 1) / block;
  TORCH_CHECK(absmax.dim() == 1 && absmax.is_contiguous() && absmax.numel() == blocks &&
                  absmax.scalar_type() == at::kFloat && absmax.device() == master.device(),
              "memkern.", op, ": ", absmax_name, " must be a contiguous float32 buffer of ",
              blocks, " elements (one per block of ", block, ") on ", master.device(), ", got ",
              absmax.scalar_type(), " of shape ", absmax.sizes(), " on ", absmax.device());
}

// The tensor arguments of memkern::adamw8bit_step_ (memkern/ops/adamw8bit.py), with `block`
// elements per quantization block.
inline void check_adamw8bit_step_args(const at::Tensor& master, const at::Tensor& exp_avg,
                                      const at::Tensor& exp_avg_absmax,
                                      const at::Tensor& exp_avg_sq,
                                      const at::Tensor& exp_avg_sq_absmax,
                                      const at::Tensor& grads,
                                      const std::optional<at::Tensor>& params,
                                      const at::Tensor& step,
                                      const std::optional<at::Tensor>& grad_multiplier,
                                      const std::optional<at::Tensor>& found_inf, int64_t block) {
  constexpr const char* op = "adamw8bit_step_";
  check_step_args(op, master, grads, params, step, grad_multiplier, found_inf);
  check_codes(op, "exp_avg", exp_avg, at::kChar, "exp_avg_absmax", exp_avg_absmax, master,
              block);
  check_codes(op, "exp_avg_sq", exp_avg_sq, at::kByte, "exp_avg_sq_absmax", exp_avg_sq_absmax,
              master, block);
}

// The tensor arguments and the momentum of memkern::sgd8bit_step_ (memkern/ops/sgd8bit.py),
// with `block` elements per quantization block.
inline void check_sgd8bit_step_args(const at::Tensor& master, const at::Tensor& momentum_buffer,
                                    const at::Tensor& momentum_absmax, const at::Tensor& grads,
                                    const std::optional<at::Tensor>& params,
                                    const at::Tensor& step,
                                    const std::optional<at::Tensor>& grad_multiplier,
                                    const std::optional<at::Tensor>& found_inf, double momentum,
                                    int64_t block) {
  constexpr const char* op = "sgd8bit_step_";
  check_step_args(op, master, grads, params, step, grad_multiplier, found_inf);
  TORCH_CHECK(momentum > 0.0, "memkern.", op, ": momentum must be > 0, got ", momentum,
              "; without momentum SGD keeps no state: use sgd_step_ without a momentum_buffer");
  check_codes(op, "momentum_buffer", momentum_buffer, at::kChar, "momentum_absmax",
              momentum_absmax, master, block);
}

// SGD's momentum buffer: required (float32, like master) when momentum != 0, unused otherwise.
inline void check_momentum_buffer(const char* op, double momentum,
                                  const std::optional<at::Tensor>& momentum_buffer,
                                  const at::Tensor& master) {
  if (momentum == 0.0) return;
  TORCH_CHECK(momentum_buffer.has_value(), "memkern.", op, ": momentum=", momentum,
              " needs a momentum_buffer");
  check_float32_state(op, "momentum_buffer", *momentum_buffer, master);
}

}  // namespace memkern
