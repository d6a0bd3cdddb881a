// memkern::adamw8bit_step_ on CPU: AdamW with block-wise 8-bit moments, one pass per block of
// kQBlock elements (dequantize, update, absmax, requantize). Contract and quantization map:
// memkern/ops/adamw8bit.py; the AdamW math: adamw_math.h; the 8-bit format: state8bit.h.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../checks.h"
#include "adamw_math.h"
#include "flat_math.h"
#include "state8bit.h"

namespace memkern::cpu {
namespace {

// Dequantize, update and write back n <= kQBlock elements into m and sqrt_v (the inputs of the
// codes); returns the largest abs_bits of m and of v. Two loops, the moments then the master:
// one loop does the same work, but its chain of dependent instructions (dequantization,
// moments, root, division, 16-bit rounding) is longer than the core's out-of-order window can
// overlap: on one thread of the AMD EPYC host, in cache, the op took 1.85 ns per element with
// bfloat16 params against 1.65 for the two loops (fp32 1.48 against 1.44). kLerpFromEnd is
// c.lerp_end_mask fixed at compile time: GCC vectorises these loops only without the run-time
// select, which it does not hoist out of a loop this large by itself.
template <bool kLerpFromEnd, typename grad_t, typename param_t>
MEMKERN_INLINE std::array<int32_t, 2> update_block(float* __restrict master,
                                                   const int8_t* __restrict m_codes,
                                                   const uint8_t* __restrict v_codes,
                                                   float m_scale, float v_scale,
                                                   const grad_t* __restrict grads,
                                                   param_t* __restrict params,
                                                   AdamWCoefficients c, float* __restrict m,
                                                   float* __restrict sqrt_v, int64_t n) {
  c.lerp_end_mask = kLerpFromEnd ? ~0u : 0u;
  int32_t m_bits = 0;
  int32_t v_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    float mi = dequantize(m_codes[i], m_scale);
    float vi = dequantize(v_codes[i], v_scale);
    adamw_moments(mi, vi, to_float(grads[i]), c);
    m[i] = mi;
    sqrt_v[i] = std::sqrt(vi);
    m_bits = abs_bits(mi) > m_bits ? abs_bits(mi) : m_bits;
    v_bits = abs_bits(vi) > v_bits ? abs_bits(vi) : v_bits;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float w = adamw_master(master[i], m[i], sqrt_v[i], c);
    master[i] = w;
    store_param(params, i, w);
  }
  return {m_bits, v_bits};
}

// AdamW's part of update_qblock (state8bit.h): m staged as itself, v as its root.
template <bool kLerpFromEnd, typename grad_t, typename param_t>
struct AdamW8bitUpdate {
  float* master;
  const int8_t* m_codes;
  const float* m_absmax;
  const uint8_t* v_codes;
  const float* v_absmax;
  const grad_t* grads;
  param_t* params;
  AdamWCoefficients c;

  MEMKERN_INLINE std::array<int32_t, 2> operator()(int64_t b, int64_t begin, int64_t n,
                                                   const std::array<float*, 2>& staged) const {
    return update_block<kLerpFromEnd>(master + begin, m_codes + begin, v_codes + begin,
                                      m_absmax[b], v_absmax[b], grads + begin,
                                      params_from(params, begin), c, staged[0], staged[1], n);
  }
};

void adamw8bit_step_cpu(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_absmax,
                        at::Tensor& exp_avg_sq, at::Tensor& exp_avg_sq_absmax,
                        const at::Tensor& grads, const std::optional<at::Tensor>& params,
                        at::Tensor& step, const std::optional<at::Tensor>& grad_multiplier,
                        const std::optional<at::Tensor>& found_inf, double lr, double beta1,
                        double beta2, double eps, double weight_decay) {
  check_adamw8bit_step_args(master, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                            grads, params, step, grad_multiplier, found_inf, kQBlock);
  if (found_inf_set(found_inf)) return;  // a skipped step writes nothing, not even the step

  const double t = static_cast<double>(read_scalar(step)) + 1.0;
  const AdamWCoefficients c =
      adamw_coefficients(t, grad_multiplier, lr, beta1, beta2, eps, weight_decay);
  with_grad_and_param_data(grads, params, [&](const auto* g, auto* p) {
    using grad_t = std::decay_t<decltype(*g)>;
    using param_t = std::remove_pointer_t<decltype(p)>;
    const auto run = [&](auto lerp_from_end) {
      auto* m_codes = static_cast<int8_t*>(exp_avg.data_ptr());
      auto* v_codes = static_cast<uint8_t*>(exp_avg_sq.data_ptr());
      float* m_absmax = exp_avg_absmax.data_ptr<float>();
      float* v_absmax = exp_avg_sq_absmax.data_ptr<float>();
      parallel_update_qblocks(
          master.numel(),
          AdamW8bitUpdate<decltype(lerp_from_end)::value, grad_t, param_t>{
              master.data_ptr<float>(), m_codes, m_absmax, v_codes, v_absmax, g, p, c},
          QMoment<int8_t>{m_codes, m_absmax}, QMoment<uint8_t>{v_codes, v_absmax});
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

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("adamw8bit_step_", &adamw8bit_step_cpu); }

}  // namespace memkern::cpu
