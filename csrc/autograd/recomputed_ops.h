// What the recomputing GEMM layers' nodes (mlp.cpp, swiglu.cpp) run again in backward instead
// of saving, by recompute mode: those inner ops by name and overload ("aten::to.dtype";
// "aten::mm" for the default overload), each list stated next to the node that recomputes
// them. memkern._C.recomputed_ops exports them; under torch.compile memkern.nn.functional
// runs the layer op in a selective-checkpoint region that recomputes exactly these, since the
// compiler's partitioner would otherwise keep what the node recomputes.
#pragma once

#include <vector>

#include "../layer_constants.h"

namespace memkern::autograd {

std::vector<const char*> mlp_recomputed_ops(Recompute recompute);
std::vector<const char*> swiglu_recomputed_ops(Recompute recompute);

}  // namespace memkern::autograd
