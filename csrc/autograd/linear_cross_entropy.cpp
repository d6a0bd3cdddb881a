// memkern's linear cross-entropy in C++, on every device: the kernels of the ops
// memkern::linear_cross_entropy_forward / _backward (the loops; twins of forward_impl /
// backward_impl in memkern/ops/linear_cross_entropy.py, ATen call for ATen call, so both give the
// same bits), and memkern::linear_cross_entropy_layer, the layer with its autograd node — the one
// autograd of memkern.nn.linear_cross_entropy, for eager calls and torch.compile alike. The node
// calls the two loop ops through the dispatcher, so that torch.compile traces it into those two
// opaque ops and memkern.profile.plan can run their references on fake tensors (where the
// planned device, not the tensors', picks the path). The GEMMs are torch's (cuBLAS on a GPU,
// 16-bit inputs included: every GEMM writes its result once, in the inputs' dtype); the row ops
// memkern::cross_entropy_rows_ and memkern::cross_entropy_block_grad_ are reached through the
// dispatcher, which picks the C++ CPU or the CUDA kernel. Also the layer's Python entries
// (add_entries). What is saved and recomputed: memkern/nn/linear_cross_entropy.py's docstring.
#include "linear_cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "../cuda/kernels/cross_entropy_math.h"
#include "node.h"
#include "python_entry.h"

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

// memkern.nn.linear_cross_entropy.splits (the Python functional needs it to compute the block
// sizes under torch.compile, where the sizes may be symbolic).
bool splits(c10::string_view reduction, const Tensor& x) {
  return reduction == "none" || x.scalar_type() == at::kHalf ||
         x.scalar_type() == at::kBFloat16;
}

std::tuple<Tensor, Tensor> rows_op(Tensor& logits, const Tensor& target, int64_t ignore_index,
                                   double label_smoothing, bool compute_grad, double softcap,
                                   int64_t outputs, const std::optional<Tensor>& stats) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::cross_entropy_rows_", "")
          .typed<std::tuple<Tensor, Tensor>(Tensor&, const Tensor&,
                                            const std::optional<Tensor>&, int64_t, double, bool,
                                            double, int64_t, const std::optional<Tensor>&)>();
  return op.call(logits, target, std::nullopt, ignore_index, label_smoothing, compute_grad,
                 softcap, outputs, stats);
}

void block_grad_op(Tensor& logits, const Tensor& lse, const Tensor& target,
                   const Tensor& row_scale, int64_t class_offset, int64_t num_classes,
                   int64_t ignore_index, double label_smoothing, double softcap,
                   const std::optional<Tensor>& entropy,
                   const std::optional<Tensor>& entropy_scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::cross_entropy_block_grad_", "")
          .typed<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                      int64_t, double, double, const std::optional<Tensor>&,
                      const std::optional<Tensor>&)>();
  op.call(logits, lse, target, row_scale, class_offset, num_classes, ignore_index,
          label_smoothing, softcap, entropy, entropy_scale);
}

using ForwardOut = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using BackwardOut = std::tuple<Tensor, Tensor, Tensor>;

// memkern::linear_cross_entropy_forward through the dispatcher (its kernel: forward_chunks),
// so that torch.compile records it as one op (its fake implementation gives the metadata)
// instead of the unrolled loop, and memkern.profile.plan runs its reference on fake tensors.
ForwardOut forward_op(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                      const Tensor& target, int64_t ignore_index, double label_smoothing,
                      int64_t chunk_size, bool grad_input, bool grad_weight, bool grad_bias,
                      double softcap, int64_t outputs = 0) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::linear_cross_entropy_forward", "")
          .typed<ForwardOut(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                            const Tensor&, int64_t, double, int64_t, bool, bool, bool, double,
                            int64_t)>();
  return op.call(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                 grad_input, grad_weight, grad_bias, softcap, outputs);
}

// memkern::linear_cross_entropy_backward through the dispatcher (its kernel: backward_blocks),
// as forward_op.
BackwardOut backward_op(const Tensor& grad_loss, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, const Tensor& target,
                        const Tensor& lse, int64_t ignore_index, double label_smoothing,
                        int64_t vocab_block, bool grad_weight, bool grad_bias, double softcap,
                        const std::optional<Tensor>& entropy,
                        const std::optional<Tensor>& grad_entropy, bool grad_input) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::linear_cross_entropy_backward", "")
          .typed<BackwardOut(const Tensor&, const Tensor&, const Tensor&,
                             const std::optional<Tensor>&, const Tensor&, const Tensor&, int64_t,
                             double, int64_t, bool, bool, double, const std::optional<Tensor>&,
                             const std::optional<Tensor>&, bool)>();
  return op.call(grad_loss, x, weight, bias, target, lse, ignore_index, label_smoothing,
                 vocab_block, grad_weight, grad_bias, softcap, entropy, grad_entropy,
                 grad_input);
}

