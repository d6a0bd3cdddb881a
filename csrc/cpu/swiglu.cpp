// memkern::swiglu_forward / memkern::swiglu_backward on CPU: h = silu(gate) * up and its
// gradient, each one pass over the elements in float32 (float64 for float64 inputs), rounded
// once into the inputs' dtype. Contract and formulas: memkern/ops/swiglu.py; the per-element
// math is shared with the CUDA kernels (csrc/cuda/kernels/swiglu_math.h).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <tuple>

#include "../cuda/kernels/swiglu_math.h"
#include "../layer_checks.h"
#include "flat_math.h"

namespace memkern::cpu {
namespace {

at::Tensor swiglu_forward_cpu(const at::Tensor& gate, const at::Tensor& up) {
  check_like_gate("swiglu_forward", "up", up, gate);
  const at::Tensor a = gate.contiguous(), b = up.contiguous();
  at::Tensor h = at::empty_like(a);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "swiglu_forward",
                                  [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.const_data_ptr<scalar_t>();
    scalar_t* hp = h.data_ptr<scalar_t>();
    parallel_blocks(a.numel(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        hp[i] = narrow<scalar_t>(math::swiglu<acc_t>(widen(ap[i]), widen(bp[i])));
      }
    });
  });
  return h;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad,
                                                       const at::Tensor& gate,
                                                       const at::Tensor& up) {
  check_like_gate("swiglu_backward", "up", up, gate);
  check_like_gate("swiglu_backward", "grad", grad, gate);
  const at::Tensor g = grad.contiguous(), a = gate.contiguous(), b = up.contiguous();
  at::Tensor grad_gate = at::empty_like(a), grad_up = at::empty_like(b);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "swiglu_backward",
                                  [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.const_data_ptr<scalar_t>();
    scalar_t* dap = grad_gate.data_ptr<scalar_t>();
    scalar_t* dbp = grad_up.data_ptr<scalar_t>();
    parallel_blocks(a.numel(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const math::SwigluGrad<acc_t> d =
            math::swiglu_grad<acc_t>(widen(gp[i]), widen(ap[i]), widen(bp[i]));
        dap[i] = narrow<scalar_t>(d.gate);
        dbp[i] = narrow<scalar_t>(d.up);
      }
    });
  });
  return {grad_gate, grad_up};
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) {
  m.impl("swiglu_forward", &swiglu_forward_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}

}  // namespace memkern::cpu
