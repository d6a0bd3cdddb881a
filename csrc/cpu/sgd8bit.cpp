// memkern::sgd8bit_step_ on CPU: SGD with a block-wise 8-bit momentum buffer, one pass per
// block of kQBlock elements (dequantize, update, absmax, requantize). Contract:
// memkern/ops/sgd8bit.py; the SGD math: sgd_math.h; the 8-bit format: state8bit.h.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <type_traits>

#include "../checks.h"
#include "flat_math.h"
#include "sgd_math.h"
#include "state8bit.h"

namespace memkern::cpu {
namespace {

// Dequantize, update and write back n <= kQBlock elements; the new buffer goes to `buf`. (Its
// absmax is a pass of its own, unlike AdamW's: with it in this loop GCC stops unswitching
// sgd_element's run-time branches for bfloat16 and vectorises nothing.)
template <typename grad_t, typename param_t>
MEMKERN_INLINE void update_block(float* __restrict master, const int8_t* __restrict codes,
                                 float scale, const grad_t* __restrict grads,
                                 param_t* __restrict params, const SgdStep& s,
                                 float* __restrict buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float b = dequantize(codes[i], scale);
    const float w = sgd_element(master[i], b, to_float(grads[i]), s);
    buf[i] = b;
    master[i] = w;
    store_param(params, i, w);
  }
}

// SGD's part of update_qblock (state8bit.h): the momentum buffer staged as itself.
template <typename grad_t, typename param_t>
struct Sgd8bitUpdate {
  float* master;
  const int8_t* codes;
  const float* absmax;
  const grad_t* grads;
  param_t* params;
  SgdStep s;

  MEMKERN_INLINE std::array<int32_t, 1> operator()(int64_t b, int64_t begin, int64_t n,
                                                   const std::array<float*, 1>& staged) const {
    update_block(master + begin, codes + begin, absmax[b], grads + begin,
                 params_from(params, begin), s, staged[0], n);
    return {absmax_bits(staged[0], n)};
  }
};

void sgd8bit_step_cpu(at::Tensor& master, at::Tensor& momentum_buffer,
                      at::Tensor& momentum_absmax, const at::Tensor& grads,
                      const std::optional<at::Tensor>& params, at::Tensor& step,
                      const std::optional<at::Tensor>& grad_multiplier,
                      const std::optional<at::Tensor>& found_inf, double lr, double momentum,
                      double dampening, double weight_decay, bool nesterov) {
  check_sgd8bit_step_args(master, momentum_buffer, momentum_absmax, grads, params, step,
                          grad_multiplier, found_inf, momentum, kQBlock);
  if (found_inf_set(found_inf)) return;  // a skipped step writes nothing, not even the step

  const float step_before = read_scalar(step);
  const SgdStep s = sgd_step_coefficients(step_before, grad_multiplier, lr, momentum,
                                          dampening, weight_decay, nesterov);
  with_grad_and_param_data(grads, params, [&](const auto* g, auto* p) {
    using grad_t = std::decay_t<decltype(*g)>;
    using param_t = std::remove_pointer_t<decltype(p)>;
    auto* codes = static_cast<int8_t*>(momentum_buffer.data_ptr());
    float* absmax = momentum_absmax.data_ptr<float>();
    parallel_update_qblocks(
        master.numel(),
        Sgd8bitUpdate<grad_t, param_t>{master.data_ptr<float>(), codes, absmax, g, p, s},
        QMoment<int8_t>{codes, absmax});
  });
  *step.data_ptr<float>() = step_before + 1.0f;
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("sgd8bit_step_", &sgd8bit_step_cpu); }

}  // namespace memkern::cpu
