// Checks on float32 tensors shared by the PS (which rejects bad gradients)
// and the client (which refuses to send them).
#ifndef PSFLOW_COMMON_TENSOR_CHECKS_H_
#define PSFLOW_COMMON_TENSOR_CHECKS_H_

#include <cstdint>
#include <vector>

namespace psflow {

// Index of the first NaN or Inf in data[0, n), or -1. `data` may be
// unaligned. Runs at memory speed: a branch-free bit test over the whole
// range, compiled for AVX-512, AVX2 and baseline x86-64 (chosen at load
// time), then a second pass only when something was found.
int64_t FirstNonFinite(const void* data, int64_t n);

struct FloatRange {
  const float* data;
  int64_t n;
};

// Whether any of `tensors` holds a NaN or Inf, scanned by up to `threads`
// threads (the caller's among them), each given at least `min_part`
// elements of the tensors laid end to end (by default 16 MiB, where the
// scan takes about a millisecond and a thread's start is negligible). One
// core does not reach the machine's memory bandwidth, and a client's scan
// is on its push's critical path. A thread that cannot be started leaves
// its part to the caller.
bool AnyNonFinite(const std::vector<FloatRange>& tensors, int threads,
                  int64_t min_part = int64_t{1} << 22);

}  // namespace psflow

#endif  // PSFLOW_COMMON_TENSOR_CHECKS_H_
