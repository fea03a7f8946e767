#include "ps_server/optimizer.h"

#include <xmmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/kernel_clones.h"
#include "re2/re2.h"

namespace psflow::server {
namespace {

// Each kernel is compiled three times (AVX-512, x86-64-v3 = AVX2+FMA, and
// baseline SSE2); the dynamic loader picks the best clone for the CPU it runs
// on, so the binary needs no -march flag. The loops are plain so that GCC
// vectorizes them (-O3; -fno-math-errno lets std::sqrt become vsqrtps); the
// __restrict qualifiers tell it the arrays do not overlap. They are memory
// bound: each element is read once and written once.
// Gradients come straight out of received messages at any byte alignment,
// so the kernels read them with memcpy (an unaligned vector load), never
// through a float pointer.
inline float LoadFloat(const char* g, int64_t i) {
  float x;
  std::memcpy(&x, g + 4 * i, 4);
  return x;
}

PSFLOW_KERNEL_CLONES
void AdamKernel(float* __restrict p, float* __restrict m, float* __restrict v,
                const char* __restrict g, int64_t n, float alpha, float one_minus_beta_1,
                float one_minus_beta_2, float epsilon) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = LoadFloat(g, i);
    const float mi = m[i] + (gi - m[i]) * one_minus_beta_1;
    const float vi = v[i] + (gi * gi - v[i]) * one_minus_beta_2;
    m[i] = mi;
    v[i] = vi;
    p[i] -= (mi * alpha) / (std::sqrt(vi) + epsilon);
  }
}

// Adam with AMSGrad: the update divides by the largest second moment seen
// (Keras: v_hat = maximum(v_hat, v), then v_hat in v's place).
PSFLOW_KERNEL_CLONES
void AmsgradKernel(float* __restrict p, float* __restrict m, float* __restrict v,
                   float* __restrict v_hat, const char* __restrict g, int64_t n, float alpha,
                   float one_minus_beta_1, float one_minus_beta_2, float epsilon) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = LoadFloat(g, i);
    const float mi = m[i] + (gi - m[i]) * one_minus_beta_1;
    const float vi = v[i] + (gi * gi - v[i]) * one_minus_beta_2;
    // As TensorFlow's maximum, a NaN on either side gives NaN (only where
    // NaN gradients are allowed).
    const float hi = (vi > v_hat[i] || vi != vi) ? vi : v_hat[i];
    m[i] = mi;
    v[i] = vi;
    v_hat[i] = hi;
    p[i] -= (mi * alpha) / (std::sqrt(hi) + epsilon);
  }
}

// Keras 3's weight decay, before the update: p = p - p * wd * lr.
PSFLOW_KERNEL_CLONES
void WeightDecayKernel(float* __restrict p, int64_t n, float wd, float lr) {
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] - p[i] * wd * lr;
}

PSFLOW_KERNEL_CLONES
void SgdKernel(float* __restrict p, const char* __restrict g, int64_t n, float lr) {
  for (int64_t i = 0; i < n; ++i) p[i] -= lr * LoadFloat(g, i);
}

PSFLOW_KERNEL_CLONES
void SgdMomentumKernel(float* __restrict p, float* __restrict m, const char* __restrict g,
                       int64_t n, float lr, float momentum) {
  for (int64_t i = 0; i < n; ++i) {
    const float mi = momentum * m[i] - lr * LoadFloat(g, i);
    m[i] = mi;
    p[i] += mi;
  }
}

PSFLOW_KERNEL_CLONES
void SgdNesterovKernel(float* __restrict p, float* __restrict m, const char* __restrict g,
                       int64_t n, float lr, float momentum) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = LoadFloat(g, i);
    const float mi = momentum * m[i] - lr * gi;
    m[i] = mi;
    p[i] += momentum * mi - lr * gi;
  }
}

PSFLOW_KERNEL_CLONES
void AdagradKernel(float* __restrict p, float* __restrict acc, const char* __restrict g,
                   int64_t n, float lr, float epsilon) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = LoadFloat(g, i);
    const float ai = acc[i] + gi * gi;
    acc[i] = ai;
    p[i] -= (lr * gi) / std::sqrt(ai + epsilon);
  }
}

