// The direct Python entries of memkern's linear cross-entropy: memkern._C.
// linear_cross_entropy_layer, an entry as the other layers' are (csrc/autograd/python_entry.h;
// theirs are beside their autograd nodes), and its block-size rule.
#include "python_entries.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "autograd/linear_cross_entropy.h"
#include "autograd/python_entry.h"

namespace memkern {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;
using autograd::one_dtype;

// memkern.nn.functional.linear_cross_entropy with num_items absent or a tensor, on any device
// and dtype: memkern::linear_cross_entropy_layer on the flattened inputs, the loss viewed as
// target's shape for reduction "none"; chunk_size and vocab_block -1 for their defaults (0
// for the op). None for anything else — including every invalid argument, which the Python
// path then reports.
OptTensor linear_cross_entropy_layer(const at::Tensor& input, const at::Tensor& weight,
                                     const at::Tensor& target, const OptTensor& bias,
                                     int64_t ignore_index, const std::string& reduction,
                                     double label_smoothing, const OptTensor& num_items,
                                     double softcap, int64_t chunk_size, int64_t vocab_block) {
  const bool has_items = num_items.has_value() && num_items->defined();
  if ((reduction != "mean" && reduction != "sum" && reduction != "none") ||
      (has_items && (reduction == "none" || num_items->device() != input.device())) ||
      !(label_smoothing >= 0.0 && label_smoothing <= 1.0) ||
      !(std::isfinite(softcap) && softcap >= 0.0) || (chunk_size < 1 && chunk_size != -1) ||
      (vocab_block < 1 && vocab_block != -1) || weight.dim() != 2 || input.dim() < 1 ||
      input.size(-1) != weight.size(1) ||
      target.sizes() != input.sizes().slice(0, input.dim() - 1) ||
      target.scalar_type() != at::kLong || !one_dtype(input, weight, bias)) {
    return std::nullopt;
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::linear_cross_entropy_layer", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const at::Tensor&, const OptTensor&, std::optional<double>,
                            c10::string_view, int64_t, double, int64_t, int64_t, double)>();
  const OptTensor b = bias.has_value() && bias->defined()
                          ? OptTensor(bias->contiguous())
                          : OptTensor(std::nullopt);
  const at::Tensor loss =
      op.call(input.reshape({-1, input.size(-1)}).contiguous(), weight.contiguous(), b,
              target.reshape({-1}).contiguous(), has_items ? num_items : std::nullopt,
              std::nullopt, reduction, ignore_index, label_smoothing,
              std::max<int64_t>(chunk_size, 0), std::max<int64_t>(vocab_block, 0), softcap);
  return reduction == "none" ? loss.view(target.sizes()) : loss;
}

}  // namespace

void add_layer_entries(py::module_& m) {
  m.def("linear_cross_entropy_layer", &linear_cross_entropy_layer, py::arg("input"),
        py::arg("weight"), py::arg("target"), py::arg("bias"), py::arg("ignore_index"),
        py::arg("reduction"), py::arg("label_smoothing"), py::arg("num_items"),
        py::arg("softcap"), py::arg("chunk_size"), py::arg("vocab_block"),
        "memkern.nn.functional.linear_cross_entropy's eager call on the C++ path "
        "(memkern::linear_cross_entropy_layer), or None when the Python path must take it.");
  // The C++ twin of memkern.ops.linear_cross_entropy.block_sizes (its constants:
  // constants.cpp).
  m.def("linear_cross_entropy_block_sizes", &lce::block_sizes, py::arg("n_tokens"),
        py::arg("n_classes"), py::arg("hidden"), py::arg("element_size"),
        py::arg("weight_grad"), py::arg("split"),
        "(tokens per forward chunk, classes per backward block), by the C++ rule.");
}

}  // namespace memkern
