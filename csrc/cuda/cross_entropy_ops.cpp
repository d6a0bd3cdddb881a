// The CUDA kernels of memkern::cross_entropy_rows_ and memkern::cross_entropy_block_grad_,
// registered for the CUDA dispatch key from C++ (a translation unit of its own beside
// bindings.cpp): check the tensors, pick the device and stream, call the torch-free launchers of
// cross_entropy_launch.h. Targets are not range-checked here (that would read them on the
// host); the kernels never use an out-of-range one as an index. Contracts:
// memkern/ops/cross_entropy.py.
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../cross_entropy_checks.h"
#include "cross_entropy_launch.h"

namespace {

namespace checks = memkern::cross_entropy_checks;
namespace launch = memkern::cross_entropy_launch;

memkern::DType logits_type(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kBFloat16: return memkern::DType::bf16;
    case at::kHalf: return memkern::DType::f16;
    case at::kDouble: return memkern::DType::f64;
    default: return memkern::DType::f32;  // checks::logits accepted nothing else
  }
}

void check_launch(const char* op, cudaError_t status) {
  TORCH_CHECK(status == cudaSuccess, op, ": CUDA kernel launch failed: ",
              cudaGetErrorString(status));
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_cuda(
    at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& row_scale,
    int64_t ignore_index, double label_smoothing, bool compute_grad, double softcap,
    int64_t outputs, const std::optional<at::Tensor>& stats) {
  const bool scaled = checks::rows_op(logits, target, row_scale, label_smoothing, softcap);
  checks::row_stats(checks::kRowsOp, outputs, stats, logits);
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const int64_t n = logits.size(0);
  const at::TensorOptions acc = logits.options().dtype(checks::acc_dtype(logits));
  at::Tensor loss = at::empty({n}, acc), lse = at::empty({n}, acc);
  check_launch(checks::kRowsOp,
               launch::rows(logits.data_ptr(), logits_type(logits), n, logits.size(1),
                            target.const_data_ptr<int64_t>(),
                            scaled ? row_scale->const_data_ptr() : nullptr, loss.data_ptr(),
                            lse.data_ptr(), ignore_index, label_smoothing, softcap,
                            compute_grad, static_cast<int>(outputs),
                            outputs != 0 ? stats->data_ptr() : nullptr,
                            outputs != 0 ? stats->stride(0) : 0,
                            c10::cuda::getCurrentCUDAStream()));
  return {loss, lse};
}

void cross_entropy_block_grad_cuda(at::Tensor& logits, const at::Tensor& lse,
                                   const at::Tensor& target, const at::Tensor& row_scale,
                                   int64_t class_offset, int64_t num_classes,
                                   int64_t ignore_index, double label_smoothing,
                                   double softcap, const std::optional<at::Tensor>& entropy,
                                   const std::optional<at::Tensor>& entropy_scale) {
  const bool with_entropy = checks::block_grad_op(logits, lse, target, row_scale, class_offset,
                                                  num_classes, label_smoothing, softcap,
                                                  entropy, entropy_scale);
  const c10::cuda::CUDAGuard device_guard(logits.device());
  check_launch(checks::kBlockGradOp,
               launch::block_grad(logits.data_ptr(), logits_type(logits), logits.size(0),
                                  logits.size(1), lse.const_data_ptr(),
                                  target.const_data_ptr<int64_t>(), row_scale.const_data_ptr(),
                                  row_scale.stride(0), class_offset, num_classes, ignore_index,
                                  label_smoothing, softcap,
                                  with_entropy ? entropy->const_data_ptr() : nullptr,
                                  with_entropy ? entropy_scale->const_data_ptr() : nullptr,
                                  with_entropy ? entropy_scale->stride(0) : 0,
                                  c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CUDA, m) {
  m.impl("cross_entropy_rows_", TORCH_FN(cross_entropy_rows_cuda));
  m.impl("cross_entropy_block_grad_", TORCH_FN(cross_entropy_block_grad_cuda));
}
