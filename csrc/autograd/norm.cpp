// memkern::norm_layer: memkern's LayerNorm/RMSNorm, its one autograd (a torch::autograd::Node,
// node.h) for eager calls and torch.compile alike (traced into the ops it calls).
//
// Where torch's native_layer_norm saves what memkern's op does (norm_is_native_layer_norm,
// norm.h), the call is torch's native_layer_norm with torch's autograd. Otherwise forward
// flattens x to [rows, D] (D = the product of the last n_norm sizes) and runs
// memkern::norm_forward; saves x, the weight, and the float32 (float64 for float64 x) per-row
// mean (LayerNorm; empty for RMSNorm) and rstd — never the output. Backward runs
// memkern::norm_backward. Both ops are called through the dispatcher, so whatever kernel is
// registered for the device serves them (C++ on the CPU and on CUDA: csrc/cpu/norm.cpp,
// csrc/cuda/norm.cu). Under autocast the norm computes in x's dtype and its output has that
// dtype: memkern's ops have no autocast kernel, and native_layer_norm runs with autocast
// excluded (CUDA autocast would run it on, and save, a float32 copy of a 16-bit x).
//
// At the end of the file: the layer's eager entry from Python, memkern._C.norm (python_entry.h).
#include "norm.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "node.h"
#include "python_entry.h"

namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

at::Tensor rows(const at::Tensor& x, int64_t n_norm) {
  int64_t d = 1;
  for (int64_t i = x.dim() - n_norm; i < x.dim(); ++i) d *= x.size(i);
  return x.reshape({-1, d}).contiguous();
}

std::optional<at::Tensor> flat(const std::optional<at::Tensor>& p) {
  if (!p.has_value() || !p->defined()) return std::nullopt;
  return p->reshape({-1});
}

Triple norm_forward(const at::Tensor& x2, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, double eps, bool rms) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::norm_forward", "")
          .typed<Triple(const at::Tensor&, const std::optional<at::Tensor>&,
                        const std::optional<at::Tensor>&, double, bool)>();
  return op.call(x2, weight, bias, eps, rms);
}

Triple norm_backward(const at::Tensor& dy2, const at::Tensor& x2,
                     const std::optional<at::Tensor>& weight, const at::Tensor& mean,
                     const at::Tensor& rstd, bool rms) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::norm_backward", "")
          .typed<Triple(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(dy2, x2, weight, mean, rstd, rms);
}

// The backward of one call; its inputs (next edges) are x, weight, bias.
struct NormBackward : public torch::autograd::Node {
  SavedVariable x, weight, mean, rstd;
  int64_t n_norm = 0;
  bool rms = false;
  bool has_bias = false;

  variable_list apply(variable_list&& grads) override {
    memkern::autograd::check_not_double_backward("LayerNorm/RMSNorm");
    variable_list out(3);
    if (!grads[0].defined()) {
      return out;
    }
    const at::Tensor x_ = x.unpack();
    const at::Tensor w = weight.unpack();
    const at::Tensor dy2 = rows(grads[0], n_norm).to(x_.scalar_type());
    const std::optional<at::Tensor> w_flat =
        w.defined() ? std::optional<at::Tensor>(w.reshape({-1})) : std::nullopt;
    auto [dx, dw, db] = norm_backward(dy2.contiguous(), rows(x_, n_norm), w_flat, mean.unpack(),
                                      rstd.unpack(), rms);
    out[0] = dx.view(x_.sizes());
    if (w.defined() && task_should_compute_output(1)) {
      out[1] = dw.to(w.scalar_type()).view(w.sizes());
    }
    if (has_bias && task_should_compute_output(2)) {
      out[2] = db.to(w.scalar_type()).view(w.sizes());
    }
    return out;
  }

  void release_variables() override {
    x.reset_data();
    weight.reset_data();
    mean.reset_data();
    rstd.reset_data();
  }

  std::string name() const override { return "memkern::NormBackward"; }
};

at::Tensor norm_layer_autograd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, int64_t n_norm, double eps,
                               bool rms) {
  if (memkern::autograd::norm_is_native_layer_norm(x, weight, bias, rms)) {
    return memkern::autograd::native_layer_norm(x, weight, bias, n_norm, eps);
  }
  at::Tensor y, mean, rstd;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(y, mean, rstd) = norm_forward(rows(x, n_norm), flat(weight), flat(bias), eps, rms);
    y = y.view(x.sizes());
  }
  const at::Tensor w = weight.value_or(at::Tensor());
  const at::Tensor b = bias.value_or(at::Tensor());
  if (torch::autograd::compute_requires_grad(x, w, b)) {
    auto node = memkern::autograd::make_node<NormBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, w, b));
    node->x = SavedVariable(x, /*is_output=*/false);
    node->weight = SavedVariable(w, false);
    node->mean = SavedVariable(mean, false);
    node->rstd = SavedVariable(rstd, false);
    node->n_norm = n_norm;
    node->rms = rms;
    node->has_bias = b.defined();
    torch::autograd::set_history(y, node);
  }
  return y;
}

