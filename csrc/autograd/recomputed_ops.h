// What the recomputing GEMM layers' nodes (mlp.cpp, swiglu.cpp) run again in backward instead
// of saving, by recompute mode: those inner ops by name and overload ("aten::to.dtype";
// "aten::mm" for the default overload). memkern._C.recomputed_ops exports them; under
// torch.compile memkern.nn.functional runs the layer op in a selective-checkpoint region that
// recomputes exactly these, since the compiler's partitioner would otherwise keep what the node
// recomputes.
#pragma once

#include <vector>

#include "../layer_constants.h"
#include "gemm.h"

namespace memkern::autograd {

// The recomputation of a node whose elementwise unit is the op `unit` (act_forward,
// swiglu_forward): the casts of its operands to the compute dtype, in every mode (under
// autocast the weights' low-precision copies; a region recomputing this op recomputes x's cast
// too, keeping x itself where the node keeps it cast); the unit ("activation"); the input
// GEMMs too ("full": the GEMMs by name, the last one's output being the layer's, which is never
// saved).
inline std::vector<const char*> gemm_layer_recomputed_ops(Recompute recompute, const char* unit) {
  switch (recompute) {
    case kNone:
      return {kCastOp};
    case kActivation:
      return {kCastOp, unit};
    case kFull:
      return {kCastOp, unit, kLayerMmOps[0], kLayerMmOps[1]};
  }
  return {};
}

std::vector<const char*> mlp_recomputed_ops(Recompute recompute);
std::vector<const char*> swiglu_recomputed_ops(Recompute recompute);

}  // namespace memkern::autograd