// memkern.ops.linear_cross_entropy.forward_impl.
ForwardOut forward_chunks(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
    const Tensor& target, int64_t ignore_index, double label_smoothing, int64_t chunk_size,
    bool grad_input, bool grad_weight, bool grad_bias, double softcap, int64_t outputs) {
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
  const Tensor stats = outputs != 0 ? at::zeros({3, N}, x.options().dtype(cd))
                                    : at::empty({0}, x.options().dtype(cd));
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
    std::optional<Tensor> rows_stats;
    if (outputs != 0) rows_stats = stats.narrow(1, start, rows);
    auto [rows_loss, rows_lse] = rows_op(z, target.narrow(0, start, rows), ignore_index,
                                         label_smoothing, compute_grad, softcap, outputs,
                                         rows_stats);
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
  return {loss, lse, dx, dw, db, stats};
}

// memkern.ops.linear_cross_entropy._float_gemm: a @ b in float32 from float16 a, b.
Tensor float_gemm(const Tensor& a, const Tensor& b) {
  if (a.is_cuda()) return at::mm(a, b, at::kFloat);  // cuBLAS: float32 sums and result
  return at::mm(a.to(at::kFloat), b.to(at::kFloat));  // the CPU has no such GEMM
}

// memkern.ops.linear_cross_entropy.backward_impl.
BackwardOut backward_blocks(const Tensor& grad_loss, const Tensor& x, const Tensor& weight,
                            const std::optional<Tensor>& bias, const Tensor& target,
                            const Tensor& lse, int64_t ignore_index, double label_smoothing,
                            int64_t vocab_block, bool grad_weight, bool grad_bias, double softcap,
                            const std::optional<Tensor>& entropy,
                            const std::optional<Tensor>& grad_entropy, bool grad_input) {
  const int64_t N = x.size(0), V = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  const bool has_entropy = entropy.has_value() && entropy->defined();
  grad_bias = grad_bias && has_bias;
  Tensor dw = grad_weight ? at::empty_like(weight) : at::empty({0}, weight.options());
  Tensor db = grad_bias ? at::empty_like(*bias) : at::empty({0}, weight.options());
  Tensor dx = grad_input ? at::empty_like(x) : at::empty({0}, x.options());
  if (!(grad_weight || grad_bias || grad_input)) return {dw, db, dx};
  // float16 and one factor (no entropy's term): applied to each block's float32 dW, db (and
  // to dx's float32 sum); else folded into dZ
  const bool scale_after =
      grad_loss.dim() == 0 && x.scalar_type() == at::kHalf && !has_entropy;
  const Tensor row_scale = (scale_after ? at::ones_like(grad_loss) : grad_loss).expand({N});
  std::optional<Tensor> entropy_scale;
  if (has_entropy) entropy_scale = grad_entropy->expand({N});
  // dx sums a GEMM per block: in float32 for 16-bit inputs, rounded once at the end
  const bool wide = x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble;
  Tensor dx_sum;
  if (grad_input) dx_sum = wide ? dx : at::empty(x.sizes(), x.options().dtype(at::kFloat));
  if (grad_input && V == 0) dx.zero_();
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
    block_grad_op(z, lse, target, row_scale, c0, V, ignore_index, label_smoothing, softcap,
                  entropy, entropy_scale);
    if (grad_input) {
      const Tensor wc = weight.narrow(0, c0, cols);
      if (wide) {
        if (c0 == 0) {
          at::mm_out(dx, z, wc);
        } else {
          dx.addmm_(z, wc);
        }
      } else if (c0 == 0) {
        dx_sum.copy_(float_gemm(z, wc));
      } else {
        dx_sum.add_(float_gemm(z, wc));
      }
    }
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
  if (grad_input && !wide) {
    if (scale_after) dx_sum.mul_(grad_loss);
    dx.copy_(dx_sum);
  }
  return {dw, db, dx};
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
  const Tensor loss = std::get<0>(forward_op(x, weight, bias, target, ignore_index,
                                             label_smoothing, chunk, false, false, false,
                                             softcap));
  if (reduction == "none") return in_dtype(loss, x.scalar_type());
  const Tensor total = loss.sum();
  const Divisor d(total, num_items, divisor, reduction, target, ignore_index);
  return in_dtype(d.divide(total), x.scalar_type());
}

