// memkern's LayerNorm/RMSNorm (norm.cpp): the one choice between torch's native_layer_norm and
// memkern::norm_forward, which the op memkern::norm_layer makes and the norm's eager entry (both
// in norm.cpp) makes too, to skip the op's dispatch and to name the recipe it leaves;
// and the two computations, which a consumer of the norm's output also runs to rebuild it
// (saved_input.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace memkern::autograd {

// Whether memkern's norm of x is torch's native_layer_norm, autograd and all: a LayerNorm where
// torch's saves what memkern's op does — float32 statistics (float64 for float64 x), never the
// output — so for float32/float64 x, and 16-bit x on CUDA (on the CPU its statistics would be
// 16-bit), with parameters of x's dtype.
bool norm_is_native_layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, bool rms);

// torch's native_layer_norm of x over its last n_norm dimensions, in x's dtype under autocast
// too (CUDA autocast would run it on, and save, a float32 copy of a 16-bit x).
at::Tensor native_layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                             const std::optional<at::Tensor>& bias, int64_t n_norm, double eps);

// memkern::norm_forward's output for x over its last n_norm dimensions (the op's output below
// autograd: no graph).
at::Tensor memkern_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, int64_t n_norm, double eps,
                        bool rms);

}  // namespace memkern::autograd