// Lion: the sign of an interpolation of m and g, then m's update. sign is
// TensorFlow's: +0 for either zero, NaN for NaN.
PSFLOW_KERNEL_CLONES
void LionKernel(float* __restrict p, float* __restrict m, const char* __restrict g, int64_t n,
                float lr, float beta_1, float one_minus_beta_1, float beta_2,
                float one_minus_beta_2) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = LoadFloat(g, i);
    const float c = m[i] * beta_1 + gi * one_minus_beta_1;
    const float sign = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : c != c ? c : 0.0f;
    p[i] -= lr * sign;
    m[i] = m[i] * beta_2 + gi * one_minus_beta_2;
  }
}

// RMSprop. mom (the momentum slot) and avg (the mean gradient, centered)
// may be null; the loop is the same for the four combinations, and GCC
// unswitches it on the two tests (-O3).
PSFLOW_KERNEL_CLONES
void RmspropKernel(float* __restrict p, float* __restrict v, float* __restrict mom,
                   float* __restrict avg, const char* __restrict g, int64_t n, float lr, float rho,
                   float one_minus_rho, float epsilon, float momentum) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = LoadFloat(g, i);
    const float vi = rho * v[i] + one_minus_rho * (gi * gi);
    v[i] = vi;
    float denominator;
    if (avg != nullptr) {
      const float ai = rho * avg[i] + one_minus_rho * gi;
      avg[i] = ai;
      denominator = vi - ai * ai + epsilon;
    } else {
      denominator = vi + epsilon;
    }
    const float increment = (lr * gi) / std::sqrt(denominator);
    if (mom != nullptr) {
      const float ui = momentum * mom[i] + increment;
      mom[i] = ui;
      p[i] -= ui;
    } else {
      p[i] -= increment;
    }
  }
}

#undef PSFLOW_KERNEL_CLONES

// Flushes denormal results to zero and reads denormal inputs as zero while
// it lives, then puts the thread's floating-point mode back: TensorFlow runs
// every CPU kernel so (port::ScopedFlushDenormal), and so Keras's optimizer
// state never holds a denormal. Without it a moment decaying under zero
// gradients (a dead ReLU unit) stopped at a few times 2^-149 instead of 0,
// and each update of such an element took the CPU's slow path (about 14x
// slower on these Xeons).
class FlushDenormalsScope {
 public:
#if defined(__SSE__)
  FlushDenormalsScope() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kModes); }
  // Only the two modes go back: the exception flags raised meanwhile stay.
  ~FlushDenormalsScope() { _mm_setcsr((_mm_getcsr() & ~kModes) | (saved_ & kModes)); }

 private:
  static constexpr unsigned kModes = 0x8000 | 0x0040;  // flush to zero, denormals are zero
  const unsigned saved_;
#else
#error "psflow's optimizers need x86 (SSE) to flush denormals as TensorFlow does"
#endif
  FlushDenormalsScope(const FlushDenormalsScope&) = delete;
  FlushDenormalsScope& operator=(const FlushDenormalsScope&) = delete;
};

// The scheduled rate as the float32 the kernels use. An exponential decay
// with decay_rate > 1 (Keras allows it) can grow past the float range, where
// the conversion would be undefined: it becomes +inf, as Keras's float32
// schedule does.
float ScheduledRateAsFloat(const OptimizerOptions& o, int64_t step) {
  const double lr = ScheduledLearningRate(o, step);
  return lr > std::numeric_limits<float>::max() ? std::numeric_limits<float>::infinity()
                                                : static_cast<float>(lr);
}

