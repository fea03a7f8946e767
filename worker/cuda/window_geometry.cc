#include "worker/cuda/window_geometry.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace psflow::worker::cuda_internal {

absl::StatusOr<WindowGeometry> ComputeWindow(int in, int kernel, int stride, bool same_padding) {
  if (in < 1 || kernel < 1 || stride < 1) {
    return absl::InvalidArgumentError(absl::StrCat("window: input size ", in, ", kernel ", kernel,
                                                   " and stride ", stride,
                                                   " must all be positive"));
  }
  WindowGeometry g;
  if (!same_padding) {
    if (in < kernel) {
      return absl::InvalidArgumentError(absl::StrCat("window: a valid ", kernel,
                                                     "-wide window does not fit an input of ", in));
    }
    g.out = (in - kernel) / stride + 1;
    return g;
  }
  g.out = (in + stride - 1) / stride;
  const int total = std::max((g.out - 1) * stride + kernel - in, 0);
  g.pad_before = total / 2;
  g.pad_after = total - g.pad_before;
  return g;
}

}  // namespace psflow::worker::cuda_internal
