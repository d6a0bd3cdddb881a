// memkern::linear_cross_entropy: memkern's linear cross-entropy (LinearCrossEntropyFunction in
// memkern/nn/functional/linear_cross_entropy.py) with its chunk loop and its autograd in C++,
// so a call costs no Python autograd.Function and no Python loop.
//
// The chunk loop is memkern.ops.linear_cross_entropy.chunked op for op: per chunk of tokens one
// GEMM into a reused [chunk, V] block, the fused row op memkern::cross_entropy_rows_ (called
// through the dispatcher: the C++ kernel on the CPU, Triton on CUDA) on sub-blocks, then the
// dx and dW GEMMs — never the full [N, V] logits. What is saved is what the Python Function
// saves: for reduction "mean"/"sum" the gradients of the summed loss, computed in forward and
// handed to autograd (scaled in place) on the one backward; for "none" x, W, b and the target,
// the backward recomputing the logits chunk by chunk. The Python front end routes here only
// where the float32 accumulators need no 16-bit cuBLAS path (CPU, or 32/64-bit inputs).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "node.h"

namespace {

using at::Tensor;
using torch::autograd::variable_list;

constexpr int64_t kRowOpBytes = int64_t{8} << 20;  // memkern.ops.linear_cross_entropy.ROW_OP_BYTES

Tensor rows_op(Tensor& logits, const Tensor& target, const std::optional<Tensor>& row_scale,
               int64_t ignore_index, double label_smoothing, bool compute_grad) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::cross_entropy_rows_", "")
          .typed<Tensor(Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t, double,
                        bool)>();
  return op.call(logits, target, row_scale, ignore_index, label_smoothing, compute_grad);
}