std::string ScheduleSuffix(const LearningRateSchedule& s) {
  const char* staircase = s.staircase ? "true" : "false";
  switch (s.kind) {
    case LearningRateSchedule::Kind::kConstant:
      return "";
    case LearningRateSchedule::Kind::kCosine:
      if (s.warmup_target.has_value()) {
        return absl::StrFormat(
            ", schedule=cosine(decay_steps=%d, alpha=%g, warmup_steps=%d, warmup_target=%g)",
            s.decay_steps, s.alpha, s.warmup_steps, *s.warmup_target);
      }
      return absl::StrFormat(", schedule=cosine(decay_steps=%d, alpha=%g)", s.decay_steps, s.alpha);
    case LearningRateSchedule::Kind::kExponential:
      return absl::StrFormat(", schedule=exponential(decay_steps=%d, decay_rate=%g, staircase=%s)",
                             s.decay_steps, s.decay_rate, staircase);
    case LearningRateSchedule::Kind::kPolynomial:
      return absl::StrFormat(
          ", schedule=polynomial(decay_steps=%d, end_learning_rate=%g, power=%g, cycle=%s)",
          s.decay_steps, s.end_learning_rate, s.power, s.cycle ? "true" : "false");
    case LearningRateSchedule::Kind::kInverseTime:
      return absl::StrFormat(", schedule=inverse_time(decay_steps=%d, decay_rate=%g, staircase=%s)",
                             s.decay_steps, s.decay_rate, staircase);
    case LearningRateSchedule::Kind::kPiecewiseConstant:
      return absl::StrFormat(", schedule=piecewise_constant(boundaries=[%s], values=[%s])",
                             absl::StrJoin(s.boundaries, ", "),
                             absl::StrJoin(s.values, ", ", [](std::string* out, double v) {
                               absl::StrAppendFormat(out, "%g", v);
                             }));
  }
  return ", schedule=unknown";
}

// ", weight_decay=..." (with the excluded patterns) when the optimizer decays.
std::string WeightDecaySuffix(const OptimizerOptions& o) {
  if (o.weight_decay == 0.0) return "";
  std::string out = absl::StrFormat(", weight_decay=%g", o.weight_decay);
  if (!o.exclude_from_weight_decay.empty()) {
    // Quoted: a pattern the flag cut at a comma ("a{1", "3}") shows as such.
    absl::StrAppend(&out, ", exclude_from_weight_decay=[",
                    absl::StrJoin(o.exclude_from_weight_decay, ", ",
                                  [](std::string* out, const std::string& pattern) {
                                    absl::StrAppend(out, "\"", pattern, "\"");
                                  }),
                    "]");
  }
  return out;
}

// What every rule does around its update, as TensorFlow and Keras 3 do:
// denormals flushed, the learning rate of this update, and the decoupled
// weight decay before the update, with the same rate (ops.cast of
// weight_decay, a Python float, rounds it to float32).
class Rule : public Optimizer {
 public:
  explicit Rule(const OptimizerOptions& o) : o_(o) {}
  void Apply(int64_t step, float* param, float* const* slots, const void* grad,
             int64_t n) const final {
    const FlushDenormalsScope flush_denormals;
    const float lr = ScheduledRateAsFloat(o_, step);
    if (o_.weight_decay != 0.0) {
      WeightDecayKernel(param, n, static_cast<float>(o_.weight_decay), lr);
    }
    Update(step, lr, param, slots, static_cast<const char*>(grad), n);
  }

 protected:
  // The rule itself, on the (decayed) parameters; `lr` is the float32 rate.
  virtual void Update(int64_t step, float lr, float* param, float* const* slots, const char* grad,
                      int64_t n) const = 0;
  const OptimizerOptions o_;
};

