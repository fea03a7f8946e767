// Keras/TensorFlow output size and padding of one spatial dimension of a
// Conv2D or MaxPool2D window. CUDA-free so that it is tested without a GPU.
//   valid: out = (in - kernel) / stride + 1, no padding;
//   same:  out = ceil(in / stride), total = max((out - 1) * stride + kernel - in, 0),
//          before = total / 2, after = total - before (the extra row goes to
//          the bottom/right, as in TF; cuDNN only pads symmetrically).
#ifndef PSFLOW_WORKER_CUDA_WINDOW_GEOMETRY_H_
#define PSFLOW_WORKER_CUDA_WINDOW_GEOMETRY_H_

#include "absl/status/statusor.h"

namespace psflow::worker::cuda_internal {

struct WindowGeometry {
  int out = 0;
  int pad_before = 0;
  int pad_after = 0;
  bool symmetric() const { return pad_before == pad_after; }
  bool padded() const { return pad_before > 0 || pad_after > 0; }
};

// INVALID_ARGUMENT when a size is not positive or a valid window does not fit.
absl::StatusOr<WindowGeometry> ComputeWindow(int in, int kernel, int stride, bool same_padding);

}  // namespace psflow::worker::cuda_internal

#endif  // PSFLOW_WORKER_CUDA_WINDOW_GEOMETRY_H_
