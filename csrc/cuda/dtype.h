// The element type of a buffer handed to memkern's torch-free CUDA launchers (flat_ops.h and
// the layers' <layer>_launch.h); the torch bindings map at::ScalarType onto it.
#pragma once

namespace memkern {

enum class DType { f32, bf16, f16, f64 };

}  // namespace memkern
