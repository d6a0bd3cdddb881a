// See saved_input.h.
#include "saved_input.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "norm.h"
#include "swiglu_unit.h"

namespace memkern::autograd {
namespace {

// Whether `input` is saved through `recipe` (checked: the arguments come from Python).
bool uses_recipe(const at::Tensor& input, const NormRecipe& recipe) {
  if (!input.defined() || recipe.kind == kNoNorm) {
    return false;
  }
  const bool modulated = recipe.kind == kModulatedLayerNorm;
  const bool unit = recipe.kind == kSwiGLUUnit;
  const auto present = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined();
  };
  TORCH_CHECK(recipe.kind >= kNativeLayerNorm && recipe.kind <= kSwiGLUUnit &&
                  present(recipe.x) && recipe.dims >= 0 && recipe.dims <= recipe.x->dim() &&
                  (!modulated || (recipe.dims == 1 && present(recipe.weight) &&
                                  present(recipe.bias))) &&
                  (!unit ||
                   (present(recipe.weight) && recipe.weight->sizes() == recipe.x->sizes())),
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

at::Tensor rebuild_norm_output(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, int64_t kind, int64_t dims, double eps) {
  at::NoGradGuard no_grad;
  if (kind == kNativeLayerNorm) {
    return native_layer_norm(x, weight, bias, dims, eps);
  }
  if (kind == kSwiGLUUnit) {
    return swiglu_unit(x, weight);
  }
  if (kind == kModulatedLayerNorm) {
    // torch's normalisation without affine parameters, then the sample's modulation, as
    // modulated_norm.cpp's forward computes it
    return modulate(native_layer_norm(x, std::nullopt, std::nullopt, dims, eps), weight, bias);
  }
  return memkern_norm(x, weight, bias, dims, eps, kind == kRmsNorm);
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
