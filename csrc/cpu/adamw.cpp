// memkern::adamw_step_ on CPU: the loop over float32 state (the math: adamw_math.h).
// Contract: memkern/ops/adamw.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "../checks.h"
#include "adamw_math.h"
#include "flat_math.h"

namespace memkern::cpu {
namespace {

// torch.optim.AdamW's update of n elements, in float32; params gets round(master).
// kLerpFromEnd is c.lerp_end_mask fixed at compile time: with the run-time select GCC leaves
// the 16-bit instantiations unvectorised ("control flow in loop").
template <bool kLerpFromEnd, typename grad_t, typename param_t>
MEMKERN_VECTOR_CLONES void adamw_block(float* __restrict master, float* __restrict exp_avg,
                                       float* __restrict exp_avg_sq,
                                       const grad_t* __restrict grads,
                                       param_t* __restrict params, AdamWCoefficients c,
                                       int64_t n) {
  c.lerp_end_mask = kLerpFromEnd ? ~0u : 0u;
  for (int64_t i = 0; i < n; ++i) {
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    const float w = adamw_element(master[i], m, v, to_float(grads[i]), c);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    master[i] = w;
    store_param(params, i, w);
  }
}

void adamw_step_cpu(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                    const at::Tensor& grads, const std::optional<at::Tensor>& params,
                    at::Tensor& step, const std::optional<at::Tensor>& grad_multiplier,
                    const std::optional<at::Tensor>& found_inf, double lr, double beta1,
                    double beta2, double eps, double weight_decay) {
  constexpr const char* op = "adamw_step_";
  check_step_args(op, master, grads, params, step, grad_multiplier, found_inf);
  check_float32_state(op, "exp_avg", exp_avg, master);
  check_float32_state(op, "exp_avg_sq", exp_avg_sq, master);
  if (found_inf_set(found_inf)) return;  // a skipped step writes nothing, not even the step

  const double t = static_cast<double>(read_scalar(step)) + 1.0;
  const AdamWCoefficients c =
      adamw_coefficients(t, grad_multiplier, lr, beta1, beta2, eps, weight_decay);

  with_grad_and_param_data(grads, params, [&](const auto* g, auto* p) {
    float* m = master.data_ptr<float>();
    float* avg = exp_avg.data_ptr<float>();
    float* avg_sq = exp_avg_sq.data_ptr<float>();
    const auto run = [&](auto lerp_from_end) {
      parallel_blocks(master.numel(), [&](int64_t begin, int64_t end) {
        adamw_block<decltype(lerp_from_end)::value>(m + begin, avg + begin, avg_sq + begin,
                                                    g + begin, params_from(p, begin), c,
                                                    end - begin);
      });
    };
    if (c.lerp_end_mask != 0) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
  *step.data_ptr<float>() = static_cast<float>(t);
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("adamw_step_", &adamw_step_cpu); }

}  // namespace memkern::cpu
