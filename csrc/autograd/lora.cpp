// memkern::lora_layer: a LoRA adapter added to its layer's output, with its autograd in C++ (a
// torch::autograd::Node, node.h), the adapter's one implementation: eager calls run it, and
// torch.compile traces it into its inner ops.
//
//   out = base + scaling * (dropout(x) @ A^T @ B^T + b_B)
//
// base [..., out] is the wrapped layer's output (computed by that layer: memkern's Linear, or a
// 4-bit layer left to bitsandbytes), x [..., in] its input, A [r, in], B [out, r], b_B [out] or
// absent; dropout with probability p (0: none) draws its seed as memkern's Dropout does
// (dropout.h). The adapter computes in autocast's dtype when autocast is on for x's device, else
// in A's (x cast to it, as PEFT casts the adapter's input); out has base's dtype.
//
// Saves for backward, when A or B needs a gradient, x as given (cast again in backward) — or,
// when x is a memkern norm's output, the norm's recipe (saved_input.h), storage the norm saved
// anyway — and the 8-byte dropout seed; A and B themselves (parameters). Nothing of base, and
// not dropout(x) @ A^T ([..., r]): backward recomputes it from x, regenerating the mask from
// the seed. With the wrapped layer's weight frozen, that layer saves nothing either
// (linear.cpp): a LoRA layer after a norm then keeps nothing of its own. A's and B's gradients
// are added straight into .grad when that gives exactly what autograd would (weight_grad.h).
//
// At the end of the file: the layer's eager entry from Python, memkern._C.lora_layer
// (python_entry.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "dropout.h"
#include "gemm.h"
#include "node.h"
#include "python_entry.h"
#include "saved_input.h"
#include "weight_grad.h"

namespace {

using memkern::autograd::NormRecipe;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
namespace mka = memkern::autograd;

// The dtype the adapter computes in: autocast's when it is on for x's device, else A's.
at::ScalarType adapter_dtype(const at::Tensor& x, const at::Tensor& lora_a) {
  const c10::DeviceType device = x.device().type();
  return x.is_floating_point() && mka::autocast_on(device)
             ? at::autocast::get_autocast_dtype(device)
             : lora_a.scalar_type();
}

// dropout(x) as [rows, in], in the compute dtype (x itself when p is 0).
at::Tensor dropped_rows(const at::Tensor& x, at::ScalarType dtype, const at::Tensor& seed,
                        double p) {
  const at::Tensor xr = mka::rows(mka::cast(x, dtype));
  return p > 0.0 ? mka::dropout_with_seed(xr, seed, p) : xr;
}

// base + scaling * (xd @ A^T @ B^T + b_B) from the dropped input xd [rows, in], in base's dtype
// and shape.
at::Tensor adapted(const at::Tensor& base, const at::Tensor& xd, const at::Tensor& a,
                   const at::Tensor& b, const std::optional<at::Tensor>& bias, double scaling,
                   at::ScalarType dtype) {
  const at::Tensor xa = at::mm(xd, a.t());
  at::Tensor out = at::addmm(mka::rows(mka::cast(base, dtype)), xa, b.t(), 1.0, scaling);
  if (bias.has_value() && bias->defined()) {
    out.add_(mka::cast(*bias, dtype), scaling);
  }
  return mka::cast(out, base.scalar_type()).view(base.sizes());
}

// The backward of one call; its inputs (next edges) are base, x, lora_A, lora_B, lora_B_bias.
struct LoRABackward : public torch::autograd::Node {
  mka::SavedInput input;  // x, when A or B needs a gradient
  SavedVariable lora_a, lora_b, seed;
  at::ScalarType dtype = at::kFloat;  // the compute dtype
  double scaling = 1.0;
  double p = 0.0;
  bool has_bias = false;

  variable_list apply(variable_list&& grads) override {
    mka::check_not_double_backward("LoRA");
    variable_list out(5);
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return out;
    }
    const bool need_x = task_should_compute_output(1);
    const bool need_a = task_should_compute_output(2);
    const bool need_b = task_should_compute_output(3);
    const bool need_bias = has_bias && task_should_compute_output(4);
    if (task_should_compute_output(0)) {
      out[0] = grad_out;
    }
    const at::Tensor a_stored = lora_a.unpack();
    const at::Tensor b_stored = lora_b.unpack();
    const at::Tensor a = mka::cast(a_stored, dtype);
    const at::Tensor b = mka::cast(b_stored, dtype);
    const at::Tensor g = mka::rows(mka::cast(grad_out, dtype));
    const at::Tensor s = seed.unpack();
    // scaling * g @ B [rows, r]: the gradient reaching dropout(x) @ A^T
    const at::Tensor gxa = need_a || need_x ? at::mm(g, b).mul_(scaling) : at::Tensor();
    if (need_a || need_b) {
      const at::Tensor xd = dropped_rows(input.load(), dtype, s, p);
      if (need_b) {  // dB = g^T @ (scaling * xd @ A^T): the [rows, r] product again
        out[3] = mka::weight_grad(b_stored, g.t(), at::mm(xd, a.t()).mul_(scaling));
      }
      if (need_a) {  // dA = gxa^T @ xd
        out[2] = mka::weight_grad(a_stored, gxa.t(), xd);
      }
    }
    if (need_x) {  // dx = dropout'(gxa @ A): the forward's mask, regenerated from its seed
      const at::Tensor gx = at::mm(gxa, a);
      const at::Tensor dx = p > 0.0 ? mka::dropout_with_seed(gx, s, p) : gx;
      out[1] = dx.view(mka::with_last(grad_out.sizes(), a.size(1)));
    }
    if (need_bias) {
      out[4] = g.sum(0).mul_(scaling);
    }
    return out;
  }

