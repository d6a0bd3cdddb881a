// The optimizer step counter of the flat-buffer optimizer steps (adamw.cuh, sgd.cuh and their
// 8-bit variants).
#pragma once

#include "common.cuh"

namespace memkern::device {

// Advances the optimizer step counter. A separate launch on the same stream, so that every
// block of the update kernel has read the old value before it changes.
__global__ void advance_step_kernel(float* step, const float* found_inf) {
  if (!step_skipped(found_inf)) {
    *step += 1.0f;
  }
}

}  // namespace memkern::device
