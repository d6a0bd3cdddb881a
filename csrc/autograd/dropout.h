// What memkern's Dropout node (dropout.cpp) shares with the nodes that drop out their own input
// (the LoRA adapter's, lora.cpp): the seed a call draws and the masked tensor, regenerated from
// that seed in backward.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace memkern::autograd {

// `seed` when given, else an int64 seed in [0, kDropoutSeedHigh) drawn from torch's generator of
// x's device (on that device: no host-device copy).
at::Tensor dropout_seed(const at::Tensor& x, const std::optional<at::Tensor>& seed);

// memkern::dropout of x with `seed` (through the dispatcher): x with the seed's mask applied and
// the kept elements scaled by 1 / (1 - p). The same call on a gradient is its backward.
at::Tensor dropout_with_seed(const at::Tensor& x, const at::Tensor& seed, double p);

}  // namespace memkern::autograd
