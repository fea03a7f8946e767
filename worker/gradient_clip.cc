#include "worker/gradient_clip.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace psflow::worker {
namespace {

double SumOfSquares(const float* g, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(g[i]) * g[i];
  return sum;
}

// The L2 norm as Keras's float32 tensor holds it.
float Norm(double sum_of_squares) { return static_cast<float>(std::sqrt(sum_of_squares)); }

}  // namespace

absl::Status ValidateClipOptions(const ClipOptions& o) {
  const struct {
    const char* flag;
    double value;
  } fields[] = {
      {"clipnorm", o.clipnorm}, {"clipvalue", o.clipvalue}, {"global_clipnorm", o.global_clipnorm}};
  int set = 0;
  for (const auto& f : fields) {
    // Written so that NaN fails; the range check first (a double beyond
    // float's range does not convert).
    if (!(f.value >= 0 && f.value <= std::numeric_limits<float>::max() &&
          (f.value == 0 || static_cast<float>(f.value) > 0))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--%s=%g; expected 0 (off) or a finite value > 0 (also as a float32)", f.flag, f.value));
    }
    set += f.value > 0;
  }
  if (set > 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--clipnorm=%g, --clipvalue=%g and --global_clipnorm=%g: at most one may be set, as in "
        "Keras",
        o.clipnorm, o.clipvalue, o.global_clipnorm));
  }
  return absl::OkStatus();
}

void ClipGradients(const ClipOptions& o, absl::Span<float* const> grads,
                   absl::Span<const int64_t> sizes) {
  if (o.clipnorm > 0) {
    // Keras: l2norm = sqrt(sum(g^2)) (0 where the sum is 0), then
    // g * clipnorm / maximum(l2norm, clipnorm), each rounded.
    const float clip = static_cast<float>(o.clipnorm);
    for (size_t v = 0; v < grads.size(); ++v) {
      float* g = grads[v];
      const float norm = Norm(SumOfSquares(g, sizes[v]));
      // As TensorFlow's maximum, a NaN norm gives NaN.
      const float denominator = (norm > clip || norm != norm) ? norm : clip;
      for (int64_t i = 0; i < sizes[v]; ++i) g[i] = (g[i] * clip) / denominator;
    }
  } else if (o.global_clipnorm > 0) {
    // Keras: scale = clip * minimum(1 / norm, 1 / clip) + (norm - norm).
    const float clip = static_cast<float>(o.global_clipnorm);
    double sum = 0;
    for (size_t v = 0; v < grads.size(); ++v) sum += SumOfSquares(grads[v], sizes[v]);
    const float norm = Norm(sum);
    // 1 / clip is Python's (double) division there, rounded where it meets
    // the float32 tensor.
    const float inverse = 1.0f / norm, inverse_clip = static_cast<float>(1.0 / o.global_clipnorm);
    const float smaller = (inverse < inverse_clip || inverse != inverse) ? inverse : inverse_clip;
    const float scale = clip * smaller + (norm - norm);
    for (size_t v = 0; v < grads.size(); ++v) {
      for (int64_t i = 0; i < sizes[v]; ++i) grads[v][i] = grads[v][i] * scale;
    }
  } else if (o.clipvalue > 0) {
    const float hi = static_cast<float>(o.clipvalue), lo = -hi;
    for (size_t v = 0; v < grads.size(); ++v) {
      float* g = grads[v];
      // NaN stays NaN (TensorFlow's clip_by_value).
      for (int64_t i = 0; i < sizes[v]; ++i) g[i] = g[i] < lo ? lo : g[i] > hi ? hi : g[i];
    }
  }
}

}  // namespace psflow::worker
