// memkern::adamw8bit_step_ on CPU: AdamW with block-wise 8-bit moments, one pass per block of
// kQBlock elements (dequantize, update, absmax, requantize). Contract and quantization map:
// memkern/ops/adamw8bit.py; the AdamW math: adamw_math.h; the 8-bit format: state8bit.h.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../checks.h"
#include "adamw_math.h"
#include "flat_math.h"
#include "state8bit.h"

namespace memkern::cpu {
namespace {

// Dequantize, update and write back n <= kQBlock elements into m, v and sqrt_v. kLerpFromEnd is
// c.lerp_from_end fixed at compile time: GCC vectorises this loop only without the run-time
// select, which it does not hoist out of a loop this large by itself.
template <bool kLerpFromEnd, typename grad_t, typename param_t>
MEMKERN_INLINE void update_block(float* __restrict master, const int8_t* __restrict m_codes,
                                 const uint8_t* __restrict v_codes, float m_scale,
                                 float v_scale, const grad_t* __restrict grads,
                                 param_t* __restrict params, AdamWCoefficients c,
                                 float* __restrict m, float* __restrict v,
                                 float* __restrict sqrt_v, int64_t n) {
  c.lerp_from_end = kLerpFromEnd;
  for (int64_t i = 0; i < n; ++i) {
    float mi = dequantize(m_codes[i], m_scale);
    float vi = dequantize(v_codes[i], v_scale);
    const float w = adamw_element(master[i], mi, vi, to_float(grads[i]), c);
    m[i] = mi;
    v[i] = vi;
    sqrt_v[i] = std::sqrt(vi);  // the root adamw_element took (the compiler computes it once)
    master[i] = w;
    store_param(params, i, w);
  }
}

// One quantization block of n <= kQBlock elements from `begin`; a constant n makes every loop
// a fixed-size one, which vectorises without a tail.
template <bool kLerpFromEnd, typename grad_t, typename param_t>
MEMKERN_INLINE void adamw8bit_block(float* __restrict master, int8_t* __restrict m_codes,
                                    float* __restrict m_absmax, uint8_t* __restrict v_codes,
                                    float* __restrict v_absmax, const grad_t* __restrict grads,
                                    param_t* __restrict params, const AdamWCoefficients& c,
                                    int64_t b, int64_t n) {
  alignas(64) float m[kQBlock];
  alignas(64) float v[kQBlock];
  alignas(64) float sqrt_v[kQBlock];
  const int64_t begin = b * kQBlock;
  param_t* p = nullptr;
  if constexpr (!std::is_same_v<param_t, NoParams>) p = params + begin;
  update_block<kLerpFromEnd>(master + begin, m_codes + begin, v_codes + begin, m_absmax[b],
                             v_absmax[b], grads + begin, p, c, m, v, sqrt_v, n);
  quantize_block(m, n, m_codes + begin, m_absmax + b);
  quantize_block(v, sqrt_v, n, v_codes + begin, v_absmax + b);
}

// The blocks [first, last) of an n-element buffer.
template <bool kLerpFromEnd, typename grad_t, typename param_t>
MEMKERN_VECTOR_CLONES void adamw8bit_blocks(float* __restrict master, int8_t* __restrict m_codes,
                                            float* __restrict m_absmax,
                                            uint8_t* __restrict v_codes,
                                            float* __restrict v_absmax,
                                            const grad_t* __restrict grads,
                                            param_t* __restrict params, AdamWCoefficients c,
                                            int64_t n, int64_t first, int64_t last) {
  const int64_t full = n / kQBlock < last ? n / kQBlock : last;
  for (int64_t b = first; b < full; ++b) {
    adamw8bit_block<kLerpFromEnd>(master, m_codes, m_absmax, v_codes, v_absmax, grads, params,
                                  c, b, kQBlock);
  }
  if (full < last) {  // the buffer's last, partial block
    adamw8bit_block<kLerpFromEnd>(master, m_codes, m_absmax, v_codes, v_absmax, grads, params,
                                  c, full, n - full * kQBlock);
  }
}

void adamw8bit_step_cpu(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_absmax,
                        at::Tensor& exp_avg_sq, at::Tensor& exp_avg_sq_absmax,
                        const at::Tensor& grads, const std::optional<at::Tensor>& params,
                        at::Tensor& step, const std::optional<at::Tensor>& grad_multiplier,
                        const std::optional<at::Tensor>& found_inf, double lr, double beta1,
                        double beta2, double eps, double weight_decay) {
  constexpr const char* op = "adamw8bit_step_";
  check_step_args(op, master, grads, params, step, grad_multiplier, found_inf);
  memkern::check_codes(op, "exp_avg", exp_avg, at::kChar, "exp_avg_absmax", exp_avg_absmax,
                       master, kQBlock);
  memkern::check_codes(op, "exp_avg_sq", exp_avg_sq, at::kByte, "exp_avg_sq_absmax",
                       exp_avg_sq_absmax, master, kQBlock);
  if (found_inf_set(found_inf)) return;  // a skipped step writes nothing, not even the step

  const double t = static_cast<double>(read_scalar(step)) + 1.0;
  const AdamWCoefficients c =
      adamw_coefficients(t, grad_multiplier, lr, beta1, beta2, eps, weight_decay);
  const int64_t n = master.numel();
  const int64_t blocks = (n + kQBlock - 1) / kQBlock;

  std::optional<at::ScalarType> param_dtype;
  if (params.has_value()) param_dtype = params->scalar_type();
  dispatch_grad_and_param(grads.scalar_type(), param_dtype, [&](auto grad_tag, auto param_tag) {
    using grad_t = decltype(grad_tag);
    using param_t = decltype(param_tag);
    float* w = master.data_ptr<float>();
    auto* m_codes = static_cast<int8_t*>(exp_avg.data_ptr());
    auto* v_codes = static_cast<uint8_t*>(exp_avg_sq.data_ptr());
    float* m_absmax = exp_avg_absmax.data_ptr<float>();
    float* v_absmax = exp_avg_sq_absmax.data_ptr<float>();
    const auto* g = static_cast<const grad_t*>(grads.const_data_ptr());
    auto* p = data_or_null<param_t>(params);
    at::parallel_for(0, blocks, kGrain / kQBlock, [&](int64_t first, int64_t last) {
      if (c.lerp_from_end) {
        adamw8bit_blocks<true>(w, m_codes, m_absmax, v_codes, v_absmax, g, p, c, n, first, last);
      } else {
        adamw8bit_blocks<false>(w, m_codes, m_absmax, v_codes, v_absmax, g, p, c, n, first, last);
      }
    });
  });
  *step.data_ptr<float>() = static_cast<float>(t);
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("adamw8bit_step_", &adamw8bit_step_cpu); }

}  // namespace memkern::cpu
