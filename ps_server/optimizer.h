// Optimizer kernels the parameter server applies to incoming gradients.
//
// The update rules are exactly those of tf.keras.optimizers (Keras 3, run
// eagerly) in float32, rounded where Keras rounds, so that the parameters
// match Keras's bit for bit (tests/ps_server/keras_golden.py):
//
//   Adam:    t = step, alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)
//            m += (g - m) * (1 - beta_1)
//            v += (g * g - v) * (1 - beta_2)
//            p -= m * alpha / (sqrt(v) + epsilon)
//            (t, beta^t and alpha in float32; 1 - beta in double, then
//            rounded, as Keras's Python arithmetic does)
//   SGD:     momentum == 0:  p -= lr * g
//            otherwise:      m = momentum * m - lr * g
//                            nesterov: p += momentum * m - lr * g
//                            else:     p += m
//            amsgrad: v_hat = max(v_hat, v), and v_hat in place of v in p's
//            update (v itself goes on as above)
//   Adagrad: acc += g * g
//            p -= lr * g / sqrt(acc + epsilon)
//   Lion:    c = m * beta_1 + g * (1 - beta_1)   (1 - beta in float32 here)
//            p -= lr * sign(c)
//            m = m * beta_2 + g * (1 - beta_2)
//   RMSprop: v = rho * v + (1 - rho) * (g * g)
//            centered: a = rho * a + (1 - rho) * g, d = v - a * a + epsilon
//            else:     d = v + epsilon
//            momentum == 0: p -= lr * g / sqrt(d)
//            otherwise:     u = momentum * u + lr * g / sqrt(d), p -= u
//
// Weight decay (Keras 3's weight_decay, which every optimizer takes, and
// AdamW's): before the rule above, p = p - p * wd * lr, each product
// rounded to float32, with the same (scheduled) lr, on the variables whose
// names no pattern of exclude_from_weight_decay is found in.
//
// As TensorFlow runs its CPU kernels, Apply flushes denormal results to zero
// and reads denormal inputs as zero (and restores the thread's mode after),
// so no slot decays into denormals, where each update is many times slower.
//
// lr may follow a schedule of the update count, as a Keras
// LearningRateSchedule passed as learning_rate does (evaluated at the
// optimizer's iterations before the update, i.e. at step - 1):
//   constant:     lr
//   cosine:       lr * ((1 - alpha) * 0.5 * (1 + cos(pi * min(s, D) / D)) + alpha)
//                 with a warmup (warmup_target set, W = warmup_steps, s
//                 first capped at D + W): for s < W,
//                 lr + (warmup_target - lr) * s / W, then the decay above
//                 from warmup_target at s - W
//   exponential:  lr * decay_rate^(s / D), s / D floored when staircase
//   polynomial:   (lr - end) * (1 - min(s, D) / D)^power + end; with cycle,
//                 D becomes D * ceil(s / D) (D at s = 0) and s is not capped
//   inverse_time: lr / (1 + decay_rate * s / D), s / D floored when staircase
//   piecewise_constant: values[i] for boundaries[i-1] < s <= boundaries[i]
//                 (values[0] up to boundaries[0], the last value after the
//                 last boundary); lr itself is not read
// with s = step - 1 and D = decay_steps (tf.keras.optimizers.schedules
// CosineDecay, ExponentialDecay, PolynomialDecay, InverseTimeDecay and
// PiecewiseConstantDecay). The parameters are rounded to float32, as Keras
// holds them, and the schedule is then computed in double and rounded once.
// Keras computes it in float32, so the rates agree to a few ulp early in a
// decay and drift apart where float32 loses precision (near the end of a
// cosine or polynomial decay, where the result is a small difference, and
// past 2^24 steps): there psflow's is the more accurate.
//
// Every hyper-parameter is a double, as Keras's are Python floats; each is
// rounded to float32 where Keras rounds it. The kernels are compiled without
// floating-point contraction (-ffp-contract=off): a fused multiply-add
// rounds once where Keras rounds twice.
//
// The kernels are the PS's hot loop: each element is read and written once,
// vectorized for AVX-512 / AVX2+FMA with a baseline x86-64 fallback chosen at
// load time (GCC function multiversioning), so the binary stays portable.
#ifndef PSFLOW_PS_SERVER_OPTIMIZER_H_
#define PSFLOW_PS_SERVER_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace re2 {
class RE2;
}  // namespace re2