class Adam final : public Rule {
 public:
  explicit Adam(const OptimizerOptions& o) : Rule(o) {}
  int num_slots() const override { return o_.amsgrad ? 3 : 2; }
  float slot_initial_value(int) const override { return 0.0f; }
  std::string DebugString() const override {
    return absl::StrFormat("adam(learning_rate=%g, beta_1=%g, beta_2=%g, epsilon=%g%s%s%s)",
                           o_.learning_rate, o_.beta_1, o_.beta_2, o_.epsilon,
                           o_.amsgrad ? ", amsgrad=true" : "", WeightDecaySuffix(o_),
                           ScheduleSuffix(o_.schedule));
  }
  void Update(int64_t step, float lr, float* param, float* const* slots, const char* grad,
              int64_t n) const override {
    // Bias correction folded into the step size, in float32 and in Keras's
    // order of operations: local_step = float(iterations + 1),
    // beta^local_step with float beta, alpha = lr * sqrt(1 - beta_2^t) /
    // (1 - beta_1^t). 1 - beta is Python (double) arithmetic there, rounded
    // when it meets the float32 tensor.
    const float t = static_cast<float>(step);
    const float beta_1_power = std::pow(static_cast<float>(o_.beta_1), t);
    const float beta_2_power = std::pow(static_cast<float>(o_.beta_2), t);
    const float alpha = lr * std::sqrt(1.0f - beta_2_power) / (1.0f - beta_1_power);
    const float one_minus_beta_1 = static_cast<float>(1.0 - o_.beta_1);
    const float one_minus_beta_2 = static_cast<float>(1.0 - o_.beta_2);
    const float epsilon = static_cast<float>(o_.epsilon);
    if (o_.amsgrad) {
      AmsgradKernel(param, slots[0], slots[1], slots[2], grad, n, alpha, one_minus_beta_1,
                    one_minus_beta_2, epsilon);
    } else {
      AdamKernel(param, slots[0], slots[1], grad, n, alpha, one_minus_beta_1, one_minus_beta_2,
                 epsilon);
    }
  }
};

class Sgd final : public Rule {
 public:
  explicit Sgd(const OptimizerOptions& o) : Rule(o) {}
  int num_slots() const override { return o_.momentum > 0.0 ? 1 : 0; }
  float slot_initial_value(int) const override { return 0.0f; }
  std::string DebugString() const override {
    return absl::StrFormat("sgd(learning_rate=%g, momentum=%g, nesterov=%s%s%s)", o_.learning_rate,
                           o_.momentum, o_.nesterov ? "true" : "false", WeightDecaySuffix(o_),
                           ScheduleSuffix(o_.schedule));
  }
  void Update(int64_t, float lr, float* param, float* const* slots, const char* grad,
              int64_t n) const override {
    const float momentum = static_cast<float>(o_.momentum);
    if (o_.momentum == 0.0) {
      // Keras skips the momentum slot entirely here, nesterov or not.
      SgdKernel(param, grad, n, lr);
    } else if (o_.nesterov) {
      SgdNesterovKernel(param, slots[0], grad, n, lr, momentum);
    } else {
      SgdMomentumKernel(param, slots[0], grad, n, lr, momentum);
    }
  }
};

class Adagrad final : public Rule {
 public:
  explicit Adagrad(const OptimizerOptions& o) : Rule(o) {}
  int num_slots() const override { return 1; }
  float slot_initial_value(int) const override {
    return static_cast<float>(o_.initial_accumulator_value);
  }
  std::string DebugString() const override {
    return absl::StrFormat(
        "adagrad(learning_rate=%g, initial_accumulator_value=%g, epsilon=%g%s%s)", o_.learning_rate,
        o_.initial_accumulator_value, o_.epsilon, WeightDecaySuffix(o_),
        ScheduleSuffix(o_.schedule));
  }
  void Update(int64_t, float lr, float* param, float* const* slots, const char* grad,
              int64_t n) const override {
    AdagradKernel(param, slots[0], grad, n, lr, static_cast<float>(o_.epsilon));
  }
};

class Rmsprop final : public Rule {
 public:
  explicit Rmsprop(const OptimizerOptions& o) : Rule(o) {}
  int num_slots() const override { return 1 + (o_.momentum > 0.0) + o_.centered; }
  float slot_initial_value(int) const override { return 0.0f; }
  std::string DebugString() const override {
    return absl::StrFormat(
        "rmsprop(learning_rate=%g, rho=%g, momentum=%g, epsilon=%g, centered=%s%s%s)",
        o_.learning_rate, o_.rho, o_.momentum, o_.epsilon, o_.centered ? "true" : "false",
        WeightDecaySuffix(o_), ScheduleSuffix(o_.schedule));
  }
  void Update(int64_t, float lr, float* param, float* const* slots, const char* grad,
              int64_t n) const override {
    // rho and momentum meet float32 tensors as Python floats (rounded);
    // 1 - rho is Python arithmetic first.
    int next = 1;
    float* mom = o_.momentum > 0.0 ? slots[next++] : nullptr;
    float* avg = o_.centered ? slots[next++] : nullptr;
    RmspropKernel(param, slots[0], mom, avg, grad, n, lr, static_cast<float>(o_.rho),
                  static_cast<float>(1.0 - o_.rho), static_cast<float>(o_.epsilon),
                  static_cast<float>(o_.momentum));
  }
};