// The backward of one call; its inputs (next edges) are x, weight, bias. Its outputs: the loss
// (per token for reduction "none"; the per-token log-probability -loss for the log-prob layer,
// `negated`), then with `entropy_output` the per-token entropy.
struct LinearCrossEntropyBackward : public torch::autograd::Node {
  bool reduction_none = false;
  bool negated = false;
  bool entropy_output = false;
  bool need_input = false, need_weight = false, need_bias = false;
  // The gradients computed in forward (dx; and dweight, dbias when accumulated there), handed
  // over (scaled in place) on the one backward. Saved variables, so that saved-tensor hooks
  // (memkern.profile's recorders and planner) see them as kept for backward; unpacked and
  // released before the handover, so that autograd gets them without another reference and
  // AccumulateGrad can take them without a copy.
  std::mutex handover;
  bool pending = false;
  torch::autograd::SavedVariable grads[3];
  std::optional<Divisor> divisor;  // "mean"/"sum": the loss's, the token count clamped to >= 1
  // The split algorithm's recompute of the weight and bias gradients: its inputs and settings.
  bool recompute = false;
  torch::autograd::SavedVariable x, weight, bias, target, lse;
  torch::autograd::SavedVariable entropy;  // entropy_output: its values (not the output)
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
    const Tensor grad_entropy = entropy_output ? grad_outputs[1] : Tensor();
    if (grad_entropy.defined()) return with_entropy(grad_loss, grad_entropy);
    if (!grad_loss.defined()) return out;
    // the incoming gradient in float32 (float64): per token for "none", else one number
    Tensor scale = grad_loss.to(c10::promoteTypes(grad_loss.scalar_type(), at::kFloat));
    if (negated) scale = scale.neg();
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
      Tensor g = grads[i].unpack();
      grads[i].reset_data();
      if (!g.defined()) continue;
      g.mul_(scale);  // a 0-dim (or [N, 1]) float32 factor: in float32 even for a 16-bit dx
      out[i] = std::move(g);
    }
    if (recompute) {
      const Tensor xs = x.unpack(), bs = bias.unpack();
      std::optional<Tensor> b;
      if (bs.defined()) b = bs;
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      auto [dw, db, dx] = backward_op(rows, xs, weight.unpack(), b, target.unpack(),
                                      lse.unpack(), ignore_index, label_smoothing, vocab_block,
                                      need_weight, need_bias && bs.defined(), softcap,
                                      std::nullopt, std::nullopt, false);
      if (need_weight) out[1] = dw;
      if (need_bias && bs.defined()) out[2] = db;
    }
    return out;
  }

  // The entropy has a gradient: every gradient from the blocks of classes, each block's logits
  // gradient weighted for both outputs (the forward's dx, of the log-probabilities alone, is
  // dropped). An undefined grad_loss is 0.
  variable_list with_entropy(const Tensor& grad_loss, const Tensor& grad_entropy) {
    const Tensor xs = x.unpack(), bs = bias.unpack(), h = entropy.unpack();
    const auto cd = h.scalar_type();
    Tensor rows = grad_loss.defined() ? grad_loss.to(cd).reshape({-1}) : at::zeros_like(h);
    if (negated) rows = rows.neg();
    for (auto& g : grads) g.reset_data();
    std::optional<Tensor> b;
    if (bs.defined()) b = bs;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [dw, db, dx] = backward_op(rows, xs, weight.unpack(), b, target.unpack(), lse.unpack(),
                                    ignore_index, label_smoothing, vocab_block, need_weight,
                                    need_bias && bs.defined(), softcap, h,
                                    grad_entropy.to(cd).reshape({-1}), need_input);
    variable_list out(3);
    if (need_input) out[0] = dx;
    if (need_weight) out[1] = dw;
    if (need_bias && bs.defined()) out[2] = db;
    return out;
  }

  // What a backward by blocks of classes needs.
  void save_inputs(const Tensor& x_, const Tensor& weight_, const Tensor& bias_,
                   const Tensor& target_, const Tensor& lse_, int64_t ignore_index_,
                   double label_smoothing_, int64_t vocab_block_, double softcap_) {
    x = torch::autograd::SavedVariable(x_, /*is_output=*/false);
    weight = torch::autograd::SavedVariable(weight_, false);
    bias = torch::autograd::SavedVariable(bias_, false);
    target = torch::autograd::SavedVariable(target_, false);
    lse = torch::autograd::SavedVariable(lse_, false);
    ignore_index = ignore_index_;
    label_smoothing = label_smoothing_;
    vocab_block = vocab_block_;
    softcap = softcap_;
  }

  void release_variables() override {
    x.reset_data();
    weight.reset_data();
    bias.reset_data();
    target.reset_data();
    lse.reset_data();
    entropy.reset_data();
    std::lock_guard<std::mutex> lock(handover);
    for (auto& g : grads) g.reset_data();
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
    auto [loss, lse, dx, dw, db, stats] =
        forward_op(x, weight, bias, target, ignore_index, label_smoothing, chunk, need_x,
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
    if (need_x) node->grads[0] = torch::autograd::SavedVariable(dx, /*is_output=*/false);
    if (in_forward_w) node->grads[1] = torch::autograd::SavedVariable(dw, false);
    if (in_forward_b) node->grads[2] = torch::autograd::SavedVariable(db, false);
    node->pending = true;
    node->reduction_none = reduction == "none";
    node->need_input = need_x;
    node->need_weight = need_w;
    node->need_bias = need_b;
    node->recompute = split && (need_w || need_b);
    if (node->recompute) {
      node->save_inputs(x, weight, b, target, lse, ignore_index, label_smoothing, vocab,
                        softcap);
    }
    out = in_dtype(out, x.scalar_type());
  }
  torch::autograd::set_history(out, node);
  return out;
}

