// Checks on float32 tensors shared by the PS (which rejects bad gradients)
// and the client (which refuses to send them).
#ifndef PSFLOW_COMMON_TENSOR_CHECKS_H_
#define PSFLOW_COMMON_TENSOR_CHECKS_H_

#include <cstdint>
#include <cstring>

namespace psflow {

// Index of the first NaN or Inf in data[0, n), or -1. `data` may be
// unaligned. The first pass is a branch-free bit test that vectorizes.
inline int64_t FirstNonFinite(const void* data, int64_t n) {
  const char* bytes = static_cast<const char*>(data);
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, bytes + 4 * i, 4);
    any |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  if (!any) return -1;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, bytes + 4 * i, 4);
    if ((bits & 0x7f800000u) == 0x7f800000u) return i;
  }
  return -1;
}

}  // namespace psflow

#endif  // PSFLOW_COMMON_TENSOR_CHECKS_H_
