// memkern's linear cross-entropy in C++, on every device: the ops
// memkern::linear_cross_entropy_forward / _backward (the twins of forward_impl / backward_impl in
// memkern/ops/linear_cross_entropy.py, ATen call for ATen call, so both give the same bits) and
// memkern::linear_cross_entropy_layer, the layer with its autograd (the twin of
// LinearCrossEntropyFunction in memkern/nn/functional/linear_cross_entropy.py: the same choice
// of algorithm, the same saved tensors), so that a call costs no Python autograd.Function and no
// Python loop. The GEMMs are torch's (cuBLAS on a GPU, 16-bit inputs included: every GEMM writes
// its result once, in the inputs' dtype); the row ops memkern::cross_entropy_rows_ and
// memkern::cross_entropy_block_grad_ are reached through the dispatcher, which picks the C++ CPU
// or the CUDA kernel. What is saved and recomputed: the functional's module docstring.
#include "linear_cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "node.h"

namespace memkern::lce {
namespace {

using at::Tensor;
using torch::autograd::variable_list;

// A positive size from environment variable `name`, or 0 when it is unset or empty.
int64_t env_size(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const long long size = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && *end == '\0' && size >= 1, name, "='", value,
                    "': set it to a positive number of ",
                    std::string(name) == kChunkEnv ? "tokens" : "classes", ", or unset it");
  return size;
}

// `count` rounded down to a multiple of `align` (when at least `align`), in [1, most].
int64_t aligned(int64_t count, int64_t align, int64_t most) {
  if (count >= align) count -= count % align;
  return std::max<int64_t>(1, std::min(count, most));
}

}  // namespace

std::pair<int64_t, int64_t> block_sizes(int64_t n_tokens, int64_t n_classes, int64_t hidden,
                                        int64_t element_size, bool weight_grad, bool split) {
  const int64_t row_bytes = std::max<int64_t>(n_classes, 1) * element_size;
  const int64_t base = std::max(kMinBlockBytes, n_tokens * hidden * element_size);
  const int64_t weight_bytes = weight_grad ? n_classes * hidden * element_size : 0;
  const int64_t forward = split ? base + weight_bytes : std::max(base, weight_bytes);
  int64_t chunk = env_size(kChunkEnv);
  if (chunk == 0) chunk = aligned(forward / row_bytes, kRowAlign, std::max<int64_t>(n_tokens, 1));
  int64_t vocab = env_size(kVocabBlockEnv);
  if (vocab == 0) {
    vocab = aligned(base / (std::max<int64_t>(n_tokens, 1) * element_size), kClassAlign,
                    std::max<int64_t>(n_classes, 1));
  }
  return {chunk, vocab};
}

namespace {

at::ScalarType compute_dtype(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// memkern.nn.functional.linear_cross_entropy.splits.
bool splits(c10::string_view reduction, const Tensor& x) {
  return reduction == "none" || x.scalar_type() == at::kHalf ||
         x.scalar_type() == at::kBFloat16;
}

std::tuple<Tensor, Tensor> rows_op(Tensor& logits, const Tensor& target, int64_t ignore_index,
                                   double label_smoothing, bool compute_grad, double softcap) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::cross_entropy_rows_", "")
          .typed<std::tuple<Tensor, Tensor>(Tensor&, const Tensor&,
                                            const std::optional<Tensor>&, int64_t, double, bool,
                                            double)>();
  return op.call(logits, target, std::nullopt, ignore_index, label_smoothing, compute_grad,
                 softcap);
}

void block_grad_op(Tensor& logits, const Tensor& lse, const Tensor& target,
                   const Tensor& row_scale, int64_t class_offset, int64_t num_classes,
                   int64_t ignore_index, double label_smoothing, double softcap) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::cross_entropy_block_grad_", "")
          .typed<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                      int64_t, double, double)>();
  op.call(logits, lse, target, row_scale, class_offset, num_classes, ignore_index,
          label_smoothing, softcap);
}