using LogProbOut = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// The log-prob layer's outputs from the forward loop's: -loss, then the statistics `outputs`
// asks for (empty [0] tensors for the others): the entropy (a copy: the node keeps the loop's
// values), is-top-1 as bool, the mean logit.
LogProbOut log_prob_outputs(const Tensor& loss, const Tensor& stats, int64_t outputs) {
  namespace ce = memkern::cross_entropy;
  const Tensor none = at::empty({0}, loss.options());
  return {loss.neg(),
          (outputs & ce::kRowEntropy) != 0 ? stats.select(0, ce::kEntropyRow).clone() : none,
          (outputs & ce::kRowIsTop1) != 0 ? stats.select(0, ce::kIsTop1Row).ne(0)
                                          : none.to(at::kBool),
          (outputs & ce::kRowMeanLogit) != 0 ? stats.select(0, ce::kMeanLogitRow).clone()
                                             : none};
}

// Below autograd: the outputs only.
LogProbOut log_prob_forward(const Tensor& x, const Tensor& weight,
                            const std::optional<Tensor>& bias, const Tensor& target,
                            int64_t outputs, int64_t ignore_index, int64_t chunk_size,
                            int64_t vocab_block, double softcap) {
  const int64_t chunk = call_sizes(x, weight, "none", chunk_size, vocab_block).first;
  const ForwardOut out = forward_op(x, weight, bias, target, ignore_index, 0.0, chunk, false,
                                    false, false, softcap, outputs);
  return log_prob_outputs(std::get<0>(out), std::get<5>(out), outputs);
}

// memkern::linear_log_prob_layer with autograd: the split algorithm of reduction "none" (the
// forward's dx of the log-probabilities; the weight and bias gradients by blocks of classes in
// backward), the node's first output negated; with the entropy asked, its gradient too (see
// LinearCrossEntropyBackward::with_entropy).
LogProbOut log_prob_autograd(const Tensor& x, const Tensor& weight,
                             const std::optional<Tensor>& bias, const Tensor& target,
                             int64_t outputs, int64_t ignore_index, int64_t chunk_size,
                             int64_t vocab_block, double softcap) {
  const Tensor b = bias.value_or(Tensor());
  if (!torch::autograd::compute_requires_grad(x, weight, b)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return log_prob_forward(x, weight, bias, target, outputs, ignore_index, chunk_size,
                            vocab_block, softcap);
  }
  const auto [chunk, vocab] = call_sizes(x, weight, "none", chunk_size, vocab_block);
  auto node = memkern::autograd::make_node<LinearCrossEntropyBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, b));
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  const bool need_b = b.defined() && b.requires_grad();
  LogProbOut result;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, lse, dx, dw, db, stats] = forward_op(x, weight, bias, target, ignore_index, 0.0,
                                                     chunk, need_x, false, false, softcap,
                                                     outputs);
    result = log_prob_outputs(loss, stats, outputs);
    if (need_x) node->grads[0] = torch::autograd::SavedVariable(dx, /*is_output=*/false);
    node->pending = true;
    node->reduction_none = true;
    node->negated = true;
    node->entropy_output = (outputs & memkern::cross_entropy::kRowEntropy) != 0;
    node->need_input = need_x;
    node->need_weight = need_w;
    node->need_bias = need_b;
    node->recompute = need_w || need_b;
    if (node->recompute || node->entropy_output) {
      node->save_inputs(x, weight, b, target, lse, ignore_index, 0.0, vocab, softcap);
    }
    if (node->entropy_output) {
      node->entropy = torch::autograd::SavedVariable(
          stats.select(0, memkern::cross_entropy::kEntropyRow), false);
    }
  }
  torch::autograd::set_history(std::get<0>(result), node);
  if (node->entropy_output) torch::autograd::set_history(std::get<1>(result), node);
  return result;
}