class Lion final : public Rule {
 public:
  explicit Lion(const OptimizerOptions& o) : Rule(o) {}
  int num_slots() const override { return 1; }
  float slot_initial_value(int) const override { return 0.0f; }
  std::string DebugString() const override {
    return absl::StrFormat("lion(learning_rate=%g, beta_1=%g, beta_2=%g%s%s)", o_.learning_rate,
                           o_.beta_1, o_.beta_2, WeightDecaySuffix(o_),
                           ScheduleSuffix(o_.schedule));
  }
  void Update(int64_t, float lr, float* param, float* const* slots, const char* grad,
              int64_t n) const override {
    // Keras casts the betas to float32 first: 1 - beta is float32 here,
    // unlike Adam's.
    const float beta_1 = static_cast<float>(o_.beta_1);
    const float beta_2 = static_cast<float>(o_.beta_2);
    LionKernel(param, slots[0], grad, n, lr, beta_1, 1.0f - beta_1, beta_2, 1.0f - beta_2);
  }
};

// The comparisons are written so that NaN fails them. The options are
// doubles, as Keras's are; the kernels round them to float32, so a value that
// is fine as a double but becomes 0 or infinite in float32 (1e-50, 1e300) is
// refused too, with the value as given.
bool FinitePositiveInFloat(double value) {
  // The range check comes first: converting a double beyond the float range
  // is undefined behaviour.
  return value > 0.0 && value <= std::numeric_limits<float>::max() &&
         static_cast<float>(value) > 0.0f;
}

absl::Status CheckPositive(const char* field, double value) {
  if (FinitePositiveInFloat(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "optimizer option %s (--%s) must be finite and > 0 (also as a float32, from %g to %g), got "
      "%g",
      field, field, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
      value));
}

absl::Status CheckNonNegative(const char* field, double value) {
  if (value == 0.0 || FinitePositiveInFloat(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "optimizer option %s (--%s) must be finite and >= 0 (also as a float32), got %g", field,
      field, value));
}

// [0, 1] (momentum, RMSprop's rho, Lion's beta_2).
absl::Status CheckUnitInterval(const char* field, double value) {
  if (value >= 0.0 && value <= 1.0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("optimizer option %s (--%s) must be in [0, 1], got %g", field, field, value));
}

// [0, 1), and below 1 also once rounded to float32 (0.99999999 is not).
absl::Status CheckBeta(const char* field, double value) {
  if (value >= 0.0 && value < 1.0 && static_cast<float>(value) < 1.0f) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "optimizer option %s (--%s) must be in [0, 1) (and below 1 as a float32, at most %.9g), got "
      "%.17g",
      field, field, static_cast<double>(std::nextafter(1.0f, 0.0f)), value));
}

const char* ScheduleName(LearningRateSchedule::Kind kind) {
  using Kind = LearningRateSchedule::Kind;
  switch (kind) {
    case Kind::kConstant:
      return "constant";
    case Kind::kCosine:
      return "cosine";
    case Kind::kExponential:
      return "exponential";
    case Kind::kPolynomial:
      return "polynomial";
    case Kind::kInverseTime:
      return "inverse_time";
    case Kind::kPiecewiseConstant:
      return "piecewise_constant";
  }
  return "unknown";
}