// memkern.ops.linear_cross_entropy.forward_impl.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> forward_chunks(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
    const Tensor& target, int64_t ignore_index, double label_smoothing, int64_t chunk_size,
    bool grad_input, bool grad_weight, bool grad_bias, double softcap) {
  const int64_t N = x.size(0), V = weight.size(0);
  const auto cd = compute_dtype(x);
  const bool has_bias = bias.has_value() && bias->defined();
  grad_bias = grad_bias && has_bias;
  const bool compute_grad = grad_input || grad_weight || grad_bias;
  Tensor loss = at::empty({N}, x.options().dtype(cd));
  Tensor lse = at::empty({N}, x.options().dtype(cd));
  Tensor dx = grad_input ? at::empty_like(x) : at::empty({0}, x.options());
  Tensor dw = grad_weight ? at::empty_like(weight) : at::empty({0}, weight.options());
  Tensor db = grad_bias ? at::empty({V}, weight.options()) : at::empty({0}, weight.options());
  if (grad_bias) db.zero_();
  if (grad_weight && N == 0) dw.zero_();
  const int64_t chunk = std::max<int64_t>(1, std::min(chunk_size, N));
  Tensor block = at::empty({chunk, V}, x.options());
  const Tensor wt = weight.t();
  for (int64_t start = 0; start < N; start += chunk) {
    const int64_t rows = std::min(N, start + chunk) - start;
    const Tensor xc = x.narrow(0, start, rows);
    Tensor z = block.narrow(0, 0, rows);
    if (has_bias) {
      at::addmm_out(z, *bias, xc, wt);
    } else {
      at::mm_out(z, xc, wt);
    }
    auto [rows_loss, rows_lse] = rows_op(z, target.narrow(0, start, rows), ignore_index,
                                         label_smoothing, compute_grad, softcap);
    if (rows == N) {  // one chunk for all tokens: no copy
      loss = rows_loss;
      lse = rows_lse;
    } else {
      loss.narrow(0, start, rows).copy_(rows_loss);
      lse.narrow(0, start, rows).copy_(rows_lse);
    }
    if (grad_input) {
      Tensor dxc = dx.narrow(0, start, rows);
      at::mm_out(dxc, z, weight);
    }
    if (grad_weight) {
      if (start == 0) {
        at::mm_out(dw, z.t(), xc);
      } else {
        dw.addmm_(z.t(), xc);
      }
    }
    if (grad_bias) db.add_(z.sum(0, false, cd));
  }
  return {loss, lse, dx, dw, db};
}

// memkern.ops.linear_cross_entropy._float_gemm: a @ b in float32 from float16 a, b.
Tensor float_gemm(const Tensor& a, const Tensor& b) {
  if (a.is_cuda()) return at::mm(a, b, at::kFloat);  // cuBLAS: float32 sums and result
  return at::mm(a.to(at::kFloat), b.to(at::kFloat));  // the CPU has no such GEMM
}

// memkern.ops.linear_cross_entropy.backward_impl.
std::tuple<Tensor, Tensor> backward_blocks(const Tensor& grad_loss, const Tensor& x,
                                           const Tensor& weight,
                                           const std::optional<Tensor>& bias,
                                           const Tensor& target, const Tensor& lse,
                                           int64_t ignore_index, double label_smoothing,
                                           int64_t vocab_block, bool grad_weight, bool grad_bias,
                                           double softcap) {
  const int64_t N = x.size(0), V = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  grad_bias = grad_bias && has_bias;
  Tensor dw = grad_weight ? at::empty_like(weight) : at::empty({0}, weight.options());
  Tensor db = grad_bias ? at::empty_like(*bias) : at::empty({0}, weight.options());
  if (!(grad_weight || grad_bias)) return {dw, db};
  // float16 and one factor: applied to each block's float32 dW, db; else folded into dZ
  const bool scale_after = grad_loss.dim() == 0 && x.scalar_type() == at::kHalf;
  const Tensor row_scale = (scale_after ? at::ones_like(grad_loss) : grad_loss).expand({N});
  const int64_t width = std::max<int64_t>(1, std::min(vocab_block, V));
  const Tensor block = at::empty({N * width}, x.options());  // a narrower last block: contiguous
  for (int64_t c0 = 0; c0 < V; c0 += width) {
    const int64_t cols = std::min(V, c0 + width) - c0;
    Tensor z = block.narrow(0, 0, N * cols).view({N, cols});
    const Tensor wt = weight.narrow(0, c0, cols).t();
    if (has_bias) {
      at::addmm_out(z, bias->narrow(0, c0, cols), x, wt);
    } else {
      at::mm_out(z, x, wt);
    }
    block_grad_op(z, lse, target, row_scale, c0, V, ignore_index, label_smoothing, softcap);
    if (grad_weight) {
      Tensor dwc = dw.narrow(0, c0, cols);
      if (scale_after) {
        at::mul_out(dwc, float_gemm(z.t(), x), grad_loss);
      } else {
        at::mm_out(dwc, z.t(), x);
      }
    }
    if (grad_bias) {
      Tensor dbc = db.narrow(0, c0, cols);
      if (scale_after) {
        at::mul_out(dbc, z.sum(0, false, grad_loss.scalar_type()), grad_loss);
      } else {
        at::sum_out(dbc, z, {0});
      }
    }
  }
  return {dw, db};
}

