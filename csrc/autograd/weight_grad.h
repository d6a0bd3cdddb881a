// The weight gradient of a GEMM layer's C++ autograd (linear.cpp, mlp.cpp, swiglu.cpp), added
// straight into weight.grad when that gives exactly what autograd would.
#pragma once

#include <ATen/ATen.h>

namespace memkern::autograd {

// The gradient a @ b of `weight` (one dtype). When weight.grad can take it in place (see
// accumulable_grad in weight_grad.cpp) it is added there (addmm_, beta = 1: no transient dW)
// and a zero-stride zero is returned, so the weight's AccumulateGrad node and its hooks still
// run — or, when no hook watches that node, an undefined gradient, which the engine passes
// over (it would only add the zero); otherwise a @ b is returned to autograd, as nn.Linear's
// gradient is.
at::Tensor weight_grad(const at::Tensor& weight, const at::Tensor& a, const at::Tensor& b);

}  // namespace memkern::autograd
