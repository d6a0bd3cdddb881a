// The block sizes of memkern's linear cross-entropy: the C++ twin of
// memkern.ops.linear_cross_entropy.block_sizes (its constants are exported by memkern._C and
// compared with the Python ones at import; tests/test_nn_linear_cross_entropy.py compares the
// two functions).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <utility>

namespace memkern::lce {

constexpr int64_t kMinBlockBytes = int64_t{8} << 20;  // MIN_BLOCK_BYTES
constexpr int64_t kRowAlign = 64;                      // ROW_ALIGN
constexpr int64_t kClassAlign = 128;                   // CLASS_ALIGN
constexpr const char* kChunkEnv = "MEMKERN_LCE_CHUNK";
constexpr const char* kVocabBlockEnv = "MEMKERN_LCE_VOCAB_BLOCK";

// (tokens per forward chunk, classes per backward block); see block_sizes' docstring.
std::pair<int64_t, int64_t> block_sizes(int64_t n_tokens, int64_t n_classes, int64_t hidden,
                                        int64_t element_size, bool weight_grad, bool split);

// Adds the layer's Python entries to the module memkern._C: linear_cross_entropy_layer (the
// eager call of memkern.nn.linear_cross_entropy) and linear_cross_entropy_block_sizes.
void add_entries(pybind11::module_& m);

}  // namespace memkern::lce