absl::Status ValidatePiecewise(const LearningRateSchedule& s) {
  if (s.boundaries.empty() || s.values.size() != s.boundaries.size() + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the piecewise_constant learning-rate schedule needs at least one boundary "
        "(--piecewise_boundaries) and one more value (--piecewise_values) than boundaries, got ",
        s.boundaries.size(), " boundaries and ", s.values.size(), " values"));
  }
  for (size_t i = 1; i < s.boundaries.size(); ++i) {
    if (s.boundaries[i] <= s.boundaries[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("piecewise_constant boundaries (--piecewise_boundaries) must increase, got ",
                       s.boundaries[i - 1], " then ", s.boundaries[i]));
    }
  }
  for (double v : s.values) {
    if (absl::Status st = CheckNonNegative("piecewise_values", v); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status ValidateSchedule(const LearningRateSchedule& s) {
  using Kind = LearningRateSchedule::Kind;
  if (s.kind == Kind::kConstant) return absl::OkStatus();
  if (std::string_view(ScheduleName(s.kind)) == "unknown") {
    return absl::InvalidArgumentError(absl::StrCat(
        "learning-rate schedule kind has unknown value ", static_cast<int>(s.kind)));
  }
  if (s.kind == Kind::kPiecewiseConstant) return ValidatePiecewise(s);
  if (s.decay_steps <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", ScheduleName(s.kind),
        " learning-rate schedule (--learning_rate_schedule) needs decay_steps (--decay_steps) > 0, "
        "got ",
        s.decay_steps));
  }
  switch (s.kind) {
    case Kind::kCosine:
      if (!(s.alpha >= 0.0 && s.alpha <= 1.0)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "cosine schedule alpha (--cosine_alpha) must be in [0, 1], got %g", s.alpha));
      }
      if (!s.warmup_target.has_value()) return absl::OkStatus();  // no warmup: not read
      if (s.warmup_steps < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cosine schedule warmup_steps (--warmup_steps) must be >= 0, got ", s.warmup_steps));
      }
      return CheckPositive("warmup_target", *s.warmup_target);
    case Kind::kExponential:
      return CheckPositive("decay_rate", s.decay_rate);
    case Kind::kInverseTime:
      return CheckNonNegative("decay_rate", s.decay_rate);
    case Kind::kPolynomial:
      if (absl::Status st = CheckNonNegative("end_learning_rate", s.end_learning_rate); !st.ok()) {
        return st;
      }
      return CheckNonNegative("power", s.power);
    default:
      return absl::OkStatus();
  }
}

// Each pattern compiles with RE2 (and is not empty), or the first that does
// not is named.
absl::StatusOr<std::vector<std::shared_ptr<const re2::RE2>>> CompileExcludePatterns(
    const std::vector<std::string>& patterns) {
  std::vector<std::shared_ptr<const re2::RE2>> compiled;
  for (const std::string& pattern : patterns) {
    if (pattern.empty()) {
      return absl::InvalidArgumentError(
          "optimizer option exclude_from_weight_decay (--exclude_from_weight_decay) has an empty "
          "pattern, which every name matches (a comma too many?)");
    }
    re2::RE2::Options options;
    options.set_log_errors(false);
    auto re = std::make_shared<const re2::RE2>(pattern, options);
    if (!re->ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer option exclude_from_weight_decay (--exclude_from_weight_decay): \"", pattern,
          "\" is not a valid regular expression (RE2: ", re->error(), ")"));
    }
    compiled.push_back(std::move(re));
  }
  return compiled;
}

