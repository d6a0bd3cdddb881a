// memkern::sgd_step_ on CPU: the SGD math of the CPU backend lives in sgd_math.h.
// Contract: memkern/ops/sgd.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../checks.h"
#include "flat_math.h"
#include "sgd_math.h"

namespace memkern::cpu {
namespace {

// torch.optim.SGD's update of n elements, in float32; params gets round(master).
template <typename grad_t, typename param_t>
MEMKERN_VECTOR_CLONES void sgd_block(float* __restrict master, float* __restrict momentum_buffer,
                                     const grad_t* __restrict grads, param_t* __restrict params,
                                     SgdStep s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float buf = s.c.use_momentum ? momentum_buffer[i] : 0.0f;
    const float w = sgd_element(master[i], buf, to_float(grads[i]), s);
    if (s.c.use_momentum) momentum_buffer[i] = buf;
    master[i] = w;
    store_param(params, i, w);
  }
}

void sgd_step_cpu(at::Tensor& master, const std::optional<at::Tensor>& momentum_buffer,
                  const at::Tensor& grads, const std::optional<at::Tensor>& params,
                  at::Tensor& step, const std::optional<at::Tensor>& grad_multiplier,
                  const std::optional<at::Tensor>& found_inf, double lr, double momentum,
                  double dampening, double weight_decay, bool nesterov) {
  constexpr const char* op = "sgd_step_";
  check_step_args(op, master, grads, params, step, grad_multiplier, found_inf);
  check_momentum_buffer(op, momentum, momentum_buffer, master);
  const bool use_momentum = momentum != 0.0;
  if (found_inf_set(found_inf)) return;  // a skipped step writes nothing, not even the step

  const float step_before = read_scalar(step);
  const SgdStep s = sgd_step_coefficients(step_before, grad_multiplier, lr, momentum,
                                          dampening, weight_decay, nesterov);

  with_grad_and_param_data(grads, params, [&](const auto* g, auto* p) {
    float* w = master.data_ptr<float>();
    float* buf = use_momentum ? momentum_buffer->data_ptr<float>() : nullptr;
    parallel_blocks(master.numel(), [&](int64_t begin, int64_t end) {
      sgd_block(w + begin, buf == nullptr ? nullptr : buf + begin, g + begin,
                params_from(p, begin), s, end - begin);
    });
  });
  *step.data_ptr<float>() = step_before + 1.0f;
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("sgd_step_", &sgd_step_cpu); }

}  // namespace memkern::cpu