at::Tensor norm_layer_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, int64_t n_norm, double eps,
                              bool rms) {
  if (memkern::autograd::norm_is_native_layer_norm(x, weight, bias, rms)) {
    return memkern::autograd::native_layer_norm(x, weight, bias, n_norm, eps);
  }
  return memkern::autograd::memkern_norm(x, weight, bias, n_norm, eps, rms);
}

}  // namespace

namespace memkern::autograd {

bool norm_is_native_layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, bool rms) {
  const at::ScalarType dtype = x.scalar_type();
  const auto of_x = [dtype](const std::optional<at::Tensor>& p) {
    return !p.has_value() || !p->defined() || p->scalar_type() == dtype;
  };
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  return !rms && (dtype == at::kFloat || dtype == at::kDouble || (x.is_cuda() && half)) &&
         of_x(weight) && of_x(bias);
}

at::Tensor native_layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                             const std::optional<at::Tensor>& bias, int64_t n_norm, double eps) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return std::get<0>(
      at::native_layer_norm(x, x.sizes().slice(x.dim() - n_norm), weight, bias, eps));
}

at::Tensor memkern_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, int64_t n_norm, double eps,
                        bool rms) {
  return std::get<0>(norm_forward(rows(x, n_norm), flat(weight), flat(bias), eps, rms))
      .view(x.sizes());
}

}  // namespace memkern::autograd

// The schema is defined in memkern/ops/norm_layer.py.
TORCH_LIBRARY_IMPL(memkern, Autograd, m) { m.impl("norm_layer", norm_layer_autograd); }
// Below autograd (inference mode, or tensors that never need gradients).
TORCH_LIBRARY_IMPL(memkern, CompositeExplicitAutograd, m) {
  m.impl("norm_layer", norm_layer_forward);
}

// The layer's eager entry from Python, memkern._C.norm (python_entry.h).
namespace memkern::autograd {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

// memkern::norm_layer.
at::Tensor norm_layer(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                      int64_t n_norm, double eps, bool rms) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::norm_layer", "")
          .typed<at::Tensor(const at::Tensor&, const OptTensor&, const OptTensor&, int64_t,
                            double, bool)>();
  return op.call(x, weight, bias, n_norm, eps, rms);
}

bool shape_is(const OptTensor& t, at::IntArrayRef shape) {
  return !t.has_value() || !t->defined() || t->sizes() == shape;
}

// memkern.nn.functional.layer_norm / rms_norm in eager mode: memkern::norm_layer — called as
// torch's native_layer_norm directly where the op would run that (norm_is_native_layer_norm;
// one dispatch less) — its output carrying the norm's recipe (a WeakNormRecipe in its
// _memkern_recipe attribute) when it requires grad, so its consumers save the norm's input
// instead. None for a call the Python path handles: normalized_shape not a tuple of ints,
// shapes that do not match (the Python path raises).
py::object norm(py::handle x_obj, py::handle normalized_shape, const OptTensor& weight,
                const OptTensor& bias, double eps, bool rms) {
  const at::Tensor* x = as_tensor(x_obj);
  if (x == nullptr || !PyTuple_Check(normalized_shape.ptr())) {
    return py::none();
  }
  const Py_ssize_t dims = PyTuple_GET_SIZE(normalized_shape.ptr());
  if (dims > x->dim()) {
    return py::none();
  }
  c10::SmallVector<int64_t, 4> shape;
  for (Py_ssize_t i = 0; i < dims; ++i) {
    PyObject* size = PyTuple_GET_ITEM(normalized_shape.ptr(), i);
    shape.push_back(PyLong_Check(size) ? PyLong_AsLongLong(size) : -1);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();  // a size beyond int64: the Python path reports the shape
    return py::none();
  }
  if (x->sizes().slice(x->dim() - dims) != at::IntArrayRef(shape) || !shape_is(weight, shape) ||
      !shape_is(bias, shape)) {
    return py::none();
  }
  const bool native = norm_is_native_layer_norm(*x, weight, bias, rms);
  at::Tensor y = native ? native_layer_norm(*x, weight, bias, dims, eps)
                        : norm_layer(*x, weight, bias, dims, eps, rms);
  const int64_t kind = native ? kNativeLayerNorm
                              : rms ? kRmsNorm : kLayerNorm;
  return with_recipe(std::move(y), *x, weight, bias, kind, dims, eps);
}

}  // namespace

void add_norm_entries(py::module_& m) {
  m.def("norm", &norm, py::arg("x"), py::arg("normalized_shape"), py::arg("weight"),
        py::arg("bias"), py::arg("eps"), py::arg("rms"),
        "memkern.nn.functional.layer_norm / rms_norm's eager call: memkern::norm_layer, its "
        "output carrying the norm's recipe, or None when the Python path must take the call.");
}

}  // namespace memkern::autograd