absl::Status Validate(const OptimizerOptions& o) {
  // A schedule may rise from 0, as Keras's CosineDecay(0.0, ...,
  // warmup_target=...) and PolynomialDecay(0.0, ..., end_learning_rate=...)
  // do; piecewise_constant does not read the rate.
  using Schedule = LearningRateSchedule::Kind;
  const bool rises = (o.schedule.kind == Schedule::kCosine && o.schedule.warmup_target) ||
                     o.schedule.kind == Schedule::kPolynomial;
  if (o.schedule.kind != Schedule::kPiecewiseConstant) {
    if (absl::Status s = rises ? CheckNonNegative("learning_rate", o.learning_rate)
                               : CheckPositive("learning_rate", o.learning_rate);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = ValidateSchedule(o.schedule); !s.ok()) return s;
  if (absl::Status s = CheckNonNegative("weight_decay", o.weight_decay); !s.ok()) return s;
  switch (o.kind) {
    case OptimizerOptions::Kind::kAdam:
      if (absl::Status s = CheckBeta("beta_1", o.beta_1); !s.ok()) return s;
      if (absl::Status s = CheckBeta("beta_2", o.beta_2); !s.ok()) return s;
      return CheckPositive("epsilon", o.epsilon);
    case OptimizerOptions::Kind::kSgd:
      return CheckUnitInterval("momentum", o.momentum);
    case OptimizerOptions::Kind::kAdagrad:
      if (absl::Status s = CheckPositive("epsilon", o.epsilon); !s.ok()) return s;
      return CheckNonNegative("initial_accumulator_value", o.initial_accumulator_value);
    case OptimizerOptions::Kind::kLion:
      // Keras refuses beta_1 = 0 (the optimizer would be signSGD).
      if (!(o.beta_1 > 0.0 && o.beta_1 <= 1.0 && static_cast<float>(o.beta_1) > 0.0f)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "optimizer option beta_1 (--beta_1) must be in (0, 1] for lion, got %g", o.beta_1));
      }
      return CheckUnitInterval("beta_2", o.beta_2);
    case OptimizerOptions::Kind::kRmsprop:
      if (absl::Status s = CheckPositive("epsilon", o.epsilon); !s.ok()) return s;
      if (absl::Status s = CheckUnitInterval("rho", o.rho); !s.ok()) return s;
      return CheckUnitInterval("momentum", o.momentum);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "optimizer option kind has unknown value ", static_cast<int>(o.kind)));
}

}  // namespace

absl::StatusOr<OptimizerOptions::Kind> ParseOptimizerKind(std::string_view name) {
  if (name == "adam") return OptimizerOptions::Kind::kAdam;
  if (name == "sgd") return OptimizerOptions::Kind::kSgd;
  if (name == "adagrad") return OptimizerOptions::Kind::kAdagrad;
  if (name == "rmsprop") return OptimizerOptions::Kind::kRmsprop;
  if (name == "lion") return OptimizerOptions::Kind::kLion;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer \"", absl::string_view(name.data(), name.size()),
                   "\"; expected one of: adam, sgd, adagrad, rmsprop, lion"));
}

absl::StatusOr<OptimizerName> ParseOptimizerName(std::string_view name) {
  if (name == "adamw") return OptimizerName{OptimizerOptions::Kind::kAdam, 0.004};
  auto kind = ParseOptimizerKind(name);
  if (!kind.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown optimizer \"", absl::string_view(name.data(), name.size()),
                     "\"; expected one of: adam, adamw, sgd, adagrad, rmsprop, lion"));
  }
  return OptimizerName{*kind, 0.0};
}

std::string_view OptimizerKindName(OptimizerOptions::Kind kind) {
  switch (kind) {
    case OptimizerOptions::Kind::kAdam:
      return "adam";
    case OptimizerOptions::Kind::kSgd:
      return "sgd";
    case OptimizerOptions::Kind::kAdagrad:
      return "adagrad";
    case OptimizerOptions::Kind::kRmsprop:
      return "rmsprop";
    case OptimizerOptions::Kind::kLion:
      return "lion";
  }
  return "unknown";
}

double DefaultLearningRate(OptimizerOptions::Kind kind) {
  return kind == OptimizerOptions::Kind::kSgd ? 0.01 : 0.001;
}

double DefaultBeta2(OptimizerOptions::Kind kind) {
  return kind == OptimizerOptions::Kind::kLion ? 0.99 : 0.999;
}

absl::StatusOr<LearningRateSchedule::Kind> ParseScheduleKind(std::string_view name) {
  using Kind = LearningRateSchedule::Kind;
  for (Kind kind : {Kind::kConstant, Kind::kCosine, Kind::kExponential, Kind::kPolynomial,
                    Kind::kInverseTime, Kind::kPiecewiseConstant}) {
    if (name == ScheduleName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown learning-rate schedule \"", absl::string_view(name.data(), name.size()),
                   "\"; expected one of: constant, cosine, exponential, polynomial, inverse_time, "
                   "piecewise_constant"));
}

namespace {

// A schedule's parameter as Keras holds it: a float32 tensor (its Python
// float cast to the variable's dtype). Beyond the float range it stays as
// it is (the options' checks refuse such values).
double AsKerasFloat(double x) {
  return std::abs(x) <= std::numeric_limits<float>::max() ? static_cast<float>(x) : x;
}

}  // namespace