  void release_variables() override {
    input.release();
    lora_a.reset_data();
    lora_b.reset_data();
    seed.reset_data();
  }

  std::string name() const override { return "memkern::LoRABackward"; }
};

at::Tensor lora_autograd(const at::Tensor& base, const at::Tensor& x, const at::Tensor& lora_a,
                         const at::Tensor& lora_b, const std::optional<at::Tensor>& lora_b_bias,
                         double scaling, double p, const std::optional<at::Tensor>& seed,
                         const std::optional<at::Tensor>& norm_x,
                         const std::optional<at::Tensor>& norm_weight,
                         const std::optional<at::Tensor>& norm_bias, int64_t norm_kind,
                         int64_t norm_dims, double norm_eps) {
  const at::ScalarType dtype = adapter_dtype(x, lora_a);
  const at::Tensor s = p > 0.0 ? mka::dropout_seed(x, seed) : at::Tensor();
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = adapted(base, dropped_rows(x, dtype, s, p), mka::cast(lora_a, dtype),
                  mka::cast(lora_b, dtype), mka::cast(lora_b_bias, dtype), scaling, dtype);
  }
  const at::Tensor bias = lora_b_bias.value_or(at::Tensor());
  if (torch::autograd::compute_requires_grad(base, x, lora_a, lora_b, bias)) {
    auto node = mka::make_node<LoRABackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(base, x, lora_a, lora_b, bias));
    // x as given (the recipe rebuilds exactly it), cast in backward
    node->input.save(lora_a.requires_grad() || lora_b.requires_grad() ? x : at::Tensor(),
                     NormRecipe{norm_x, norm_weight, norm_bias, norm_kind, norm_dims, norm_eps});
    node->lora_a = SavedVariable(lora_a, /*is_output=*/false);
    node->lora_b = SavedVariable(lora_b, /*is_output=*/false);
    node->seed = SavedVariable(s, /*is_output=*/false);
    node->dtype = dtype;
    node->scaling = scaling;
    node->p = p;
    node->has_bias = bias.defined();
    torch::autograd::set_history(out, node);
  }
  return out;
}

at::Tensor lora_no_autograd(const at::Tensor& base, const at::Tensor& x, const at::Tensor& lora_a,
                            const at::Tensor& lora_b, const std::optional<at::Tensor>& lora_b_bias,
                            double scaling, double p, const std::optional<at::Tensor>& seed,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, int64_t, int64_t, double) {
  const at::ScalarType dtype = adapter_dtype(x, lora_a);
  const at::Tensor s = p > 0.0 ? mka::dropout_seed(x, seed) : at::Tensor();
  return adapted(base, dropped_rows(x, dtype, s, p), mka::cast(lora_a, dtype),
                 mka::cast(lora_b, dtype), mka::cast(lora_b_bias, dtype), scaling, dtype);
}

}  // namespace

// The schema is defined in memkern/ops/lora_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("lora_layer", lora_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("lora_layer", lora_no_autograd);
}

// The layer's eager entry from Python, memkern._C.lora_layer (python_entry.h).
namespace memkern::autograd {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

// Whether the op serves a call of memkern.nn.functional.lora: x [..., in], A [r, in],
// B [out, r], base [..., out] with x's leading dimensions, b_B [out] or absent, and, without
// autocast, one floating dtype for A, B and b_B (x is cast to it). The function raises its error
// for the rest.
bool lora_call(const at::Tensor& base, const at::Tensor& x, const at::Tensor& a,
               const at::Tensor& b, const OptTensor& bias) {
  if (x.dim() < 1 || a.dim() != 2 || b.dim() != 2 || x.size(-1) != a.size(1) ||
      b.size(1) != a.size(0) || base.dim() != x.dim() || base.size(-1) != b.size(0) ||
      base.sizes().slice(0, base.dim() - 1) != x.sizes().slice(0, x.dim() - 1)) {
    return false;
  }
  const bool bias_ok = !bias.has_value() || !bias->defined() ||
                       (bias->dim() == 1 && bias->size(0) == b.size(0) &&
                        (autocast_on(x.device().type()) || bias->scalar_type() == a.scalar_type()));
  return bias_ok && a.is_floating_point() &&
         (autocast_on(x.device().type()) || b.scalar_type() == a.scalar_type());
}

// memkern.nn.functional.lora in eager mode: memkern::lora_layer with x's norm recipe, a seed
// drawn when p > 0; None for a call that function refuses with its error.
OptTensor lora_layer(const at::Tensor& base, py::handle x_obj, const at::Tensor& lora_a,
                     const at::Tensor& lora_b, const OptTensor& lora_b_bias, double scaling,
                     double p) {
  const at::Tensor* x = as_tensor(x_obj);
  if (x == nullptr || !lora_call(base, *x, lora_a, lora_b, lora_b_bias)) {
    return std::nullopt;
  }
  const NormRecipe recipe = input_recipe(x_obj, *x);
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::lora_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const OptTensor&, double, double, const OptTensor&,
                            const OptTensor&, const OptTensor&, const OptTensor&, int64_t,
                            int64_t, double)>();
  return op.call(base, *x, lora_a, lora_b, lora_b_bias, scaling, p, std::nullopt, recipe.x,
                 recipe.weight, recipe.bias, recipe.kind, recipe.dims, recipe.eps);
}

}  // namespace

void add_lora_entries(py::module_& m) {
  m.def("lora_layer", &lora_layer, py::arg("base"), py::arg("x"), py::arg("lora_A"),
        py::arg("lora_B"), py::arg("lora_B_bias"), py::arg("scaling"), py::arg("p"),
        "memkern.nn.functional.lora's eager call: memkern::lora_layer with x's norm recipe and a "
        "drawn dropout seed, or None for a call that function refuses with its error.");
}

}  // namespace memkern::autograd
