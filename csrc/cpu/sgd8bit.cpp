// memkern::sgd8bit_step_ on CPU: SGD with a block-wise 8-bit momentum buffer, one pass per
// block of kQBlock elements (dequantize, update, absmax, requantize). Contract:
// memkern/ops/sgd8bit.py; the SGD math: sgd_math.h; the 8-bit format: state8bit.h.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "../checks.h"
#include "flat_math.h"
#include "sgd_math.h"
#include "state8bit.h"

namespace memkern::cpu {
namespace {

// Dequantize, update and write back n <= kQBlock elements; the new buffer goes to `buf`.
template <typename grad_t, typename param_t>
MEMKERN_INLINE void update_block(float* __restrict master, const int8_t* __restrict codes,
                                 float scale, const grad_t* __restrict grads,
                                 param_t* __restrict params, const SgdCoefficients& c,
                                 float* __restrict buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float b = dequantize(codes[i], scale);
    const float w = sgd_element(master[i], b, to_float(grads[i]), c);
    buf[i] = b;
    master[i] = w;
    store_param(params, i, w);
  }
}

// The blocks [first, last) of an n-element buffer.
template <typename grad_t, typename param_t>
MEMKERN_VECTOR_CLONES void sgd8bit_blocks(float* __restrict master, int8_t* __restrict codes,
                                          float* __restrict absmax,
                                          const grad_t* __restrict grads,
                                          param_t* __restrict params, SgdCoefficients c,
                                          int64_t n, int64_t first, int64_t last) {
  float buf[kQBlock];
  for (int64_t b = first; b < last; ++b) {
    const int64_t begin = b * kQBlock;
    param_t* p = nullptr;
    if constexpr (!std::is_same_v<param_t, NoParams>) p = params + begin;
    // A constant trip count for the full blocks: their loops vectorise without a tail.
    const int64_t len = n - begin >= kQBlock ? kQBlock : n - begin;
    if (len == kQBlock) {
      update_block(master + begin, codes + begin, absmax[b], grads + begin, p, c, buf, kQBlock);
      quantize_block(buf, kQBlock, codes + begin, absmax + b);
    } else {
      update_block(master + begin, codes + begin, absmax[b], grads + begin, p, c, buf, len);
      quantize_block(buf, len, codes + begin, absmax + b);
    }
  }
}

void sgd8bit_step_cpu(at::Tensor& master, at::Tensor& momentum_buffer,
                      at::Tensor& momentum_absmax, const at::Tensor& grads,
                      const std::optional<at::Tensor>& params, at::Tensor& step,
                      const std::optional<at::Tensor>& grad_multiplier,
                      const std::optional<at::Tensor>& found_inf, double lr, double momentum,
                      double dampening, double weight_decay, bool nesterov) {
  constexpr const char* op = "sgd8bit_step_";
  check_step_args(op, master, grads, params, step, grad_multiplier, found_inf);
  TORCH_CHECK(momentum > 0.0, "memkern.", op, ": momentum must be > 0, got ", momentum,
              "; without momentum SGD keeps no state: use sgd_step_ without a momentum_buffer");
  memkern::check_codes(op, "momentum_buffer", momentum_buffer, at::kChar, "momentum_absmax",
                       momentum_absmax, master, kQBlock);
  if (found_inf_set(found_inf)) return;  // a skipped step writes nothing, not even the step

  const float step_before = read_scalar(step);
  const SgdCoefficients c = sgd_coefficients(step_before, grad_multiplier, lr, momentum,
                                             dampening, weight_decay, nesterov);
  const int64_t n = master.numel();
  const int64_t blocks = (n + kQBlock - 1) / kQBlock;

  std::optional<at::ScalarType> param_dtype;
  if (params.has_value()) param_dtype = params->scalar_type();
  dispatch_grad_and_param(grads.scalar_type(), param_dtype, [&](auto grad_tag, auto param_tag) {
    using grad_t = decltype(grad_tag);
    using param_t = decltype(param_tag);
    float* w = master.data_ptr<float>();
    auto* codes = static_cast<int8_t*>(momentum_buffer.data_ptr());
    float* absmax = momentum_absmax.data_ptr<float>();
    const auto* g = static_cast<const grad_t*>(grads.const_data_ptr());
    auto* p = data_or_null<param_t>(params);
    at::parallel_for(0, blocks, kGrain / kQBlock, [&](int64_t first, int64_t last) {
      sgd8bit_blocks(w, codes, absmax, g, p, c, n, first, last);
    });
  });
  *step.data_ptr<float>() = step_before + 1.0f;
}

}  // namespace

TORCH_LIBRARY_IMPL(memkern, CPU, m) { m.impl("sgd8bit_step_", &sgd8bit_step_cpu); }

}  // namespace memkern::cpu
