// Gradient clipping before a push, as Keras 3's optimizers clip before they
// apply (their clipnorm, clipvalue and global_clipnorm arguments). A shard
// sees parts of variables from many workers, so the whole gradient of one
// step exists only on the worker that computed it: clipping is the
// worker's (docs/PROTOCOL.md, "The optimizers").
#ifndef PSFLOW_WORKER_GRADIENT_CLIP_H_
#define PSFLOW_WORKER_GRADIENT_CLIP_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace psflow::worker {

// At most one of the three is set (> 0), as Keras allows; 0 is off.
struct ClipOptions {
  // Each variable's gradient g becomes g * clipnorm / max(|g|, clipnorm).
  double clipnorm = 0;
  // Each element is clipped to [-clipvalue, clipvalue].
  double clipvalue = 0;
  // Every gradient is scaled by clip * min(1 / n, 1 / clip), n the norm of
  // all of them together.
  double global_clipnorm = 0;

  bool enabled() const { return clipnorm > 0 || clipvalue > 0 || global_clipnorm > 0; }
};

// INVALID_ARGUMENT naming the flag: a value other than 0 outside float32's
// normal range (so that 1 / value is a float32 too), or more than one set.
absl::Status ValidateClipOptions(const ClipOptions& options);

// Clips the gradients in place: grads[i] holds sizes[i] floats. The
// elementwise arithmetic is float32 in Keras's order; the sums of squares
// are taken in double (TensorFlow sums float32 in an order of its own, so
// a norm, and what it scales, may differ from Keras's in the last bits).
// Two cases differ more:
// * a norm that is not finite (a NaN or Inf in the gradient): the
//   gradient (clipnorm: that variable's) is left as it is, where Keras
//   makes it NaN, so that the push's check names the element that is not
//   finite (or the shards apply it as it came, where they allow such
//   gradients);
// * a sum of squares beyond float32 (a norm above about 1.8e19): Keras's
//   float32 sum overflows and its clip gives 0 (clipnorm) or NaN
//   (global_clipnorm); here the gradient is clipped by its norm.
void ClipGradients(const ClipOptions& options, absl::Span<float* const> grads,
                   absl::Span<const int64_t> sizes);

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_GRADIENT_CLIP_H_
