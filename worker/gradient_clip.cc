#include "worker/gradient_clip.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/kernel_clones.h"

namespace psflow::worker {
namespace {

// The sum of g's squares in double, over eight running sums (so that the
// loop vectorizes: one order of additions would chain every element).
PSFLOW_KERNEL_CLONES
double SumOfSquares(const float* __restrict g, int64_t n) {
  double sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) sums[j] += static_cast<double>(g[i + j]) * g[i + j];
  }
  for (; i < n; ++i) sums[0] += static_cast<double>(g[i]) * g[i];
  return ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
}

// g * numerator / denominator, each rounded, as Keras's clip by norm.
PSFLOW_KERNEL_CLONES
void ScaleByRatio(float* __restrict g, int64_t n, float numerator, float denominator) {
  for (int64_t i = 0; i < n; ++i) g[i] = (g[i] * numerator) / denominator;
}

PSFLOW_KERNEL_CLONES
void Scale(float* __restrict g, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] * scale;
}

// NaN stays NaN (TensorFlow's clip_by_value).
PSFLOW_KERNEL_CLONES
void ClipElements(float* __restrict g, int64_t n, float lo, float hi) {
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] < lo ? lo : g[i] > hi ? hi : g[i];
}

#undef PSFLOW_KERNEL_CLONES

// The L2 norm of a sum of squares as Keras's float32 tensor holds it, or
// infinity where it is beyond float32 or not a number.
float Norm(double sum_of_squares) {
  const double norm = std::sqrt(sum_of_squares);
  return norm <= std::numeric_limits<float>::max() ? static_cast<float>(norm)
                                                   : std::numeric_limits<float>::infinity();
}

}  // namespace

absl::Status ValidateClipOptions(const ClipOptions& o) {
  const struct {
    const char* flag;
    double value;
  } fields[] = {
      {"clipnorm", o.clipnorm}, {"clipvalue", o.clipvalue}, {"global_clipnorm", o.global_clipnorm}};
  int set = 0;
  for (const auto& f : fields) {
    // Written so that NaN fails. From float32's least normal value, so that
    // 1 / clip is a float32 too.
    constexpr double kLeast = std::numeric_limits<float>::min();
    constexpr double kMost = std::numeric_limits<float>::max();
    if (!(f.value == 0 || (f.value >= kLeast && f.value <= kMost))) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--%s=%g; expected 0 (off) or a finite value > 0 (from %g to %g)", f.flag,
                          f.value, kLeast, kMost));
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
      const float norm = Norm(SumOfSquares(grads[v], sizes[v]));
      if (!std::isfinite(norm)) continue;  // left for the push's check (header)
      ScaleByRatio(grads[v], sizes[v], clip, norm > clip ? norm : clip);
    }
  } else if (o.global_clipnorm > 0) {
    // Keras: scale = clip * minimum(1 / norm, 1 / clip) (+ norm - norm,
    // which is 0 for a finite norm). 1 / clip is Python's (double)
    // division there, rounded where it meets the float32 tensor.
    const float clip = static_cast<float>(o.global_clipnorm);
    double sum = 0;
    for (size_t v = 0; v < grads.size(); ++v) sum += SumOfSquares(grads[v], sizes[v]);
    const float norm = Norm(sum);
    if (!std::isfinite(norm)) return;  // left for the push's check (header)
    const float inverse = 1.0f / norm, inverse_clip = static_cast<float>(1.0 / o.global_clipnorm);
    const float scale = clip * (inverse < inverse_clip ? inverse : inverse_clip);
    for (size_t v = 0; v < grads.size(); ++v) Scale(grads[v], sizes[v], scale);
  } else if (o.clipvalue > 0) {
    const float hi = static_cast<float>(o.clipvalue);
    for (size_t v = 0; v < grads.size(); ++v) ClipElements(grads[v], sizes[v], -hi, hi);
  }
}

}  // namespace psflow::worker
