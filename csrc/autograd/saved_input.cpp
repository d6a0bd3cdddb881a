// See saved_input.h.
#include "saved_input.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <tuple>

namespace memkern::autograd {
namespace {

std::optional<at::Tensor> flat(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t.reshape({-1})) : std::nullopt;
}

// Whether `input` is saved through `recipe` (checked: the arguments come from Python).
bool uses_recipe(const at::Tensor& input, const NormRecipe& recipe) {
  if (!input.defined() || recipe.kind == kNoNorm) {
    return false;
  }
  const bool modulated = recipe.kind == kModulatedLayerNorm;
  const auto present = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined();
  };
  TORCH_CHECK(recipe.kind >= kNativeLayerNorm && recipe.kind <= kModulatedLayerNorm &&
                  present(recipe.x) && recipe.dims >= 0 && recipe.dims <= recipe.x->dim() &&
                  (!modulated || (recipe.dims == 1 && present(recipe.weight) &&
                                  present(recipe.bias))),
              "memkern: invalid norm recipe (norm_kind=", recipe.kind, ", norm_dims=",
              recipe.dims, "); pass no norm_* arguments, or those of a memkern norm's output");
  return true;
}

}  // namespace

at::Tensor per_sample_view(const at::Tensor& t, int64_t dim) {
  at::Tensor out = t;
  for (int64_t d = 2; d < dim; ++d) {
    out = out.unsqueeze(1);
  }
  return out;
}

at::Tensor modulate(const at::Tensor& normed, const at::Tensor& scale, const at::Tensor& shift) {
  return normed * (per_sample_view(scale, normed.dim()) + 1) +
         per_sample_view(shift, normed.dim());
}

// What memkern/nn/functional/norm.py's rebuild closures compute (_native_layer_norm,
// _recompute), through the same ops.
at::Tensor rebuild_norm_output(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, int64_t kind, int64_t dims, double eps) {
  at::NoGradGuard no_grad;
  // the op as the norm ran it: in x's dtype, whatever autocast the backward runs under
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const at::IntArrayRef normalized = x.sizes().slice(x.dim() - dims);
  if (kind == kNativeLayerNorm) {
    return std::get<0>(at::native_layer_norm(x, normalized, weight, bias, eps));
  }
  if (kind == kModulatedLayerNorm) {
    return modulate(std::get<0>(at::native_layer_norm(x, normalized, {}, {}, eps)), weight, bias);
  }
  static const auto norm_forward =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memkern::norm_forward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, double, bool)>();
  int64_t features = 1;
  for (const int64_t n : normalized) {
    features *= n;
  }
  const at::Tensor y = std::get<0>(norm_forward.call(x.reshape({-1, features}).contiguous(),
                                                     flat(weight), flat(bias), eps,
                                                     kind == kRmsNorm));
  return y.view(x.sizes());
}

WeakNormRecipe::WeakNormRecipe(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, int64_t kind,
                               int64_t dims, double eps)
    : x_(ref(x)),
      weight_(ref(weight.value_or(at::Tensor()))),
      bias_(ref(bias.value_or(at::Tensor()))),
      kind_(kind),
      dims_(dims),
      eps_(eps) {}

WeakNormRecipe::Ref WeakNormRecipe::ref(const at::Tensor& t) {
  if (!t.defined()) {
    return {};
  }
  return {c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()),
          t._version()};
}

std::optional<at::Tensor> WeakNormRecipe::lock(const Ref& ref) {
  if (!ref.impl) {
    return at::Tensor();
  }
  at::Tensor t(ref.impl->lock());
  if (!t.defined() || t._version() != ref.version) {
    return std::nullopt;
  }
  return t;
}

std::optional<NormRecipe> WeakNormRecipe::lock() const {
  auto x = lock(x_);
  auto weight = lock(weight_);
  auto bias = lock(bias_);
  if (!x || !weight || !bias) {
    return std::nullopt;
  }
  const auto present = [](at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(std::move(t)) : std::nullopt;
  };
  return NormRecipe{std::move(*x), present(*weight), present(*bias), kind_, dims_, eps_};
}

void SavedInput::save(const at::Tensor& input, const NormRecipe& recipe) {
  using torch::autograd::SavedVariable;
  if (!uses_recipe(input, recipe)) {
    x_ = SavedVariable(input, /*is_output=*/false);
    return;
  }
  x_ = SavedVariable(*recipe.x, false);
  weight_ = SavedVariable(recipe.weight.value_or(at::Tensor()), false);
  bias_ = SavedVariable(recipe.bias.value_or(at::Tensor()), false);
  kind_ = recipe.kind;
  dims_ = recipe.dims;
  eps_ = recipe.eps;
}

at::Tensor SavedInput::load() const {
  if (kind_ == kNoNorm) {
    return x_.unpack();
  }
  return rebuild_norm_output(x_.unpack(), weight_.unpack(), bias_.unpack(), kind_, dims_, eps_);
}

void SavedInput::release() {
  x_.reset_data();
  weight_.reset_data();
  bias_.reset_data();
}

}  // namespace memkern::autograd