namespace psflow::server {

// How the learning rate changes with the update count (see the top of file).
struct LearningRateSchedule {
  enum class Kind {
    kConstant,
    kCosine,
    kExponential,
    kPolynomial,
    kInverseTime,
    kPiecewiseConstant
  };
  Kind kind = Kind::kConstant;
  // All but piecewise_constant: steps over which the rate decays; > 0.
  int64_t decay_steps = 0;
  // Cosine: the final rate as a fraction of the initial one, in [0, 1].
  double alpha = 0.0;
  // Cosine: a linear warmup from the learning rate to warmup_target over
  // warmup_steps (>= 0) before the decay, which then starts from
  // warmup_target (finite, > 0). None without a target, as in Keras.
  int64_t warmup_steps = 0;
  std::optional<double> warmup_target;
  // Exponential: the factor per decay_steps, finite and > 0. Inverse time:
  // the rate's divisor grows by it per decay_steps, finite and >= 0.
  double decay_rate = 0.96;
  // Exponential and inverse time: in whole steps of decay_steps.
  bool staircase = false;
  // Polynomial: the rate at decay_steps (finite, >= 0), the exponent
  // (finite, >= 0), and whether to decay again from each multiple of
  // decay_steps.
  double end_learning_rate = 0.0001;
  double power = 1.0;
  bool cycle = false;
  // Piecewise constant: increasing steps, and one more rate than steps
  // (each finite and >= 0).
  std::vector<int64_t> boundaries;
  std::vector<double> values;
};

struct OptimizerOptions {
  enum class Kind { kAdam, kSgd, kAdagrad, kRmsprop, kLion };
  // Which update rule. Only the fields that the kind uses are validated.
  Kind kind = Kind::kAdam;
  // Step size; all kinds. Must be finite and > 0, also in float32 (>= 0
  // where a schedule may rise from it: a cosine warmup, polynomial). The
  // initial rate when a schedule is set (piecewise_constant does not read
  // it). Keras's default is 0.01 for SGD, 0.001 otherwise (see
  // DefaultLearningRate).
  double learning_rate = 0.001;
  LearningRateSchedule schedule;
  // Adam's decay rates of the first and second moments, each in [0, 1), also
  // in float32. Lion's interpolation (beta_1, in (0, 1]) and momentum decay
  // (beta_2, in [0, 1]) rates; Keras's default beta_2 is 0.99 for Lion (see
  // DefaultBeta2).
  double beta_1 = 0.9, beta_2 = 0.999;
  // Added to the denominator; Adam, Adagrad and RMSprop. Must be finite and
  // > 0, also in float32.
  double epsilon = 1e-7;
  // SGD and RMSprop momentum in [0, 1] (Keras's range for SGD); 0 means no
  // momentum slot. Nesterov (SGD) is accepted with momentum 0 (as Keras
  // does) and then equals plain SGD.
  double momentum = 0.0;
  bool nesterov = false;
  // Adagrad's starting accumulator value; finite and >= 0, also in float32.
  double initial_accumulator_value = 0.1;
  // Adam: keep the largest second moment seen (AMSGrad), a third slot.
  bool amsgrad = false;
  // RMSprop: the decay of the mean square, in [0, 1]; centered also keeps
  // the mean gradient and divides by the variance's root.
  double rho = 0.9;
  bool centered = false;
  // Decoupled weight decay, all kinds; finite and >= 0, also in float32
  // (0: none). Keras's AdamW is Adam with 0.004 (see ParseOptimizerName).
  double weight_decay = 0.0;
  // Regular expressions (RE2 syntax, searched anywhere in the variable's
  // whole name, such as "dense/bias"): the variables whose name one of them
  // is found in are not decayed. Keras's exclude_from_weight_decay(var_names=
  // ...) searches its variable.name the same way, but that is only the last
  // component ("bias"): a pattern that can match only within it means the
  // same in both. Not empty (an empty pattern is found in every name). Read
  // only with weight_decay > 0.
  std::vector<std::string> exclude_from_weight_decay;
};

// "adam", "sgd", "adagrad", "rmsprop" or "lion" (exact, lower case).
// INVALID_ARGUMENT otherwise, with a message listing the choices.
absl::StatusOr<OptimizerOptions::Kind> ParseOptimizerKind(std::string_view name);

// What --optimizer names: a kind, or "adamw", which is Adam whose weight
// decay defaults to Keras AdamW's 0.004 (its kind is kAdam). INVALID_ARGUMENT
// listing the choices otherwise.
struct OptimizerName {
  OptimizerOptions::Kind kind;
  double default_weight_decay = 0.0;
};
absl::StatusOr<OptimizerName> ParseOptimizerName(std::string_view name);

// Returns the lower-case name ParseOptimizerKind accepts for `kind`.
std::string_view OptimizerKindName(OptimizerOptions::Kind kind);

// Keras's default learning rate for `kind`: 0.01 for SGD, 0.001 otherwise.
double DefaultLearningRate(OptimizerOptions::Kind kind);

// Keras's default beta_2 for `kind`: 0.99 for Lion, 0.999 otherwise.
double DefaultBeta2(OptimizerOptions::Kind kind);

// "constant", "cosine", "exponential", "polynomial", "inverse_time" or
// "piecewise_constant"; INVALID_ARGUMENT listing the choices.
absl::StatusOr<LearningRateSchedule::Kind> ParseScheduleKind(std::string_view name);

// The learning rate of update number `step` (1-based): the schedule
// evaluated at step - 1, as Keras evaluates it at iterations.
double ScheduledLearningRate(const OptimizerOptions& options, int64_t step);

// An update rule with its hyper-parameters. The optimizer holds no per-element
// state: the caller owns parameters and slots (one float array per slot, the
// same length as the parameters, initialized to slot_initial_value(slot)).
//
// Thread safety: all methods are const and keep no mutable state, so any
// number of threads may call Apply concurrently on disjoint element ranges.
class Optimizer {
 public:
  // INVALID_ARGUMENT naming the bad field, its valid range and the value
  // received.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const OptimizerOptions& options);

