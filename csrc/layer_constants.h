// Choices and bounds of the layers that the Python side shares: memkern._C exports them
// (csrc/constants.cpp), and the Python modules that repeat them check at import that they are
// these (memkern/_extension.py, check_same_in_cpp).
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace memkern {

// `names` as a Python tuple literal, for error messages: ('a', 'b').
template <size_t N>
std::string quoted_tuple(const std::array<const char*, N>& names) {
  std::string out = "(";
  for (size_t i = 0; i < N; ++i) {
    out += (i ? ", '" : "'") + std::string(names[i]) + "'";
  }
  return out + ")";
}

// The activations memkern::act_forward / act_backward compute (KINDS of
// memkern/ops/activation.py).
inline constexpr std::array<const char*, 4> kActivationKinds{"gelu", "gelu_tanh", "relu", "silu"};

// What a GEMM layer (csrc/autograd/mlp.cpp, swiglu.cpp) keeps for backward, by recompute
// (RECOMPUTE of memkern/nn/mlp.py), in this order: "none" keeps every
// intermediate, "activation" recomputes the elementwise unit, "full" the input GEMMs too.
enum Recompute : int64_t { kNone = 0, kActivation = 1, kFull = 2 };
inline constexpr std::array<const char*, 3> kRecomputeNames{"none", "activation", "full"};

inline Recompute parse_recompute(const char* layer, c10::string_view recompute) {
  size_t i = 0;
  while (i < kRecomputeNames.size() && recompute != kRecomputeNames[i]) {
    ++i;
  }
  TORCH_CHECK(i < kRecomputeNames.size(), "memkern::", layer, ": recompute='",
              std::string(recompute), "' is not one of ", quoted_tuple(kRecomputeNames));
  return static_cast<Recompute>(i);
}

// A dropout seed is drawn uniformly from [0, kDropoutSeedHigh) by csrc/autograd/dropout.cpp,
// from torch's generator of the input's device.
inline constexpr int64_t kDropoutSeedHigh = int64_t{1} << 62;

}  // namespace memkern
