// The CUDA kernels of memkern::norm_forward / norm_backward (LayerNorm, RMSNorm), registered for
// the CUDA dispatch key: check the tensors (the CPU kernels' checks: ../layer_checks.h), bring
// the weight and bias to a dtype the kernels take, allocate the outputs with torch's caching
// allocator and call the torch-free launchers of norm_launch.h on the current stream.
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../layer_checks.h"
#include "norm_launch.h"
#include "ops_common.h"

namespace {

using memkern::DType;
using memkern::cuda_ops::check_launch;
using memkern::cuda_ops::layer_dtype;
using memkern::cuda_ops::stream;
using memkern::cuda_ops::check_cuda;
using OptTensor = std::optional<at::Tensor>;

// The norms' weight and bias as the kernels take them: contiguous, of x's dtype or the math
// type (another dtype, or a weight and bias of different dtypes, are converted to the math
// type: the kernels compute in it anyway). Returns the tensors and their DType.
struct NormParams {
  OptTensor weight, bias;
  DType dtype;
};

NormParams norm_params(const at::Tensor& x, DType x_dtype, const OptTensor& weight,
                       const OptTensor& bias) {
  const auto defined = [](const OptTensor& t) { return t.has_value() && t->defined(); };
  const OptTensor w = defined(weight) ? weight : std::nullopt;
  const OptTensor b = defined(bias) ? bias : std::nullopt;
  const at::ScalarType acc = memkern::layer_acc_type(x);
  const at::ScalarType given = w ? w->scalar_type() : x.scalar_type();
  const bool usable = (given == x.scalar_type() || given == acc) &&
                      (!b || b->scalar_type() == given);
  const at::ScalarType dtype = usable ? given : acc;
  // The common case (a contiguous parameter of the wanted dtype) makes no call at all: on a
  // small layer every dispatcher call is a noticeable share of the host time.
  const auto as = [dtype](const OptTensor& t) -> OptTensor {
    if (!t || (t->scalar_type() == dtype && t->is_contiguous())) return t;
    return t->to(dtype).contiguous();
  };
  const DType acc_dtype = acc == at::kDouble ? DType::f64 : DType::f32;
  return {as(w), as(b), dtype == x.scalar_type() ? x_dtype : acc_dtype};
}

const void* data_or_null(const OptTensor& t) { return t ? t->const_data_ptr() : nullptr; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward_cuda(const at::Tensor& x,
                                                                 const OptTensor& weight,
                                                                 const OptTensor& bias,
                                                                 double eps, bool rms) {
  constexpr const char* op = "norm_forward";
  memkern::check_norm_input(op, x);
  memkern::check_norm_param(op, "weight", weight, x);
  memkern::check_norm_param(op, "bias", bias, x);
  check_cuda(op, "x", x);
  const DType x_dtype = layer_dtype(op, "x", x);
  const c10::cuda::CUDAGuard device_guard(x.device());
  const at::Tensor xc = x.contiguous();
  const NormParams params = norm_params(x, x_dtype, weight, bias);
  const int64_t rows = x.size(0);
  const at::TensorOptions acc = x.options().dtype(memkern::layer_acc_type(x));
  at::Tensor y = at::empty_like(xc);
  at::Tensor mean = at::empty({rms ? 0 : rows}, acc);
  at::Tensor rstd = at::empty({rows}, acc);
  check_launch(op, memkern::layer_ops::norm_forward(
                       xc.const_data_ptr(), x_dtype, data_or_null(params.weight),
                       data_or_null(params.bias), params.dtype, y.data_ptr(),
                       rms ? nullptr : mean.data_ptr(), rstd.data_ptr(), rows, x.size(1), eps,
                       rms, stream()));
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward_cuda(
    const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight, const at::Tensor& mean,
    const at::Tensor& rstd, bool rms) {
  constexpr const char* op = "norm_backward";
  memkern::check_norm_backward_args(dy, x, mean, rstd, rms);
  memkern::check_norm_param(op, "weight", weight, x);
  check_cuda(op, "x", x);
  const DType x_dtype = layer_dtype(op, "x", x);
  const c10::cuda::CUDAGuard device_guard(x.device());
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  const at::Tensor mc = mean.contiguous(), rc = rstd.contiguous();
  const NormParams params = norm_params(x, x_dtype, weight, std::nullopt);
  const int64_t rows = x.size(0), D = x.size(1);
  const at::TensorOptions acc = x.options().dtype(memkern::layer_acc_type(x));
  const int64_t n_grad = params.weight ? D : 0;
  at::Tensor dx = at::empty_like(xc);
  at::Tensor dw = at::empty({n_grad}, acc);
  at::Tensor db = at::empty({n_grad}, acc);
  // Freed on return: the caching allocator hands it to later work on this stream only, which
  // runs after these kernels.
  const at::Tensor workspace =
      at::empty({params.weight ? memkern::layer_ops::norm_backward_workspace(rows, D) : 0}, acc);
  check_launch(op, memkern::layer_ops::norm_backward(
                       dyc.const_data_ptr(), xc.const_data_ptr(), x_dtype,
                       data_or_null(params.weight), params.dtype, rms ? nullptr : mc.const_data_ptr(),
                       rc.const_data_ptr(), dx.data_ptr(), n_grad ? dw.data_ptr() : nullptr,
                       n_grad ? db.data_ptr() : nullptr, workspace.data_ptr(), rows, D, rms,
                       stream()));
  return {dx, dw, db};
}

}  // namespace

// The schemas are defined in memkern/ops/norm.py.
TORCH_LIBRARY_IMPL(memkern, CUDA, m) {
  m.impl("norm_forward", TORCH_FN(norm_forward_cuda));
  m.impl("norm_backward", TORCH_FN(norm_backward_cuda));
}