  virtual ~Optimizer();

  // Number of slot arrays per parameter: Adam 2 (m, v), 3 with amsgrad (m,
  // v, v_hat); SGD 1 (momentum) if momentum > 0, else 0; Adagrad 1
  // (accumulator); RMSprop 1 (v), plus the momentum if momentum > 0, plus
  // the mean gradient if centered, in that order; Lion 1 (m). Weight decay
  // needs none.
  virtual int num_slots() const = 0;
  // The value each element of slot `slot` must start at: Adagrad's
  // initial_accumulator_value, 0 otherwise. 0 <= slot < num_slots().
  virtual float slot_initial_value(int slot) const = 0;
  // E.g. "adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07)",
  // with ", amsgrad=true", ", weight_decay=0.004" (and the patterns it
  // excludes) and ", schedule=cosine(decay_steps=2814, alpha=0)" when set.
  virtual std::string DebugString() const = 0;

  // Whether the weight decay reaches the variable `name`: there is one, and
  // no pattern of exclude_from_weight_decay is found in the name. The
  // patterns are compiled once, by Create, with RE2, whose time is linear
  // in the name's length (a client names the variables it registers).
  bool DecaysVariable(std::string_view name) const;

  // Applies one update to `n` contiguous elements, in place.
  //   step:  the 1-based count of this update on these elements (Adam's bias
  //          correction and the learning-rate schedule use it; >= 1).
  //   param: n floats, updated in place.
  //   slots: num_slots() pointers, slots[i] -> n floats of slot i for the same
  //          elements, updated in place (may be nullptr when num_slots() == 0).
  //   grad:  n float32 values (4n bytes), read only, at any byte alignment
  //          (e.g. straight out of a received message).
  // param, the slots and grad must not overlap. n may be 0.
  virtual void Apply(int64_t step, float* param, float* const* slots, const void* grad,
                     int64_t n) const = 0;

 protected:
  Optimizer() = default;

 private:
  bool decays_ = false;
  std::vector<std::shared_ptr<const re2::RE2>> excluded_;
};

}  // namespace psflow::server

#endif  // PSFLOW_PS_SERVER_OPTIMIZER_H_
