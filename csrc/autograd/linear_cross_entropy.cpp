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
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
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

struct LinearCrossEntropyFunction
    : public torch::autograd::Function<LinearCrossEntropyFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, const Tensor& target,
                        const std::optional<Tensor>& num_items, std::optional<double> divisor,
                        c10::string_view reduction, int64_t ignore_index,
                        double label_smoothing, int64_t chunk_size, double softcap,
                        int64_t needs) {
    const bool none = reduction == "none";
    ctx->saved_data["reduction_none"] = none;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    if (none) {
      Grads g = chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                        false, false, false, softcap, std::nullopt);
      ctx->save_for_backward({x, weight, bias.value_or(Tensor()), target});
      return in_dtype(g.loss, x.scalar_type());
    }
    const bool need_x = needs & 1, need_w = needs & 2, need_b = needs & 4;
    Grads g = chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, need_x,
                      need_w, need_b, softcap, std::nullopt);
    const Tensor total = g.loss.sum();
    Tensor out = total;  // "sum"
    if (num_items.has_value() && num_items->defined()) {
      const Tensor denom = in_dtype(*num_items, total.scalar_type());
      out = total / denom;
      ctx->saved_data["divisor"] = denom;
    } else if (divisor.has_value()) {
      out = total / *divisor;
      ctx->saved_data["divisor"] = *divisor;
    } else if (reduction == "mean") {
      const Tensor count = target.ne(ignore_index).sum(total.scalar_type());
      out = total / count;  // NaN when every token is ignored, as F.cross_entropy
      ctx->saved_data["divisor"] = count.clamp_min(1.0);  // ... whose gradient is then 0
    }
    // Kept in saved_data, not save_for_backward: the backward hands them to autograd without
    // another reference, so AccumulateGrad can take them without a copy.
    if (need_x) ctx->saved_data["dx"] = g.dx;
    if (need_w) ctx->saved_data["dw"] = g.dw;
    if (need_b && bias.has_value() && bias->defined()) ctx->saved_data["db"] = g.db;
    ctx->saved_data["dtypes"] = std::vector<int64_t>{
        int64_t(x.scalar_type()), int64_t(weight.scalar_type()),
        int64_t(bias.has_value() && bias->defined() ? bias->scalar_type() : weight.scalar_type())};
    ctx->saved_data["pending"] = true;
    return in_dtype(out, x.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1),
               need_b = ctx->needs_input_grad(2) && ctx->saved_data["has_bias"].toBool();
    const Tensor& grad_loss = grad_outputs[0];
    variable_list out(12);
    if (ctx->saved_data["reduction_none"].toBool()) {
      const auto saved = ctx->get_saved_variables();
      const Tensor& x = saved[0];
      const Tensor& weight = saved[1];
      std::optional<Tensor> bias;
      if (saved[2].defined()) bias = saved[2];
      const Tensor gl = grad_loss.reshape({-1}).to(compute_dtype(x)).contiguous();
      Grads g = chunked(x, weight, bias, saved[3], ctx->saved_data["ignore_index"].toInt(),
                        ctx->saved_data["label_smoothing"].toDouble(),
                        ctx->saved_data["chunk_size"].toInt(), need_x, need_w, need_b,
                        ctx->saved_data["softcap"].toDouble(), gl);
      if (need_x) out[0] = g.dx;
      if (need_w) out[1] = in_dtype(g.dw, weight.scalar_type());
      if (need_b) out[2] = in_dtype(g.db, bias->scalar_type());
      return out;
    }
    TORCH_CHECK(ctx->saved_data.count("pending"),
                "memkern linear_cross_entropy: backward ran twice through the same graph. Its "
                "gradients are computed in forward and handed over on the first backward; "
                "recompute the loss for a second backward (or use reduction='none').");
    ctx->saved_data.erase("pending");
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    Tensor scale = grad_loss.reshape({}).to(
        c10::promoteTypes(grad_loss.scalar_type(), at::kFloat));
    auto divisor = ctx->saved_data.find("divisor");
    if (divisor != ctx->saved_data.end()) {
      scale = divisor->second.isTensor() ? scale / divisor->second.toTensor()
                                         : scale / divisor->second.toDouble();
      ctx->saved_data.erase(divisor);
    }
    const char* names[] = {"dx", "dw", "db"};
    for (int i = 0; i < 3; ++i) {
      auto it = ctx->saved_data.find(names[i]);
      if (it == ctx->saved_data.end()) continue;
      Tensor g = it->second.toTensor();
      ctx->saved_data.erase(it);
      g.mul_(scale);  // a 0-dim tensor: multiplied in float32 even for 16-bit g
      out[i] = in_dtype(g, static_cast<at::ScalarType>(dtypes[i]));
    }
    return out;
  }
};

Tensor lce_autograd(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                    const Tensor& target, const std::optional<Tensor>& num_items,
                    std::optional<double> divisor, c10::string_view reduction,
                    int64_t ignore_index, double label_smoothing, int64_t chunk_size,
                    double softcap) {
  // Which gradients the forward computes (the Python Function's needs_input_grad[:3]); known
  // here, before apply() turns grad mode off.
  const bool grad = at::GradMode::is_enabled();
  const int64_t needs = (grad && x.requires_grad() ? 1 : 0) |
                        (grad && weight.requires_grad() ? 2 : 0) |
                        (grad && bias.has_value() && bias->defined() && bias->requires_grad() ? 4 : 0);
  return LinearCrossEntropyFunction::apply(x, weight, bias, target, num_items, divisor,
                                           reduction, ignore_index, label_smoothing, chunk_size,
                                           softcap, needs);
}

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
  Tensor out = total;
  if (num_items.has_value() && num_items->defined()) {
    out = total / in_dtype(*num_items, total.scalar_type());
  } else if (divisor.has_value()) {
    out = total / *divisor;
  } else if (reduction == "mean") {
    out = total / target.ne(ignore_index).sum(total.scalar_type());
  }
  return in_dtype(out, x.scalar_type());
}

}  // namespace

// The schema is defined in memkern/ops/linear_cross_entropy_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("linear_cross_entropy", lce_autograd); }
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("linear_cross_entropy", lce_forward);
}