at::ScalarType compute_dtype(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// acc (=|+=) a @ b, acc possibly float32 with 16-bit a, b (then the chunk operands are widened).
void addmm_acc_(Tensor& acc, const Tensor& a, const Tensor& b, bool first) {
  const bool same = acc.scalar_type() == a.scalar_type();
  const Tensor aa = same ? a : a.to(acc.scalar_type());
  const Tensor bb = same ? b : b.to(acc.scalar_type());
  if (first) {
    at::mm_out(acc, aa, bb);
  } else {
    acc.addmm_(aa, bb);
  }
}

struct Grads {
  Tensor loss, dx, dw, db;
};

// memkern.ops.linear_cross_entropy.chunked (grad_loss defined: the recompute backward).
Grads chunked(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
              const Tensor& target, int64_t ignore_index, double label_smoothing,
              int64_t chunk_size, bool grad_input, bool grad_weight, bool grad_bias,
              double softcap, const std::optional<Tensor>& grad_loss) {
  const int64_t N = x.size(0), V = weight.size(0);
  const auto cd = compute_dtype(x);
  const bool has_bias = bias.has_value() && bias->defined();
  grad_bias = grad_bias && has_bias;
  const bool compute_grad = grad_input || grad_weight || grad_bias;
  const auto acc = x.options().dtype(cd);
  Grads out;
  out.loss = at::empty({N}, acc);
  out.dx = grad_input ? at::empty_like(x) : at::empty({0}, x.options());
  out.dw = grad_weight ? at::empty(weight.sizes(), acc) : at::empty({0}, acc);
  out.db = grad_bias ? at::zeros({V}, acc) : at::empty({0}, acc);
  if (grad_weight && N == 0) out.dw.zero_();
  const int64_t chunk = std::max<int64_t>(1, std::min(chunk_size, N));
  Tensor block = at::empty({chunk, V}, x.options());
  const int64_t sub =
      x.is_cuda() ? chunk
                  : std::max<int64_t>(1, std::min(chunk, kRowOpBytes / (4 * std::max<int64_t>(V, 1))));
  const Tensor wt = weight.t();
  Tensor tanh;
  Tensor cap;
  if (softcap > 0.0) {
    tanh = at::empty({sub, V}, acc);
    cap = c10::scalar_to_tensor(softcap);
    cap.unsafeGetTensorImpl()->set_wrapped_number(true);
  }
  for (int64_t start = 0; start < N; start += chunk) {
    const int64_t stop = std::min(N, start + chunk);
    const Tensor xc = x.narrow(0, start, stop - start);
    Tensor z = block.narrow(0, 0, stop - start);
    if (has_bias) {
      at::addmm_out(z, *bias, xc, wt);
    } else {
      at::mm_out(z, xc, wt);
    }
    for (int64_t s0 = start; s0 < stop; s0 += sub) {
      const int64_t s1 = std::min(stop, s0 + sub);
      Tensor zs = z.narrow(0, s0 - start, s1 - s0);
      Tensor th;
      if (tanh.defined()) {  // z <- cap * tanh(z / cap), keeping tanh (the compute dtype)
        th = tanh.narrow(0, 0, s1 - s0);
        th.copy_(zs).div_(softcap).tanh_();
        at::mul_out(zs, th, cap);
      }
      std::optional<Tensor> scale;
      if (grad_loss.has_value()) scale = grad_loss->narrow(0, s0, s1 - s0);
      const Tensor rows = rows_op(zs, target.narrow(0, s0, s1 - s0), scale, ignore_index,
                                  label_smoothing, compute_grad);
      if (s1 - s0 == N) {  // one block for all tokens (the usual GPU case): no copy
        out.loss = rows;
      } else {
        out.loss.narrow(0, s0, s1 - s0).copy_(rows);
      }
      if (th.defined() && compute_grad) {  // chain rule through the cap: 1 - tanh^2
        zs.mul_(th.square_().neg_().add_(1.0));
      }
    }
    if (grad_input) {
      Tensor dx = out.dx.narrow(0, start, stop - start);
      at::mm_out(dx, z, weight);
    }
    if (grad_weight) addmm_acc_(out.dw, z.t(), xc, start == 0);
    if (grad_bias) out.db.add_(z.sum(0, false, cd));
  }
  return out;
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

// Below autograd: the loss only.
Tensor lce_forward(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                   const Tensor& target, const std::optional<Tensor>& num_items,
                   std::optional<double> divisor, c10::string_view reduction,
                   int64_t ignore_index, double label_smoothing, int64_t chunk_size,
                   double softcap) {
  const Tensor loss = chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                              false, false, false, softcap, std::nullopt)
                          .loss;
  if (reduction == "none") return in_dtype(loss, x.scalar_type());
  const Tensor total = loss.sum();
  const Divisor d(total, num_items, divisor, reduction, target, ignore_index);
  return in_dtype(d.divide(total), x.scalar_type());
}

// The backward of one call; its inputs (next edges) are x, weight, bias.
struct LinearCrossEntropyBackward : public torch::autograd::Node {
  bool reduction_none = false;
  // reduction "none": the recompute backward's inputs and settings.
  torch::autograd::SavedVariable x, weight, bias, target;
  int64_t ignore_index = 0;
  double label_smoothing = 0.0;
  int64_t chunk_size = 1;
  double softcap = 0.0;
  // "mean"/"sum": the gradients of the summed loss, computed in forward and handed over (scaled
  // in place) on the one backward — plain members, not saved variables, so that autograd gets
  // them without another reference and AccumulateGrad can take them without a copy.
  std::mutex handover;
  bool pending = false;
  Tensor grads[3];
  at::ScalarType dtypes[3] = {at::kFloat, at::kFloat, at::kFloat};
  std::optional<Divisor> divisor;  // the loss's, the token count clamped to >= 1

  variable_list apply(variable_list&& grad_outputs) override {
    memkern::autograd::check_not_double_backward("linear cross-entropy");
    const Tensor& grad_loss = grad_outputs[0];
    variable_list out(3);
    if (reduction_none) {
      if (!grad_loss.defined()) return out;
      const Tensor xs = x.unpack(), ws = weight.unpack(), bs = bias.unpack();
      const bool need_b = bs.defined() && task_should_compute_output(2);
      std::optional<Tensor> b;
      if (bs.defined()) b = bs;
      const Tensor gl = grad_loss.reshape({-1}).to(compute_dtype(xs)).contiguous();
      Grads g = chunked(xs, ws, b, target.unpack(), ignore_index, label_smoothing, chunk_size,
                        task_should_compute_output(0), task_should_compute_output(1), need_b,
                        softcap, gl);
      if (task_should_compute_output(0)) out[0] = g.dx;
      if (task_should_compute_output(1)) out[1] = in_dtype(g.dw, ws.scalar_type());
      if (need_b) out[2] = in_dtype(g.db, bs.scalar_type());
      return out;
    }
    std::lock_guard<std::mutex> lock(handover);
    TORCH_CHECK(pending,
                "memkern linear_cross_entropy: backward ran twice through the same graph. Its "
                "gradients are computed in forward and handed over on the first backward; "
                "recompute the loss for a second backward (or use reduction='none').");
    pending = false;
    if (!grad_loss.defined()) return out;
    Tensor scale = grad_loss.reshape({}).to(
        c10::promoteTypes(grad_loss.scalar_type(), at::kFloat));
    scale = divisor->divide(scale);
    for (int i = 0; i < 3; ++i) {
      if (!grads[i].defined()) continue;
      Tensor g = std::move(grads[i]);
      g.mul_(scale);  // a 0-dim tensor: multiplied in float32 even for 16-bit g
      out[i] = in_dtype(g, dtypes[i]);
    }
    return out;
  }

  void release_variables() override {
    x.reset_data();
    weight.reset_data();
    bias.reset_data();
    target.reset_data();
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
                    double softcap) {
  const Tensor b = bias.value_or(Tensor());
  if (!torch::autograd::compute_requires_grad(x, weight, b)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return lce_forward(x, weight, bias, target, num_items, divisor, reduction, ignore_index,
                       label_smoothing, chunk_size, softcap);
  }
  auto node = memkern::autograd::make_node<LinearCrossEntropyBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, b));
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (reduction == "none") {
      node->reduction_none = true;
      node->x = torch::autograd::SavedVariable(x, /*is_output=*/false);
      node->weight = torch::autograd::SavedVariable(weight, false);
      node->bias = torch::autograd::SavedVariable(b, false);
      node->target = torch::autograd::SavedVariable(target, false);
      node->ignore_index = ignore_index;
      node->label_smoothing = label_smoothing;
      node->chunk_size = chunk_size;
      node->softcap = softcap;
      out = in_dtype(chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                             false, false, false, softcap, std::nullopt)
                         .loss,
                     x.scalar_type());
    } else {
      const bool need[3] = {x.requires_grad(), weight.requires_grad(),
                            b.defined() && b.requires_grad()};
      Grads g = chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                        need[0], need[1], need[2], softcap, std::nullopt);
      const Tensor total = g.loss.sum();
      Divisor d(total, num_items, divisor, reduction, target, ignore_index);
      out = d.divide(total);
      if (d.counted) d.tensor = d.tensor.clamp_min(1.0);  // all ignored: gradient 0, not NaN
      node->divisor = std::move(d);
      const Tensor computed[3] = {g.dx, g.dw, g.db};
      const at::ScalarType dtypes[3] = {x.scalar_type(), weight.scalar_type(),
                                        b.defined() ? b.scalar_type() : weight.scalar_type()};
      for (int i = 0; i < 3; ++i) {
        if (need[i]) node->grads[i] = computed[i];
        node->dtypes[i] = dtypes[i];
      }
      node->pending = true;
      out = in_dtype(out, x.scalar_type());
    }
  }
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace

// The schema is defined in memkern/ops/linear_cross_entropy_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("linear_cross_entropy", lce_autograd); }
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("linear_cross_entropy", lce_forward);
}
