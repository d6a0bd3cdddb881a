// Direct Python entry points of memkern's layer ops: memkern.nn.functional calls these, in
// eager mode, instead of torch.ops.memkern.<op>. A torch.ops call converts every argument to
// a boxed IValue against the schema and back (a layer op with a norm recipe has ten); a
// pybind11 function reaches the same op through a typed dispatcher handle, so the op, its
// autograd and its kernels are the ones torch.ops runs. Each entry also makes the checks that
// decide whether the op serves the call at all, which in Python cost more than the op's
// dispatch; where it does not, the entry returns None and the Python path takes the call.
#include "python_entries.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

namespace memkern {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

bool one_dtype(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias) {
  return weight.scalar_type() == x.scalar_type() &&
         (!bias.has_value() || !bias->defined() || bias->scalar_type() == x.scalar_type());
}

// What a GEMM layer's C++ autograd requires of a call (the rest goes to its Python Function):
// x with at least `min_dim` dimensions, one dtype for x and every (weight, bias) pair, no
// autocast on x's device, and x's last dimension equal to the first weight's in_features
// (`in_dim`: its dimension holding them).
bool gemm_layer_call(const at::Tensor& x,
                     std::initializer_list<std::pair<const at::Tensor*, const OptTensor*>> params,
                     int64_t in_dim, int64_t min_dim = 2) {
  if (x.dim() < min_dim || params.begin()->first->dim() != 2 ||
      x.size(-1) != params.begin()->first->size(in_dim)) {
    return false;
  }
  for (const auto& [weight, bias] : params) {
    if (!one_dtype(x, *weight, *bias)) {
      return false;
    }
  }
  return !at::autocast::is_autocast_enabled(x.device().type());
}

// memkern.nn.functional.linear: memkern::linear, or torch's own linear when there is nothing
// memkern does differently (no weight.grad to add into, no norm recipe, not transposed);
// None for a call the Python path handles (mixed dtypes, autocast, mismatched shapes).
OptTensor linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                 bool transposed, const OptTensor& norm_x, const OptTensor& norm_weight,
                 const OptTensor& norm_bias, int64_t norm_kind, int64_t norm_dims,
                 double norm_eps) {
  if (!gemm_layer_call(x, {{&weight, &bias}}, transposed ? 0 : 1, /*min_dim=*/1)) {
    return std::nullopt;
  }
  if (!norm_x.has_value() && !transposed && !weight.grad().defined()) {
    return at::linear(x, weight, bias);
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool,
                            const OptTensor&, const OptTensor&, const OptTensor&, int64_t,
                            int64_t, double)>();
  return op.call(x, weight, bias, transposed, norm_x, norm_weight, norm_bias, norm_kind,
                 norm_dims, norm_eps);
}

// memkern.nn.functional.mlp: memkern::mlp_layer, or None (see gemm_layer_call).
OptTensor mlp(const at::Tensor& x, const at::Tensor& fc1_weight, const OptTensor& fc1_bias,
              const at::Tensor& fc2_weight, const OptTensor& fc2_bias,
              const std::string& activation, const std::string& recompute, bool transposed,
              const OptTensor& norm_x, const OptTensor& norm_weight, const OptTensor& norm_bias,
              int64_t norm_kind, int64_t norm_dims, double norm_eps) {
  if (!gemm_layer_call(x, {{&fc1_weight, &fc1_bias}, {&fc2_weight, &fc2_bias}},
                       transposed ? 0 : 1)) {
    return std::nullopt;
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::mlp_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const at::Tensor&, const OptTensor&, c10::string_view,
                            c10::string_view, bool, const OptTensor&, const OptTensor&,
                            const OptTensor&, int64_t, int64_t, double)>();
  return op.call(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, recompute,
                 transposed, norm_x, norm_weight, norm_bias, norm_kind, norm_dims, norm_eps);
}

// memkern.nn.functional.swiglu: memkern::swiglu_layer, or None (see gemm_layer_call).
OptTensor swiglu(const at::Tensor& x, const at::Tensor& gate_weight, const OptTensor& gate_bias,
                 const at::Tensor& up_weight, const OptTensor& up_bias,
                 const at::Tensor& down_weight, const OptTensor& down_bias,
                 const std::string& recompute, const OptTensor& norm_x,
                 const OptTensor& norm_weight, const OptTensor& norm_bias, int64_t norm_kind,
                 int64_t norm_dims, double norm_eps) {
  if (!gemm_layer_call(x, {{&gate_weight, &gate_bias}, {&up_weight, &up_bias},
                           {&down_weight, &down_bias}}, 1)) {
    return std::nullopt;
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::swiglu_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const at::Tensor&, const OptTensor&, const at::Tensor&,
                            const OptTensor&, c10::string_view, const OptTensor&,
                            const OptTensor&, const OptTensor&, int64_t, int64_t, double)>();
  return op.call(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias,
                 recompute, norm_x, norm_weight, norm_bias, norm_kind, norm_dims, norm_eps);
}

// memkern.nn.functional's LayerNorm/RMSNorm on the C++ path: memkern::norm_layer.
at::Tensor norm(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                int64_t n_norm, double eps, bool rms) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::norm_layer", "")
          .typed<at::Tensor(const at::Tensor&, const OptTensor&, const OptTensor&, int64_t,
                            double, bool)>();
  return op.call(x, weight, bias, n_norm, eps, rms);
}