// memkern.nn.linear_cross_entropy's eager call with num_items absent or a tensor, on any device
// and dtype: memkern::linear_cross_entropy_layer on the flattened inputs, the loss viewed as
// target's shape for reduction "none"; chunk_size and vocab_block -1 for their defaults (0
// for the op). None for anything else — including every invalid argument, which the Python
// function then reports. (A pybind11 function reaches the op through a typed dispatcher handle,
// without torch.ops' boxing of twelve arguments.)
std::optional<Tensor> layer_entry(const Tensor& input, const Tensor& weight, const Tensor& target,
                                  const std::optional<Tensor>& bias, int64_t ignore_index,
                                  const std::string& reduction, double label_smoothing,
                                  const std::optional<Tensor>& num_items, double softcap,
                                  int64_t chunk_size, int64_t vocab_block) {
  const bool has_items = num_items.has_value() && num_items->defined();
  const bool has_bias = bias.has_value() && bias->defined();
  if ((reduction != "mean" && reduction != "sum" && reduction != "none") ||
      (has_items && (reduction == "none" || num_items->device() != input.device())) ||
      !(label_smoothing >= 0.0 && label_smoothing <= 1.0) ||
      !(std::isfinite(softcap) && softcap >= 0.0) || (chunk_size < 1 && chunk_size != -1) ||
      (vocab_block < 1 && vocab_block != -1) || weight.dim() != 2 || input.dim() < 1 ||
      input.size(-1) != weight.size(1) ||
      target.sizes() != input.sizes().slice(0, input.dim() - 1) ||
      target.scalar_type() != at::kLong || !autograd::one_dtype(input, weight, bias)) {
    return std::nullopt;
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::linear_cross_entropy_layer", "")
          .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                        const Tensor&, const std::optional<Tensor>&, std::optional<double>,
                        c10::string_view, int64_t, double, int64_t, int64_t, double)>();
  const std::optional<Tensor> b =
      has_bias ? std::optional<Tensor>(bias->contiguous()) : std::nullopt;
  const Tensor loss =
      op.call(input.reshape({-1, input.size(-1)}).contiguous(), weight.contiguous(), b,
              target.reshape({-1}).contiguous(), has_items ? num_items : std::nullopt,
              std::nullopt, reduction, ignore_index, label_smoothing,
              std::max<int64_t>(chunk_size, 0), std::max<int64_t>(vocab_block, 0), softcap);
  return reduction == "none" ? loss.view(target.sizes()) : loss;
}

}  // namespace

void add_entries(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("linear_cross_entropy_layer", &layer_entry, py::arg("input"), py::arg("weight"),
        py::arg("target"), py::arg("bias"), py::arg("ignore_index"), py::arg("reduction"),
        py::arg("label_smoothing"), py::arg("num_items"), py::arg("softcap"),
        py::arg("chunk_size"), py::arg("vocab_block"),
        "memkern.nn.linear_cross_entropy's eager call (memkern::linear_cross_entropy_layer), "
        "or None for a call that function refuses with its error.");
  // The C++ twin of memkern.ops.linear_cross_entropy.block_sizes (its constants:
  // constants.cpp).
  m.def("linear_cross_entropy_block_sizes", &block_sizes, py::arg("n_tokens"),
        py::arg("n_classes"), py::arg("hidden"), py::arg("element_size"),
        py::arg("weight_grad"), py::arg("split"),
        "(tokens per forward chunk, classes per backward block), by the C++ rule.");
}

}  // namespace memkern::lce

// The schemas are defined in memkern/ops/linear_cross_entropy.py and
// memkern/ops/linear_cross_entropy_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) {
  m.impl("linear_cross_entropy_layer", memkern::lce::lce_autograd);
  m.impl("linear_log_prob_layer", memkern::lce::log_prob_autograd);
}
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("linear_cross_entropy_layer", memkern::lce::lce_forward);
  m.impl("linear_log_prob_layer", memkern::lce::log_prob_forward);
  m.impl("linear_cross_entropy_forward", memkern::lce::forward_chunks);
  m.impl("linear_cross_entropy_backward", memkern::lce::backward_blocks);
}
