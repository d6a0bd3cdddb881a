// See constants.h. Each constant is defined next to the C++ code that uses it.
#include "constants.h"

#include <pybind11/stl.h>

#include <map>
#include <string>

#include "autograd/linear_cross_entropy.h"
#include "autograd/python_entry.h"
#include "autograd/saved_input.h"
#include "cuda/kernels/cross_entropy_math.h"
#include "layer_constants.h"
#include "math/state8bit.h"

namespace memkern {
namespace {

namespace py = pybind11;

template <size_t N>
py::tuple as_tuple(const std::array<const char*, N>& names) {
  py::tuple out(N);
  for (size_t i = 0; i < N; ++i) {
    out[i] = py::str(names[i]);
  }
  return out;
}

}  // namespace

void add_constants(py::module_& m) {
  // memkern/ops/_gemm_layer.py
  m.attr("NORM_KINDS") = std::map<std::string, int64_t>{
      {"native_layer_norm", autograd::kNativeLayerNorm},
      {"layer_norm", autograd::kLayerNorm},
      {"rms_norm", autograd::kRmsNorm},
      {"modulated_layer_norm", autograd::kModulatedLayerNorm},
      {"swiglu_unit", autograd::kSwiGLUUnit}};
  // memkern/nn/_saved.py
  m.attr("NORM_RECIPE_ATTR") = autograd::kNormRecipeAttr;
  // memkern/ops/activation.py, memkern/nn/mlp.py
  m.attr("ACTIVATIONS") = as_tuple(kActivationKinds);
  m.attr("RECOMPUTE") = as_tuple(kRecomputeNames);
  // memkern/kernels/state8bit.py
  m.attr("STATE8BIT_QBLOCK") = math::kQBlock;
  m.attr("STATE8BIT_SIGNED_CODES") = static_cast<int64_t>(math::kSignedCodes);
  m.attr("STATE8BIT_UNSIGNED_CODES") = static_cast<int64_t>(math::kUnsignedCodes);
  m.attr("STATE8BIT_SIGNED_POWER") = math::kSignedPower;
  m.attr("STATE8BIT_UNSIGNED_POWER") = math::kUnsignedPower;
  // memkern/ops/linear_cross_entropy.py (block_sizes and its twin lce::block_sizes)
  m.attr("LCE_MIN_BLOCK_BYTES") = lce::kMinBlockBytes;
  m.attr("LCE_ROW_ALIGN") = lce::kRowAlign;
  m.attr("LCE_CLASS_ALIGN") = lce::kClassAlign;
  m.attr("LCE_CHUNK_ENV") = lce::kChunkEnv;
  m.attr("LCE_VOCAB_BLOCK_ENV") = lce::kVocabBlockEnv;
  // memkern/kernels/row_stats.py (the cross-entropy rows op's per-row statistics)
  m.attr("CE_ROW_ENTROPY") = cross_entropy::kRowEntropy;
  m.attr("CE_ROW_IS_TOP1") = cross_entropy::kRowIsTop1;
  m.attr("CE_ROW_MEAN_LOGIT") = cross_entropy::kRowMeanLogit;
  m.attr("CE_ENTROPY_ROW") = cross_entropy::kEntropyRow;
  m.attr("CE_IS_TOP1_ROW") = cross_entropy::kIsTop1Row;
  m.attr("CE_MEAN_LOGIT_ROW") = cross_entropy::kMeanLogitRow;
}

}  // namespace memkern