double ScheduledLearningRate(const OptimizerOptions& o, int64_t step) {
  using Kind = LearningRateSchedule::Kind;
  // The parameters are rounded to float32 as Keras's are, and the rest is
  // computed in double: with decay_rate 0.99999, rounding it only at the
  // end put the rate 1.4 % off Keras's after 100,000 steps.
  const double lr = AsKerasFloat(o.learning_rate);
  const LearningRateSchedule& s = o.schedule;
  const int64_t done_steps = std::max<int64_t>(step - 1, 0);
  if (s.kind == Kind::kPiecewiseConstant) {
    if (s.values.empty()) return lr;
    // values[i] from just after boundaries[i - 1] up to boundaries[i].
    const size_t i = std::lower_bound(s.boundaries.begin(), s.boundaries.end(), done_steps) -
                     s.boundaries.begin();
    return AsKerasFloat(s.values[std::min(i, s.values.size() - 1)]);
  }
  if (s.kind == Kind::kConstant || s.decay_steps <= 0) return lr;
  const double d = static_cast<double>(s.decay_steps);
  double done = static_cast<double>(done_steps);
  switch (s.kind) {
    case Kind::kCosine: {
      double from = lr;
      const double alpha = AsKerasFloat(s.alpha);
      if (s.warmup_target.has_value()) {
        const double target = AsKerasFloat(*s.warmup_target);
        const double w = static_cast<double>(s.warmup_steps);
        done = std::min(done, d + w);
        if (done < w) return (target - lr) * (done / w) + lr;
        done -= w;
        from = target;
      }
      const double fraction = std::min(done, d) / d;
      const double cosine = 0.5 * (1.0 + std::cos(M_PI * fraction));
      return from * ((1.0 - alpha) * cosine + alpha);
    }
    case Kind::kPolynomial: {
      const double end = AsKerasFloat(s.end_learning_rate);
      double span = d;
      if (s.cycle) {
        span = d * (done == 0.0 ? 1.0 : std::ceil(done / d));
      } else {
        done = std::min(done, d);
      }
      return (lr - end) * std::pow(1.0 - done / span, AsKerasFloat(s.power)) + end;
    }
    case Kind::kInverseTime:
    case Kind::kExponential: {
      const double rate = AsKerasFloat(s.decay_rate);
      double p = done / d;
      if (s.staircase) p = std::floor(p);
      return s.kind == Kind::kExponential ? lr * std::pow(rate, p) : lr / (1.0 + rate * p);
    }
    default:
      return lr;
  }
}

Optimizer::~Optimizer() = default;

bool Optimizer::DecaysVariable(std::string_view name) const {
  if (!decays_) return false;
  const re2::StringPiece text(name.data(), name.size());
  for (const auto& pattern : excluded_) {
    if (re2::RE2::PartialMatch(text, *pattern)) return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(const OptimizerOptions& options) {
  if (absl::Status s = Validate(options); !s.ok()) return s;
  // Without weight decay the patterns are not read (main says so).
  auto excluded = CompileExcludePatterns(
      options.weight_decay != 0.0 ? options.exclude_from_weight_decay : std::vector<std::string>());
  if (!excluded.ok()) return excluded.status();
  std::unique_ptr<Optimizer> made;
  switch (options.kind) {
    case OptimizerOptions::Kind::kAdam:
      made = std::make_unique<Adam>(options);
      break;
    case OptimizerOptions::Kind::kSgd:
      made = std::make_unique<Sgd>(options);
      break;
    case OptimizerOptions::Kind::kAdagrad:
      made = std::make_unique<Adagrad>(options);
      break;
    case OptimizerOptions::Kind::kRmsprop:
      made = std::make_unique<Rmsprop>(options);
      break;
    case OptimizerOptions::Kind::kLion:
      made = std::make_unique<Lion>(options);
      break;
  }
  if (made == nullptr) return absl::InternalError("unreachable optimizer kind");
  made->decays_ = options.weight_decay != 0.0;
  made->excluded_ = *std::move(excluded);
  return made;
}

}  // namespace psflow::server
