// memkern::swiglu_forward / memkern::swiglu_backward on CPU: h = silu(gate) * up and its
// gradient, each one pass over the elements in float32 (float64 for float64 inputs), rounded
// once into the inputs' dtype. Contract and formulas: memkern/ops/swiglu.py.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "flat_math.h"

namespace memkern::cpu {
namespace {

void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& gate) {
  TORCH_CHECK(t.sizes() == gate.sizes() && t.scalar_type() == gate.scalar_type(), "memkern.",
              op, ": ", name, " has shape ", t.sizes(), " and dtype ", t.scalar_type(),
              "; expected gate's ", gate.sizes(), " and ", gate.scalar_type());
}

at::Tensor swiglu_forward_cpu(const at::Tensor& gate, const at::Tensor& up) {
  check_like("swiglu_forward", "up", up, gate);
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
        const acc_t x = widen(ap[i]);
        hp[i] = narrow<scalar_t>(x / (acc_t(1) + std::exp(-x)) * widen(bp[i]));
      }
    });
  });
  return h;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad,
                                                       const at::Tensor& gate,
                                                       const at::Tensor& up) {
  check_like("swiglu_backward", "up", up, gate);
  check_like("swiglu_backward", "grad", grad, gate);
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
        const acc_t dh = widen(gp[i]), x = widen(ap[i]), u = widen(bp[i]);
        const acc_t s = acc_t(1) / (acc_t(1) + std::exp(-x));
        dbp[i] = narrow<scalar_t>(dh * x * s);
        dap[i] = narrow<scalar_t>(dh * u * s * (acc_t(1) + x * (acc_t(1) - s)));
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