Tensor in_dtype(const Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// What the summed loss of "mean"/"sum" is divided by: num_items (as a tensor), a number, the
// count of non-ignored targets ("mean"), or nothing ("sum").
struct Divisor {
  Tensor tensor;
  std::optional<double> number;
  bool counted = false;  // tensor is the target count (0 when every token is ignored)

  Divisor(const Tensor& total, const std::optional<Tensor>& num_items,
          std::optional<double> divisor, c10::string_view reduction, const Tensor& target,
          int64_t ignore_index) {
    if (num_items.has_value() && num_items->defined()) {
      tensor = in_dtype(*num_items, total.scalar_type());
    } else if (divisor.has_value()) {
      number = divisor;
    } else if (reduction == "mean") {
      tensor = target.ne(ignore_index).sum(total.scalar_type());
      counted = true;
    }
  }

  // `t` divided by it (NaN for "mean" when every token is ignored, as F.cross_entropy).
  Tensor divide(const Tensor& t) const {
    if (tensor.defined()) return t / tensor;
    return number.has_value() ? t / *number : t;
  }
};

// The sizes of a call: the given ones, 0 replaced by block_sizes' choice.
std::pair<int64_t, int64_t> call_sizes(const Tensor& x, const Tensor& weight,
                                       c10::string_view reduction, int64_t chunk_size,
                                       int64_t vocab_block) {
  if (chunk_size > 0 && vocab_block > 0) return {chunk_size, vocab_block};
  const auto [chunk, vocab] =
      block_sizes(x.size(0), weight.size(0), x.size(1), x.element_size(),
                  weight.requires_grad() && at::GradMode::is_enabled(), splits(reduction, x));
  return {chunk_size > 0 ? chunk_size : chunk, vocab_block > 0 ? vocab_block : vocab};
}

// Below autograd: the loss only.
Tensor lce_forward(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                   const Tensor& target, const std::optional<Tensor>& num_items,
                   std::optional<double> divisor, c10::string_view reduction,
                   int64_t ignore_index, double label_smoothing, int64_t chunk_size,
                   int64_t vocab_block, double softcap) {
  const int64_t chunk = call_sizes(x, weight, reduction, chunk_size, vocab_block).first;
  const Tensor loss = std::get<0>(forward_chunks(x, weight, bias, target, ignore_index,
                                                 label_smoothing, chunk, false, false, false,
                                                 softcap));
  if (reduction == "none") return in_dtype(loss, x.scalar_type());
  const Tensor total = loss.sum();
  const Divisor d(total, num_items, divisor, reduction, target, ignore_index);
  return in_dtype(d.divide(total), x.scalar_type());
}

// The backward of one call; its inputs (next edges) are x, weight, bias.
struct LinearCrossEntropyBackward : public torch::autograd::Node {
  bool reduction_none = false;
  bool need_weight = false, need_bias = false;
  // The gradients computed in forward (dx; and dweight, dbias when accumulated there), handed
  // over (scaled in place) on the one backward — plain members, not saved variables, so that
  // autograd gets them without another reference and AccumulateGrad can take them without a
  // copy.
  std::mutex handover;
  bool pending = false;
  Tensor grads[3];
  std::optional<Divisor> divisor;  // "mean"/"sum": the loss's, the token count clamped to >= 1
  // The split algorithm's recompute of the weight and bias gradients: its inputs and settings.
  bool recompute = false;
  torch::autograd::SavedVariable x, weight, bias, target, lse;
  int64_t ignore_index = 0;
  double label_smoothing = 0.0;
  int64_t vocab_block = 1;
  double softcap = 0.0;

  variable_list apply(variable_list&& grad_outputs) override {
    memkern::autograd::check_not_double_backward("linear cross-entropy");
    std::lock_guard<std::mutex> lock(handover);
    TORCH_CHECK(pending,
                "memkern linear_cross_entropy: backward ran twice through the same graph. Its "
                "input gradient (and, for float32 inputs, every gradient) is computed in "
                "forward and handed over on the first backward; recompute the loss for a "
                "second backward.");
    pending = false;
    variable_list out(3);
    const Tensor& grad_loss = grad_outputs[0];
    if (!grad_loss.defined()) return out;
    // the incoming gradient in float32 (float64): per token for "none", else one number
    Tensor scale = grad_loss.to(c10::promoteTypes(grad_loss.scalar_type(), at::kFloat));
    Tensor rows;
    if (reduction_none) {
      rows = scale.reshape({-1});
      scale = rows.unsqueeze(1);
    } else {
      scale = scale.reshape({});
      if (divisor.has_value()) scale = divisor->divide(scale);
      rows = scale;
    }
    divisor.reset();
    for (int i = 0; i < 3; ++i) {
      if (!grads[i].defined()) continue;
      Tensor g = std::move(grads[i]);
      g.mul_(scale);  // a 0-dim (or [N, 1]) float32 factor: in float32 even for a 16-bit dx
      out[i] = std::move(g);
    }
    if (recompute) {
      const Tensor xs = x.unpack(), bs = bias.unpack();
      std::optional<Tensor> b;
      if (bs.defined()) b = bs;
      auto [dw, db] = backward_blocks(rows, xs, weight.unpack(), b,
                                      target.unpack(), lse.unpack(), ignore_index,
                                      label_smoothing, vocab_block, need_weight,
                                      need_bias && bs.defined(), softcap);
      if (need_weight) out[1] = dw;
      if (need_bias && bs.defined()) out[2] = db;
    }
    return out;
  }

  void release_variables() override {
    x.reset_data();
    weight.reset_data();
    bias.reset_data();
    target.reset_data();
    lse.reset_data();
    std::lock_guard<std::mutex> lock(handover);
    for (Tensor& g : grads) g.reset();
    divisor.reset();
  }

  std::string name() const override { return "memkern::LinearCrossEntropyBackward"; }
};

Tensor lce_autograd(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                    const Tensor& target, const std::optional<Tensor>& num_items,
                    std::optional<double> divisor, c10::string_view reduction,
                    int64_t ignore_index, double label_smoothing, int64_t chunk_size,
                    int64_t vocab_block, double softcap) {
  const Tensor b = bias.value_or(Tensor());
  if (!torch::autograd::compute_requires_grad(x, weight, b)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return lce_forward(x, weight, bias, target, num_items, divisor, reduction, ignore_index,
                       label_smoothing, chunk_size, vocab_block, softcap);
  }
  const auto [chunk, vocab] = call_sizes(x, weight, reduction, chunk_size, vocab_block);
  auto node = memkern::autograd::make_node<LinearCrossEntropyBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, b));
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  const bool need_b = b.defined() && b.requires_grad();
  const bool split = splits(reduction, x);
  const bool in_forward_w = !split && need_w, in_forward_b = !split && need_b;
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, lse, dx, dw, db] =
        forward_chunks(x, weight, bias, target, ignore_index, label_smoothing, chunk, need_x,
                       in_forward_w, in_forward_b, softcap);
    if (reduction == "none") {
      out = loss;
    } else {
      const Tensor total = loss.sum();
      Divisor d(total, num_items, divisor, reduction, target, ignore_index);
      out = d.divide(total);
      if (d.counted) d.tensor = d.tensor.clamp_min(1.0);  // all ignored: gradient 0, not NaN
      if (d.tensor.defined() || d.number.has_value()) node->divisor = std::move(d);
    }
    if (need_x) node->grads[0] = dx;
    if (in_forward_w) node->grads[1] = dw;
    if (in_forward_b) node->grads[2] = db;
    node->pending = true;
    node->reduction_none = reduction == "none";
    node->need_weight = need_w;
    node->need_bias = need_b;
    node->recompute = split && (need_w || need_b);
    if (node->recompute) {
      node->x = torch::autograd::SavedVariable(x, /*is_output=*/false);
      node->weight = torch::autograd::SavedVariable(weight, false);
      node->bias = torch::autograd::SavedVariable(b, false);
      node->target = torch::autograd::SavedVariable(target, false);
      node->lse = torch::autograd::SavedVariable(lse, false);
      node->ignore_index = ignore_index;
      node->label_smoothing = label_smoothing;
      node->vocab_block = vocab;
      node->softcap = softcap;
    }
    out = in_dtype(out, x.scalar_type());
  }
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace
}  // namespace memkern::lce

// The schemas are defined in memkern/ops/linear_cross_entropy.py and
// memkern/ops/linear_cross_entropy_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) {
  m.impl("linear_cross_entropy_layer", memkern::lce::lce_autograd);
}
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("linear_cross_entropy_layer", memkern::lce::lce_forward);
  m.impl("linear_cross_entropy_forward", memkern::lce::forward_chunks);
  m.impl("linear_cross_entropy_backward", memkern::lce::backward_blocks);
}
