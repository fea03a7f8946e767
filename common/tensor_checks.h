// Checks on float32 tensors shared by the PS (which rejects bad gradients)
// and the client (which refuses to send them).
#ifndef PSFLOW_COMMON_TENSOR_CHECKS_H_
#define PSFLOW_COMMON_TENSOR_CHECKS_H_

#include <cstdint>

namespace psflow {

// Index of the first NaN or Inf in data[0, n), or -1. `data` may be
// unaligned. Runs at memory speed: a branch-free bit test over the whole
// range, compiled for AVX-512, AVX2 and baseline x86-64 (chosen at load
// time), then a second pass only when something was found.
int64_t FirstNonFinite(const void* data, int64_t n);

}  // namespace psflow

#endif  // PSFLOW_COMMON_TENSOR_CHECKS_H_