// memkern.nn.functional.dropout with a drawn seed: memkern::dropout_layer.
at::Tensor dropout(const at::Tensor& x, double p) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::dropout_layer", "")
          .typed<at::Tensor(const at::Tensor&, const OptTensor&, double)>();
  return op.call(x, std::nullopt, p);
}

// memkern.nn.functional.linear_cross_entropy with num_items absent or a tensor, on the C++
// path (CPU inputs, or 32/64-bit ones on a GPU): memkern::linear_cross_entropy on the
// flattened inputs, the loss viewed as target's shape for reduction "none". None for anything
// else — including every invalid argument, which the Python path then reports.
OptTensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& weight,
                               const at::Tensor& target, const OptTensor& bias,
                               int64_t ignore_index, const std::string& reduction,
                               double label_smoothing, const OptTensor& num_items,
                               double softcap, int64_t chunk_size) {
  const bool has_items = num_items.has_value() && num_items->defined();
  if ((reduction != "mean" && reduction != "sum" && reduction != "none") ||
      (has_items && (reduction == "none" || num_items->device() != input.device())) ||
      !(label_smoothing >= 0.0 && label_smoothing <= 1.0) ||
      !(std::isfinite(softcap) && softcap >= 0.0) || chunk_size < 1 || weight.dim() != 2 ||
      input.dim() < 1 || input.size(-1) != weight.size(1) ||
      target.sizes() != input.sizes().slice(0, input.dim() - 1) ||
      target.scalar_type() != at::kLong || !one_dtype(input, weight, bias) ||
      !(input.is_cpu() || input.scalar_type() == at::kFloat ||
        input.scalar_type() == at::kDouble)) {
    return std::nullopt;
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::linear_cross_entropy", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const at::Tensor&, const OptTensor&, std::optional<double>,
                            c10::string_view, int64_t, double, int64_t, double)>();
  const OptTensor b = bias.has_value() && bias->defined()
                          ? OptTensor(bias->contiguous())
                          : OptTensor(std::nullopt);
  const at::Tensor loss =
      op.call(input.reshape({-1, input.size(-1)}).contiguous(), weight.contiguous(), b,
              target.reshape({-1}).contiguous(), has_items ? num_items : std::nullopt,
              std::nullopt, reduction, ignore_index, label_smoothing, chunk_size, softcap);
  return reduction == "none" ? loss.view(target.sizes()) : loss;
}

// m.def of a GEMM layer's entry whose last arguments are the norm_* ones of
// memkern/ops/_norm_recipe.py (absent: no recipe).
template <typename Fn, typename... Args>
void def_with_recipe(py::module_& m, const char* name, Fn fn, const char* doc, Args... args) {
  m.def(name, fn, args..., py::arg("norm_x") = py::none(), py::arg("norm_weight") = py::none(),
        py::arg("norm_bias") = py::none(), py::arg("norm_kind") = 0, py::arg("norm_dims") = 0,
        py::arg("norm_eps") = 0.0, doc);
}

}  // namespace

void add_layer_entries(py::module_& m) {
  def_with_recipe(m, "linear", &linear,
                  "memkern.nn.functional.linear's eager call: memkern::linear (or torch's "
                  "linear), or None when the Python path must take the call.",
                  py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("transposed"));
  def_with_recipe(m, "mlp_layer", &mlp,
                  "memkern.nn.functional.mlp's eager call: memkern::mlp_layer, or None when "
                  "the Python path must take the call.",
                  py::arg("x"), py::arg("fc1_weight"), py::arg("fc1_bias"),
                  py::arg("fc2_weight"), py::arg("fc2_bias"), py::arg("activation"),
                  py::arg("recompute"), py::arg("transposed"));
  def_with_recipe(m, "swiglu_layer", &swiglu,
                  "memkern.nn.functional.swiglu's eager call: memkern::swiglu_layer, or None "
                  "when the Python path must take the call.",
                  py::arg("x"), py::arg("gate_weight"), py::arg("gate_bias"),
                  py::arg("up_weight"), py::arg("up_bias"), py::arg("down_weight"),
                  py::arg("down_bias"), py::arg("recompute"));
  m.def("norm_layer", &norm, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("n_norm"), py::arg("eps"), py::arg("rms"),
        "The norms' eager call on the C++ path: memkern::norm_layer.");
  m.def("dropout_layer", &dropout, py::arg("x"), py::arg("p"),
        "memkern.nn.functional.dropout's eager call with a drawn seed: memkern::dropout_layer.");
  m.def("linear_cross_entropy", &linear_cross_entropy, py::arg("input"), py::arg("weight"),
        py::arg("target"), py::arg("bias"), py::arg("ignore_index"), py::arg("reduction"),
        py::arg("label_smoothing"), py::arg("num_items"), py::arg("softcap"),
        py::arg("chunk_size"),
        "memkern.nn.functional.linear_cross_entropy's eager call on the C++ path "
        "(memkern::linear_cross_entropy), or None when the Python path must take the call.");
}

}  // namespace memkern
