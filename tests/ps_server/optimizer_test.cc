// Checks the optimizer kernels against what Keras itself computed (bit for
// bit, keras_golden.inc), against the tf.keras.optimizers formulas evaluated
// independently here in double precision, and by hand.
#include "ps_server/optimizer.h"

#include <xmmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Kind = OptimizerOptions::Kind;

std::unique_ptr<Optimizer> MustCreate(const OptimizerOptions& o) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(o);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? *std::move(opt) : nullptr;
}

// ---- Double-precision references, written from the Keras formulas. ----

using Reference = std::function<void(const OptimizerOptions&, int64_t step, std::vector<double>& p,
                                     std::vector<std::vector<double>>& slots,
                                     const std::vector<double>& g)>;

// Keras 3's decoupled weight decay, before every optimizer's update.
void DecayReference(const OptimizerOptions& o, std::vector<double>& p) {
  for (double& x : p) x -= x * o.weight_decay * o.learning_rate;
}

void AdamReference(const OptimizerOptions& o, int64_t step, std::vector<double>& p,
                   std::vector<std::vector<double>>& s, const std::vector<double>& g) {
  const double b1 = o.beta_1, b2 = o.beta_2, t = static_cast<double>(step);
  const double alpha = o.learning_rate * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
  DecayReference(o, p);
  for (size_t i = 0; i < p.size(); ++i) {
    s[0][i] += (g[i] - s[0][i]) * (1 - b1);
    s[1][i] += (g[i] * g[i] - s[1][i]) * (1 - b2);
    double v = s[1][i];
    if (o.amsgrad) v = s[2][i] = std::max(s[2][i], s[1][i]);
    p[i] -= alpha * s[0][i] / (std::sqrt(v) + o.epsilon);
  }
}

void SgdReference(const OptimizerOptions& o, int64_t, std::vector<double>& p,
                  std::vector<std::vector<double>>& s, const std::vector<double>& g) {
  const double lr = o.learning_rate, mu = o.momentum;
  DecayReference(o, p);
  for (size_t i = 0; i < p.size(); ++i) {
    if (mu == 0) {
      p[i] -= lr * g[i];
      continue;
    }
    s[0][i] = mu * s[0][i] - lr * g[i];
    p[i] += o.nesterov ? mu * s[0][i] - lr * g[i] : s[0][i];
  }
}

void AdagradReference(const OptimizerOptions& o, int64_t, std::vector<double>& p,
                      std::vector<std::vector<double>>& s, const std::vector<double>& g) {
  DecayReference(o, p);
  for (size_t i = 0; i < p.size(); ++i) {
    s[0][i] += g[i] * g[i];
    p[i] -= o.learning_rate * g[i] / std::sqrt(s[0][i] + o.epsilon);
  }
}

void RmspropReference(const OptimizerOptions& o, int64_t, std::vector<double>& p,
                      std::vector<std::vector<double>>& s, const std::vector<double>& g) {
  DecayReference(o, p);
  const double rho = o.rho;
  const int mom = o.momentum > 0 ? 1 : -1;
  const int avg = o.centered ? (mom > 0 ? 2 : 1) : -1;
  for (size_t i = 0; i < p.size(); ++i) {
    s[0][i] = rho * s[0][i] + (1 - rho) * g[i] * g[i];
    double d = s[0][i] + o.epsilon;
    if (avg > 0) {
      s[avg][i] = rho * s[avg][i] + (1 - rho) * g[i];
      d -= s[avg][i] * s[avg][i];
    }
    const double increment = o.learning_rate * g[i] / std::sqrt(d);
    if (mom > 0) {
      s[mom][i] = o.momentum * s[mom][i] + increment;
      p[i] -= s[mom][i];
    } else {
      p[i] -= increment;
    }
  }
}

void LionReference(const OptimizerOptions& o, int64_t, std::vector<double>& p,
                   std::vector<std::vector<double>>& s, const std::vector<double>& g) {
  DecayReference(o, p);
  for (size_t i = 0; i < p.size(); ++i) {
    const double c = s[0][i] * o.beta_1 + g[i] * (1 - o.beta_1);
    p[i] -= o.learning_rate * (c > 0 ? 1 : c < 0 ? -1 : 0);
    s[0][i] = s[0][i] * o.beta_2 + g[i] * (1 - o.beta_2);
  }
}

// |got - want| <= rel * max(|want|, 1% of the array's largest |want|): tight
// relative error, without demanding it of elements that happen to be ~0.
void ExpectAllNear(const float* got, const std::vector<double>& want, double rel,
                   const std::string& what) {
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  int failures = 0;
  for (size_t i = 0; i < want.size() && failures < 5; ++i) {
    const double tol = rel * std::max(std::abs(want[i]), 0.01 * scale);
    if (std::abs(got[i] - want[i]) > tol) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want[i]
                    << " (tolerance " << tol << ")";
      ++failures;
    }
  }
}

struct Case {
  std::string name;
  OptimizerOptions options;
  Reference reference;
  double grad_scale = 1.0;  // small gradients make epsilon matter
};

// Runs `steps` updates on `n` elements with fresh random gradients each step.
// param and grad live at odd offsets into their buffers so that neither is
// vector-aligned; the loop tails (n not a multiple of the width) are covered
// by the sizes the tests pick.
void RunAgainstReference(const Case& c, int64_t n, int steps, int64_t first_step = 1) {
  SCOPED_TRACE(c.name + " n=" + std::to_string(n));
  std::unique_ptr<Optimizer> opt = MustCreate(c.options);
  ASSERT_NE(opt, nullptr);
  std::mt19937 rng(static_cast<uint32_t>(n * 31 + steps));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);

  std::vector<float> param_buf(n + 3), grad_buf(n + 1);
  float* param = param_buf.data() + 3;
  float* grad = grad_buf.data() + 1;
  std::vector<double> p_ref(n), g_ref(n);
  for (int64_t i = 0; i < n; ++i) p_ref[i] = param[i] = uniform(rng);

  const int k = opt->num_slots();
  std::vector<std::vector<float>> slots(k, std::vector<float>(n));
  std::vector<std::vector<double>> slots_ref(k, std::vector<double>(n));
  std::vector<float*> slot_ptrs;
  for (int s = 0; s < k; ++s) {
    std::fill(slots[s].begin(), slots[s].end(), opt->slot_initial_value(s));
    std::fill(slots_ref[s].begin(), slots_ref[s].end(), opt->slot_initial_value(s));
    slot_ptrs.push_back(slots[s].data());
  }

  for (int64_t step = first_step; step < first_step + steps; ++step) {
    for (int64_t i = 0; i < n; ++i) {
      grad[i] = static_cast<float>(c.grad_scale) * uniform(rng);
      g_ref[i] = grad[i];
    }
    opt->Apply(step, param, slot_ptrs.data(), grad, n);
    c.reference(c.options, step, p_ref, slots_ref, g_ref);
  }
  ExpectAllNear(param, p_ref, 1e-5, "param");
  for (int s = 0; s < k; ++s) ExpectAllNear(slots[s].data(), slots_ref[s], 1e-5, "slot");
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  OptimizerOptions adam;  // Keras defaults
  cases.push_back({"adam_default", adam, AdamReference});
  OptimizerOptions adam2;
  adam2.learning_rate = 0.01;
  adam2.beta_1 = 0.5;
  adam2.beta_2 = 0.9;
  adam2.epsilon = 1e-3;  // comparable to sqrt(v): catches a misplaced epsilon
  cases.push_back({"adam_custom", adam2, AdamReference, 1e-3});
  OptimizerOptions sgd;
  sgd.kind = Kind::kSgd;
  sgd.learning_rate = 0.05;
  cases.push_back({"sgd_plain", sgd, SgdReference});
  OptimizerOptions momentum = sgd;
  momentum.momentum = 0.9;
  cases.push_back({"sgd_momentum", momentum, SgdReference});
  OptimizerOptions nesterov = momentum;
  nesterov.nesterov = true;
  cases.push_back({"sgd_nesterov", nesterov, SgdReference});
  OptimizerOptions adagrad;
  adagrad.kind = Kind::kAdagrad;
  adagrad.learning_rate = 0.1;
  cases.push_back({"adagrad_default", adagrad, AdagradReference});
  OptimizerOptions adagrad2 = adagrad;
  adagrad2.initial_accumulator_value = 0.0;
  adagrad2.epsilon = 1e-4;  // with acc0 = 0, epsilon is a visible share of acc
  cases.push_back({"adagrad_custom", adagrad2, AdagradReference, 1e-2});
  OptimizerOptions amsgrad = adam2;
  amsgrad.beta_2 = 0.5;  // v falls between steps: v_hat keeps its maximum
  amsgrad.amsgrad = true;
  cases.push_back({"adam_amsgrad", amsgrad, AdamReference});
  OptimizerOptions adamw = amsgrad;
  adamw.weight_decay = 0.5;  // large, so that a misplaced decay shows
  cases.push_back({"adamw_amsgrad", adamw, AdamReference});
  OptimizerOptions sgd_decay = momentum;
  sgd_decay.weight_decay = 0.5;
  cases.push_back({"sgd_momentum_decay", sgd_decay, SgdReference});
  OptimizerOptions adagrad_decay = adagrad;
  adagrad_decay.weight_decay = 0.5;
  cases.push_back({"adagrad_decay", adagrad_decay, AdagradReference});
  OptimizerOptions rmsprop;
  rmsprop.kind = Kind::kRmsprop;
  rmsprop.learning_rate = 0.01;
  cases.push_back({"rmsprop_plain", rmsprop, RmspropReference});
  OptimizerOptions rmsprop_centered = rmsprop;
  rmsprop_centered.centered = true;
  rmsprop_centered.rho = 0.5;
  cases.push_back({"rmsprop_centered", rmsprop_centered, RmspropReference});
  OptimizerOptions rmsprop_all = rmsprop_centered;
  rmsprop_all.momentum = 0.9;
  rmsprop_all.weight_decay = 0.5;
  cases.push_back({"rmsprop_centered_momentum_decay", rmsprop_all, RmspropReference});
  OptimizerOptions rmsprop_momentum = rmsprop;
  rmsprop_momentum.momentum = 0.5;
  cases.push_back({"rmsprop_momentum", rmsprop_momentum, RmspropReference});
  OptimizerOptions lion;
  lion.kind = Kind::kLion;
  lion.beta_2 = DefaultBeta2(Kind::kLion);
  cases.push_back({"lion", lion, LionReference});
  OptimizerOptions lion_decay = lion;
  lion_decay.beta_1 = 0.5;
  lion_decay.weight_decay = 0.5;
  cases.push_back({"lion_decay", lion_decay, LionReference});
  return cases;
}

TEST(OptimizerTest, MatchesKerasFormulasOverFiveSteps) {
  for (const Case& c : AllCases()) {
    for (int64_t n : {1, 7, 16, 33, 1000, 4099}) RunAgainstReference(c, n, 5);
  }
}

TEST(OptimizerTest, AdamBiasCorrectionUsesTheGivenStep) {
  // Steps 100..102 on fresh slots: alpha differs a lot from steps 1..3.
  for (const Case& c : AllCases()) {
    if (c.options.kind == Kind::kAdam) RunAgainstReference(c, 257, 3, /*first_step=*/100);
  }
}

// ---- Bit for bit against Keras 3 (keras_golden.py ran the real thing). ----

struct Golden {
  const char* name;
  int64_t iterations;  // the Keras optimizer's count before the first update
  uint32_t bits[64];   // float32 parameters after kGoldenSteps updates
};
constexpr int64_t kGoldenN = 64;
constexpr int kGoldenSteps = 5;
const Golden kGolden[] = {
#include "keras_golden.inc"
};

// The inputs keras_golden.py feeds Keras; every value is a small integer
// times a power of two, so both sides start from the same floats.
float GoldenParam(int64_t i) { return static_cast<float>((i * 37) % 64 - 32) / 32.0f; }
float GoldenGrad(int step, int64_t i) {
  const float g = static_cast<float>((i * 13 + step * 29 + 7) % 61 - 30) / 32.0f;
  return i < kGoldenN / 2 ? std::ldexp(g, -14) : g;
}

OptimizerOptions GoldenOptions(const std::string& name) {
  OptimizerOptions o;  // adam_default, adam_late: Keras's defaults
  if (name == "adam_custom") {
    o.learning_rate = 0.01;
    o.beta_1 = 0.5;
    o.beta_2 = 0.9;
    o.epsilon = 1e-3;
  } else if (name == "adam_amsgrad" || name == "adamw_custom") {
    o.learning_rate = 0.01;
    o.beta_2 = 0.5;
    o.amsgrad = true;
    if (name == "adamw_custom") o.weight_decay = 0.1;
  } else if (name == "adamw_default") {
    o.weight_decay = ParseOptimizerName("adamw")->default_weight_decay;
  } else if (name.rfind("sgd_", 0) == 0) {
    o.kind = Kind::kSgd;
    o.learning_rate = 0.05;
    if (name != "sgd_plain") o.momentum = 0.9;
    o.nesterov = name == "sgd_nesterov";
    if (name == "sgd_momentum_decay") o.weight_decay = 0.1;
  } else if (name.rfind("adagrad_", 0) == 0) {
    o.kind = Kind::kAdagrad;
    o.learning_rate = 0.1;
    if (name == "adagrad_custom") {
      o.initial_accumulator_value = 0.0;
      o.epsilon = 1e-4;
    }
    if (name == "adagrad_decay") o.weight_decay = 0.1;
  } else if (name.rfind("lion_", 0) == 0) {
    o.kind = Kind::kLion;
    o.beta_2 = DefaultBeta2(Kind::kLion);
    if (name == "lion_custom") {
      o.learning_rate = 0.01;
      o.beta_1 = 0.85;
      o.beta_2 = 0.97;
      o.weight_decay = 0.1;
    }
  } else if (name.rfind("rmsprop_", 0) == 0) {
    o.kind = Kind::kRmsprop;
    if (name != "rmsprop_default") {
      o.learning_rate = 0.01;
      o.rho = 0.5;
      o.momentum = 0.9;
    }
    if (name == "rmsprop_momentum") o.epsilon = 1e-3;
    if (name == "rmsprop_centered") {
      o.centered = true;
      o.weight_decay = 0.1;
    }
  } else {
    EXPECT_TRUE(name == "adam_default" || name == "adam_late") << "unknown golden case " << name;
  }
  return o;
}

TEST(OptimizerTest, EqualsKerasBitForBit) {
  ASSERT_EQ(std::size(kGolden), 21u);
  for (const Golden& want : kGolden) {
    SCOPED_TRACE(want.name);
    // "<case>/slot": the case's first optimizer slot, not its parameters.
    std::string name = want.name;
    const bool slot = absl::EndsWith(name, "/slot");
    if (slot) name.resize(name.size() - 5);
    std::unique_ptr<Optimizer> opt = MustCreate(GoldenOptions(name));
    ASSERT_NE(opt, nullptr);
    // Once in one call per step, once split at element 37 (vector loop
    // tails, a gradient at an odd byte offset): both must be exact.
    for (bool split : {false, true}) {
      std::vector<float> p(kGoldenN);
      std::vector<std::vector<float>> slots(opt->num_slots());
      std::vector<float*> slot_ptrs;
      for (int s = 0; s < opt->num_slots(); ++s) {
        slots[s].assign(kGoldenN, opt->slot_initial_value(s));
        slot_ptrs.push_back(slots[s].data());
      }
      for (int64_t i = 0; i < kGoldenN; ++i) p[i] = GoldenParam(i);
      std::vector<char> grad_bytes(4 * kGoldenN + 1);
      for (int step = 0; step < kGoldenSteps; ++step) {
        for (int64_t i = 0; i < kGoldenN; ++i) {
          const float g = GoldenGrad(step, i);
          std::memcpy(grad_bytes.data() + 1 + 4 * i, &g, 4);
        }
        const char* grad = grad_bytes.data() + 1;
        const int64_t t = want.iterations + step + 1;
        const int64_t cut = split ? 37 : kGoldenN;
        opt->Apply(t, p.data(), slot_ptrs.data(), grad, cut);
        if (split) {
          std::vector<float*> rest;
          for (float* s : slot_ptrs) rest.push_back(s + cut);
          opt->Apply(t, p.data() + cut, rest.data(), grad + 4 * cut, kGoldenN - cut);
        }
      }
      const std::vector<float>& values = slot ? slots[0] : p;
      int mismatches = 0;
      for (int64_t i = 0; i < kGoldenN; ++i) {
        uint32_t got;
        std::memcpy(&got, &values[i], 4);
        if (got != want.bits[i] && ++mismatches <= 3) {
          float w;
          std::memcpy(&w, &want.bits[i], 4);
          ADD_FAILURE() << "split=" << split << (slot ? " slot[" : " param[") << i
                        << "] = " << values[i] << ", Keras " << w << " (bits " << std::hex << got
                        << " vs " << want.bits[i] << std::dec << ")";
        }
      }
      EXPECT_EQ(mismatches, 0) << "split=" << split;
    }
  }
}

TEST(OptimizerTest, DefaultLearningRatesAreKeras) {
  EXPECT_EQ(DefaultLearningRate(Kind::kAdam), 0.001);
  EXPECT_EQ(DefaultLearningRate(Kind::kSgd), 0.01);
  EXPECT_EQ(DefaultLearningRate(Kind::kAdagrad), 0.001);
  EXPECT_EQ(DefaultLearningRate(Kind::kRmsprop), 0.001);
  EXPECT_EQ(DefaultLearningRate(Kind::kLion), 0.001);
  EXPECT_EQ(DefaultBeta2(Kind::kLion), 0.99);  // keras.optimizers.Lion
  EXPECT_EQ(DefaultBeta2(Kind::kAdam), 0.999);
}

TEST(OptimizerTest, ZeroElementsIsANoOp) {
  std::unique_ptr<Optimizer> opt = MustCreate({});
  float p = 1.0f, m = 2.0f, v = 3.0f, g = 4.0f;
  float* slots[] = {&m, &v};
  opt->Apply(1, &p, slots, &g, 0);
  EXPECT_EQ(p, 1.0f);
  EXPECT_EQ(m, 2.0f);
  EXPECT_EQ(v, 3.0f);
}

// ---- Tiny cases worked out by hand. ----

TEST(OptimizerTest, AdamFirstStepMovesByLearningRateTimesSign) {
  // Step 1, Keras defaults, g = {2, -0.5, 0}, p = 1:
  //   m = 0.1 g = {0.2, -0.05, 0};  v = 0.001 g^2 = {0.004, 0.00025, 0}
  //   alpha = 0.001 * sqrt(0.001) / 0.1 = 0.001 * 0.316228
  //   alpha * m / (sqrt v + eps) = 0.001 * 0.0316228 g / (0.0316228 |g| + 1e-7)
  //     g = 2:    0.001 * (1 - 1.6e-6)  -> p = 0.999
  //     g = -0.5: 0.001 * (1 - 6.3e-6)  -> p = 1.001
  //     g = 0:    m = 0, no move        -> p = 1
  std::unique_ptr<Optimizer> opt = MustCreate({});
  std::vector<float> p = {1, 1, 1}, m(3, 0.0f), v(3, 0.0f), g = {2, -0.5f, 0};
  float* slots[] = {m.data(), v.data()};
  opt->Apply(1, p.data(), slots, g.data(), 3);
  EXPECT_NEAR(p[0], 0.999, 2e-7);
  EXPECT_NEAR(p[1], 1.001, 2e-7);
  EXPECT_EQ(p[2], 1.0f);
  // 1 - beta is Python arithmetic in Keras, on the double hyper-parameter,
  // rounded to float32 only then: float(1 - 0.9) = 0.1f and float(1 - 0.999)
  // = 0.001f. (From the float32 betas it would be 1 - 0.9f = 0.1 * (1 +
  // 2.4e-7) and 1 - 0.999f = 0.001 * (1 - 1.3e-5).) g and 1/4 are powers of
  // two times small integers, so the moments are exactly these floats:
  EXPECT_EQ(m[0], 0.2f);
  EXPECT_EQ(m[1], -0.05f);
  EXPECT_EQ(v[0], 0.004f);
  EXPECT_EQ(v[1], 0.00025f);
  EXPECT_EQ(v[2], 0.0f);
}

// A float with every denormal result replaced by 0, as on a CPU that
// flushes them; for the references below, computed one operation at a time.
float Flushed(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? 0.0f : x; }

// TensorFlow runs its CPU kernels with denormals flushed to zero (results)
// and read as zero (inputs), so Keras's optimizer state never holds one.
TEST(OptimizerTest, DenormalsAreFlushedToZeroAsTensorFlowDoes) {
  const float denormal = 1e-39f;
  ASSERT_EQ(std::fpclassify(denormal), FP_SUBNORMAL);
  constexpr unsigned kModes = 0x8000 | 0x0040;  // MXCSR: flush to zero, denormals are zero
  const unsigned modes_before = _mm_getcsr() & kModes;
  {
    // A denormal gradient counts as 0: nothing moves.
    std::unique_ptr<Optimizer> opt = MustCreate({});
    float p = 0.0f, m = 0.0f, v = 0.0f, g = denormal;
    float* slots[] = {&m, &v};
    opt->Apply(1, &p, slots, &g, 1);
    EXPECT_EQ(p, 0.0f);
    EXPECT_EQ(m, 0.0f);
    EXPECT_EQ(v, 0.0f);
  }
  // One real gradient, then zeros (a dead ReLU unit): a moment decays
  // until its decrement is below the smallest normal float, which flushes
  // to 0, and there it stays (at about 1e-37 for Adam's m). Kept denormal,
  // it went on down to 2^-147, every update of it on the CPU's slow path.
  {
    std::unique_ptr<Optimizer> opt = MustCreate({});
    float p = 0.0f, m = 0.0f, v = 0.0f, g = 1.0f;
    float* slots[] = {&m, &v};
    opt->Apply(1, &p, slots, &g, 1);
    float want = 0.1f;  // Keras: m += (g - m) * (1 - beta_1)
    g = 0.0f;
    for (int step = 2; step <= 1000; ++step) {
      opt->Apply(step, &p, slots, &g, 1);
      want = Flushed(want + Flushed((0.0f - want) * 0.1f));
    }
    EXPECT_EQ(m, want) << "m = " << m;
    EXPECT_NE(std::fpclassify(m), FP_SUBNORMAL) << m;
  }
  {
    OptimizerOptions o;
    o.kind = Kind::kSgd;
    o.momentum = 0.9;
    std::unique_ptr<Optimizer> opt = MustCreate(o);
    float p = 0.0f, m = 0.0f, g = 1.0f;
    float* slots[] = {&m};
    opt->Apply(1, &p, slots, &g, 1);
    ASSERT_EQ(m, -0.001f);  // Keras: m = momentum * m - lr * g, from 0 at lr 0.001
    float want = -0.001f;
    g = 0.0f;
    for (int step = 2; step <= 1000; ++step) {
      opt->Apply(step, &p, slots, &g, 1);
      want = Flushed(Flushed(0.9f * want) - 0.0f);
    }
    EXPECT_EQ(m, want) << "m = " << m;
    EXPECT_NE(std::fpclassify(m), FP_SUBNORMAL) << m;
  }
  // The caller's own modes are left as they were.
  EXPECT_EQ(_mm_getcsr() & kModes, modes_before);
}

TEST(OptimizerTest, SgdMomentumAndNesterovByHand) {
  // lr 0.1, momentum 0.9, g = 1 twice, p = 0:
  //   momentum: m1 = -0.1, p1 = -0.1; m2 = 0.9*-0.1 - 0.1 = -0.19, p2 = -0.29
  //   nesterov: m1 = -0.1, p1 = 0.9*-0.1 - 0.1 = -0.19;
  //             m2 = -0.19, p2 = -0.19 + 0.9*-0.19 - 0.1 = -0.461
  //   plain:    p2 = -0.2
  OptimizerOptions o;
  o.kind = Kind::kSgd;
  o.learning_rate = 0.1;
  for (auto [mu, nesterov, want] :
       {std::tuple{0.9, false, -0.29}, {0.9, true, -0.461}, {0.0, false, -0.2}}) {
    o.momentum = mu;
    o.nesterov = nesterov;
    std::unique_ptr<Optimizer> opt = MustCreate(o);
    float p = 0.0f, m = 0.0f, g = 1.0f;
    float* slots[] = {&m};
    opt->Apply(1, &p, slots, &g, 1);
    opt->Apply(2, &p, slots, &g, 1);
    EXPECT_NEAR(p, want, 1e-6) << opt->DebugString();
  }
}

TEST(OptimizerTest, AdagradByHand) {
  // lr 0.1, acc0 = 7, g = 3: acc = 16, p -= 0.1 * 3 / sqrt(16 + 1e-7) = 0.075.
  OptimizerOptions o;
  o.kind = Kind::kAdagrad;
  o.learning_rate = 0.1;
  o.initial_accumulator_value = 7.0;
  std::unique_ptr<Optimizer> opt = MustCreate(o);
  float p = 1.0f, acc = opt->slot_initial_value(0), g = 3.0f;
  float* slots[] = {&acc};
  opt->Apply(1, &p, slots, &g, 1);
  EXPECT_EQ(acc, 16.0f);
  EXPECT_NEAR(p, 0.925, 1e-7);
}

TEST(OptimizerTest, ConcurrentApplyOnDisjointRangesEqualsOneCall) {
  std::unique_ptr<Optimizer> opt = MustCreate({});
  const int64_t n = 10007, half = 5000;
  std::vector<float> g(n), p1(n, 0.5f), m1(n), v1(n);
  for (int64_t i = 0; i < n; ++i) g[i] = std::sin(0.1 * i);
  std::vector<float> p2 = p1, m2 = m1, v2 = v1;
  float* s1[] = {m1.data(), v1.data()};
  opt->Apply(1, p1.data(), s1, g.data(), n);
  float* lo[] = {m2.data(), v2.data()};
  float* hi[] = {m2.data() + half, v2.data() + half};
  std::thread t([&] { opt->Apply(1, p2.data() + half, hi, g.data() + half, n - half); });
  opt->Apply(1, p2.data(), lo, g.data(), half);
  t.join();
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(m1, m2);
  EXPECT_EQ(v1, v2);
}

// ---- Slots, names, options. ----

TEST(OptimizerTest, SlotsPerKind) {
  OptimizerOptions o;
  EXPECT_EQ(MustCreate(o)->num_slots(), 2);
  EXPECT_EQ(MustCreate(o)->slot_initial_value(1), 0.0f);
  o.kind = Kind::kSgd;
  EXPECT_EQ(MustCreate(o)->num_slots(), 0);
  o.momentum = 0.5;
  EXPECT_EQ(MustCreate(o)->num_slots(), 1);
  EXPECT_EQ(MustCreate(o)->slot_initial_value(0), 0.0f);
  o.kind = Kind::kAdagrad;
  o.initial_accumulator_value = 0.25;
  EXPECT_EQ(MustCreate(o)->num_slots(), 1);
  EXPECT_EQ(MustCreate(o)->slot_initial_value(0), 0.25f);
}

TEST(OptimizerTest, DebugString) {
  EXPECT_EQ(MustCreate({})->DebugString(),
            "adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07)");
  OptimizerOptions o;
  o.kind = Kind::kSgd;
  o.learning_rate = 0.01;
  o.momentum = 0.9;
  o.nesterov = true;
  EXPECT_EQ(MustCreate(o)->DebugString(), "sgd(learning_rate=0.01, momentum=0.9, nesterov=true)");
  o.kind = Kind::kAdagrad;
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "adagrad(learning_rate=0.01, initial_accumulator_value=0.1, epsilon=1e-07)");
  o.kind = Kind::kRmsprop;
  o.centered = true;
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "rmsprop(learning_rate=0.01, rho=0.9, momentum=0.9, epsilon=1e-07, centered=true)");
  EXPECT_EQ(MustCreate(o)->num_slots(), 3);  // v, momentum, mean gradient
  o.momentum = 0;
  EXPECT_EQ(MustCreate(o)->num_slots(), 2);
  o.centered = false;
  EXPECT_EQ(MustCreate(o)->num_slots(), 1);
}

TEST(OptimizerTest, ParseOptimizerKind) {
  EXPECT_EQ(*ParseOptimizerKind("adam"), Kind::kAdam);
  EXPECT_EQ(*ParseOptimizerKind("sgd"), Kind::kSgd);
  EXPECT_EQ(*ParseOptimizerKind("adagrad"), Kind::kAdagrad);
  EXPECT_EQ(*ParseOptimizerKind("rmsprop"), Kind::kRmsprop);
  EXPECT_EQ(*ParseOptimizerKind("lion"), Kind::kLion);
  for (Kind k : {Kind::kAdam, Kind::kSgd, Kind::kAdagrad, Kind::kRmsprop, Kind::kLion}) {
    EXPECT_EQ(*ParseOptimizerKind(OptimizerKindName(k)), k);
  }
  absl::StatusOr<Kind> bad = ParseOptimizerKind("nadam");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("\"nadam\"; expected one of: adam, sgd, adagrad, rmsprop, lion"));
  EXPECT_FALSE(ParseOptimizerKind("Adam").ok());
  EXPECT_FALSE(ParseOptimizerKind("").ok());
}

// TensorFlow's maximum gives NaN when either side is NaN: so does v_hat,
// where NaN gradients are allowed (else a NaN in v would be dropped by a
// plain comparison and the parameter would go on from the old maximum).
TEST(OptimizerTest, AmsgradMaximumKeepsNaNAsTensorFlowDoes) {
  OptimizerOptions o;
  o.amsgrad = true;
  std::unique_ptr<Optimizer> opt = MustCreate(o);
  ASSERT_NE(opt, nullptr);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 19 elements, so that the vector loop and its tail both see each case.
  constexpr int n = 19;
  std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), v_hat(n, 0.5f), g(n, 0.25f);
  for (int i = 0; i < n; i += 3) v[i] = nan;      // v becomes NaN
  for (int i = 1; i < n; i += 3) v_hat[i] = nan;  // v_hat was NaN
  float* slots[] = {m.data(), v.data(), v_hat.data()};
  opt->Apply(1, p.data(), slots, g.data(), n);
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE(i);
    if (i % 3 == 2) {
      EXPECT_EQ(v_hat[i], 0.5f) << "the old maximum is larger than v";
      EXPECT_FALSE(std::isnan(p[i]));
    } else {
      EXPECT_TRUE(std::isnan(v_hat[i]));
      EXPECT_TRUE(std::isnan(p[i]));
    }
  }
}

TEST(OptimizerTest, ParseOptimizerNameTakesAdamWAsAdamWithKerasDecay) {
  EXPECT_EQ(ParseOptimizerName("adamw")->kind, Kind::kAdam);
  EXPECT_EQ(ParseOptimizerName("adamw")->default_weight_decay, 0.004);  // keras.optimizers.AdamW
  for (Kind k : {Kind::kAdam, Kind::kSgd, Kind::kAdagrad, Kind::kRmsprop, Kind::kLion}) {
    EXPECT_EQ(ParseOptimizerName(OptimizerKindName(k))->kind, k);
    EXPECT_EQ(ParseOptimizerName(OptimizerKindName(k))->default_weight_decay, 0.0);
  }
  const absl::Status bad = ParseOptimizerName("AdamW").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(),
              HasSubstr("\"AdamW\"; expected one of: adam, adamw, sgd, adagrad, rmsprop, lion"));
}

TEST(OptimizerTest, DebugStringNamesAmsgradAndWeightDecay) {
  OptimizerOptions o;
  o.amsgrad = true;
  o.weight_decay = 0.004;
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, amsgrad=true, "
            "weight_decay=0.004)");
  EXPECT_EQ(MustCreate(o)->num_slots(), 3);
  o.kind = Kind::kSgd;
  o.exclude_from_weight_decay = {"bias", "norm$"};
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "sgd(learning_rate=0.001, momentum=0, nesterov=false, weight_decay=0.004, "
            "exclude_from_weight_decay=[\"bias\", \"norm$\"])");
}

// Each pattern is searched anywhere in the variable's whole name, as a
// regular expression (Keras searches only the name's last component, so an
// unanchored pattern such as "bias" means the same in both).
TEST(OptimizerTest, DecaysVariableUnlessAPatternIsFoundInItsName) {
  OptimizerOptions o;
  o.exclude_from_weight_decay = {"bias", "^embed", "norm/(gamma|beta)$"};
  EXPECT_FALSE(MustCreate(o)->DecaysVariable("dense/kernel")) << "no weight decay at all";
  o.weight_decay = 0.1;
  std::unique_ptr<Optimizer> opt = MustCreate(o);
  ASSERT_NE(opt, nullptr);
  EXPECT_TRUE(opt->DecaysVariable("dense/kernel"));
  EXPECT_FALSE(opt->DecaysVariable("dense/bias"));
  EXPECT_FALSE(opt->DecaysVariable("embedding/table"));
  EXPECT_TRUE(opt->DecaysVariable("word_embed/table")) << "^ anchors at the start";
  EXPECT_FALSE(opt->DecaysVariable("layer_norm/gamma"));
  EXPECT_TRUE(opt->DecaysVariable("layer_norm/gamma_2"));
  o.exclude_from_weight_decay.clear();
  EXPECT_TRUE(MustCreate(o)->DecaysVariable("dense/bias"));
}

// A client names the variables it registers (up to 64 KiB), and the shard
// matches the names when a registration comes: a pattern that backtracks
// (std::regex took 11 s on a 25,000-byte name and overflowed the stack at
// 40,000) must cost time linear in the name.
TEST(OptimizerTest, PatternsMatchLongNamesInLinearTime) {
  OptimizerOptions o;
  o.weight_decay = 0.1;
  o.exclude_from_weight_decay = {".*bias", "(a+)+$", "(a|aa)*c"};
  std::unique_ptr<Optimizer> opt = MustCreate(o);
  ASSERT_NE(opt, nullptr);
  const std::string name(65536, 'a');
  EXPECT_FALSE(opt->DecaysVariable(name)) << "(a+)+$ is found in it";
  EXPECT_TRUE(opt->DecaysVariable(name + "!")) << "none is found in it";
  EXPECT_FALSE(opt->DecaysVariable(name + "bias"));
}

// The decay uses the learning rate of the update, schedule and all: with a
// zero gradient, SGD leaves only the decay, p * (1 - wd * lr(step)).
TEST(OptimizerTest, WeightDecayFollowsTheScheduledLearningRate) {
  OptimizerOptions o;
  o.kind = Kind::kSgd;
  o.learning_rate = 0.5;
  o.weight_decay = 0.25;
  o.schedule.kind = LearningRateSchedule::Kind::kExponential;
  o.schedule.decay_steps = 1;
  o.schedule.decay_rate = 0.5;  // lr 0.5, 0.25, 0.125 at steps 1, 2, 3
  std::unique_ptr<Optimizer> opt = MustCreate(o);
  ASSERT_NE(opt, nullptr);
  float p = 1.0f;
  const float zero = 0.0f;
  for (int64_t step = 1; step <= 3; ++step) opt->Apply(step, &p, nullptr, &zero, 1);
  // 1 - 0.25 * lr at each step: by hand, not from the schedule's code.
  EXPECT_FLOAT_EQ(p, 0.875f * 0.9375f * 0.96875f);
}

void ExpectInvalid(const OptimizerOptions& o, const std::string& field, const std::string& range) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(o);
  ASSERT_FALSE(opt.ok()) << "accepted bad " << field;
  EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(opt.status().message(), AllOf(HasSubstr(field), HasSubstr(range)));
}

TEST(OptimizerTest, RejectsBadOptions) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (Kind k : {Kind::kAdam, Kind::kSgd, Kind::kAdagrad, Kind::kRmsprop, Kind::kLion}) {
    // 1e300 and 1e-50 are fine doubles but infinite or 0 as the float32 the
    // kernels use.
    for (double lr : {0.0, -0.1, nan, inf, 1e300, 1e-50}) {
      OptimizerOptions o;
      o.kind = k;
      o.learning_rate = lr;
      ExpectInvalid(o, "learning_rate (--learning_rate)", "> 0");
    }
  }
  // 0.99999999 is below 1, but rounds to 1.0f: Adam's bias correction would
  // divide by zero.
  for (double beta : {-0.1, 1.0, 1.5, nan, 0.99999999}) {
    OptimizerOptions o;
    o.beta_1 = beta;
    ExpectInvalid(o, "beta_1 (--beta_1)", "[0, 1)");
    o = {};
    o.beta_2 = beta;
    ExpectInvalid(o, "beta_2 (--beta_2)", "[0, 1)");
  }
  for (Kind k : {Kind::kAdam, Kind::kAdagrad, Kind::kRmsprop}) {
    for (double eps : {0.0, -1e-7, nan, inf, 1e-50}) {
      OptimizerOptions o;
      o.kind = k;
      o.epsilon = eps;
      ExpectInvalid(o, "epsilon (--epsilon)", "> 0");
    }
  }
  for (double mu : {-0.5, 1.5, nan}) {
    for (Kind k : {Kind::kSgd, Kind::kRmsprop}) {
      OptimizerOptions o;
      o.kind = k;
      o.momentum = mu;
      ExpectInvalid(o, "momentum (--momentum)", "[0, 1]");
    }
  }
  for (double beta : {0.0, -0.1, 1.5, nan, 1e-50}) {  // Keras's Lion: beta_1 in (0, 1]
    OptimizerOptions o;
    o.kind = Kind::kLion;
    o.beta_1 = beta;
    ExpectInvalid(o, "beta_1 (--beta_1)", "(0, 1] for lion");
  }
  for (double beta : {-0.1, 1.5, nan}) {
    OptimizerOptions o;
    o.kind = Kind::kLion;
    o.beta_2 = beta;
    ExpectInvalid(o, "beta_2 (--beta_2)", "must be in [0, 1], got");
  }
  for (double rho : {-0.1, 1.5, nan}) {
    OptimizerOptions o;
    o.kind = Kind::kRmsprop;
    o.rho = rho;
    ExpectInvalid(o, "rho (--rho)", "[0, 1]");
  }
  for (double acc : {-0.1, nan, inf, 1e300}) {
    OptimizerOptions o;
    o.kind = Kind::kAdagrad;
    o.initial_accumulator_value = acc;
    ExpectInvalid(o, "initial_accumulator_value (--initial_accumulator_value)", ">= 0");
  }
  for (Kind k : {Kind::kAdam, Kind::kSgd, Kind::kAdagrad, Kind::kRmsprop, Kind::kLion}) {
    for (double wd : {-0.004, nan, inf, 1e300}) {
      OptimizerOptions o;
      o.kind = k;
      o.weight_decay = wd;
      ExpectInvalid(o, "weight_decay (--weight_decay)", ">= 0");
    }
  }
  OptimizerOptions o;
  o.weight_decay = 0.004;
  o.exclude_from_weight_decay = {"bias", "dense/(kernel"};
  ExpectInvalid(o, "exclude_from_weight_decay (--exclude_from_weight_decay): \"dense/(kernel\"",
                "is not a valid regular expression (RE2: missing )");
  o.exclude_from_weight_decay = {"bias", ""};  // "bias," on the command line
  ExpectInvalid(o, "exclude_from_weight_decay (--exclude_from_weight_decay) has an empty pattern",
                "a comma too many?");
}

// Lion's signs, as TensorFlow's sign: NaN stays NaN, and either zero gives
// +0, so that a parameter at -0 with a zero step stays -0 as in Keras.
TEST(OptimizerTest, LionSignIsTensorFlowsAtZeroAndNaN) {
  OptimizerOptions o;
  o.kind = Kind::kLion;
  o.beta_2 = DefaultBeta2(Kind::kLion);
  o.beta_1 = 1.0;  // c = m: the gradient does not reach the sign; beta_1 = 1 is allowed
  std::unique_ptr<Optimizer> opt = MustCreate(o);
  ASSERT_NE(opt, nullptr);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float p[3] = {-0.0f, -0.0f, 1.0f}, m[3] = {0.0f, -0.0f, nan}, g[3] = {0, 0, 0};
  float* slots[] = {m};
  opt->Apply(1, p, slots, g, 3);
  EXPECT_TRUE(std::signbit(p[0])) << "-0 - lr * sign(+0) is -0";
  EXPECT_TRUE(std::signbit(p[1])) << "-0 - lr * sign(-0) is -0: sign(-0) is +0";
  EXPECT_TRUE(std::isnan(p[2]));
}

TEST(OptimizerTest, AcceptsBoundaryOptionsAndIgnoresOtherKindsFields) {
  OptimizerOptions o;
  o.beta_1 = 0.0;
  o.beta_2 = 0.0;
  EXPECT_TRUE(Optimizer::Create(o).ok());
  o.beta_2 = 0.9999999;  // 0.99999988 as a float32: still below 1
  EXPECT_TRUE(Optimizer::Create(o).ok());
  o = {};
  o.kind = Kind::kSgd;
  o.nesterov = true;  // Keras accepts nesterov with momentum 0.
  o.beta_1 = 7.0;     // not an SGD field
  o.epsilon = -1.0;   // not an SGD field
  EXPECT_TRUE(Optimizer::Create(o).ok());
  o.momentum = 1.0;  // Keras's range for momentum is [0, 1]
  EXPECT_TRUE(Optimizer::Create(o).ok());
  o.kind = Kind::kAdagrad;
  o.epsilon = 1e-7;
  o.initial_accumulator_value = 0.0;
  EXPECT_TRUE(Optimizer::Create(o).ok());
}

TEST(OptimizerTest, GradientAtAnyByteAlignmentGivesTheSameUpdate) {
  // Received gradients sit wherever the message put them.
  const int64_t n = 37;
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; ++i) g[i] = 0.1f * static_cast<float>(i) - 1.7f;
  for (Kind k : {Kind::kAdam, Kind::kSgd, Kind::kAdagrad, Kind::kRmsprop, Kind::kLion}) {
    OptimizerOptions o;
    o.kind = k;
    std::unique_ptr<Optimizer> opt = MustCreate(o);
    std::vector<float> want(n, 0.5f), w0(n, opt->slot_initial_value(0)), w1(n, 0.0f);
    float* want_slots[] = {w0.data(), w1.data()};
    opt->Apply(1, want.data(), want_slots, g.data(), n);
    for (int shift = 1; shift < 4; ++shift) {
      std::vector<char> bytes(4 * n + 4);
      std::memcpy(bytes.data() + shift, g.data(), 4 * n);
      std::vector<float> p(n, 0.5f), s0(n, opt->slot_initial_value(0)), s1(n, 0.0f);
      float* slots[] = {s0.data(), s1.data()};
      opt->Apply(1, p.data(), slots, bytes.data() + shift, n);
      EXPECT_EQ(p, want) << OptimizerKindName(k) << " shift " << shift;
    }
  }
}

// ---- Learning-rate schedules (tf.keras.optimizers.schedules). ----

// (The parameters are rounded to float32 as Keras holds them, so these
// compare to 1e-7 of the rate; ParametersAreRoundedAsKerasHoldsThem checks
// the rounding.)
TEST(OptimizerTest, CosineScheduleByHand) {
  // CosineDecay(0.01, decay_steps=4, alpha=0.2), evaluated at step - 1:
  //   s=0: 0.01;  s=2: 0.01 * (0.8 * 0.5 + 0.2) = 0.006;  s>=4: 0.002.
  OptimizerOptions o;
  o.learning_rate = 0.01;
  o.schedule.kind = LearningRateSchedule::Kind::kCosine;
  o.schedule.decay_steps = 4;
  o.schedule.alpha = 0.2;
  const double lr = 0.01, alpha = 0.2;
  EXPECT_NEAR(ScheduledLearningRate(o, 1), lr, 1e-9);
  EXPECT_NEAR(ScheduledLearningRate(o, 2),
              lr * ((1 - alpha) * 0.5 * (1 + std::cos(M_PI / 4)) + alpha), 1e-9);
  EXPECT_NEAR(ScheduledLearningRate(o, 3), lr * ((1 - alpha) * 0.5 + alpha), 1e-9);
  EXPECT_NEAR(ScheduledLearningRate(o, 5), lr * alpha, 1e-9);
  EXPECT_NEAR(ScheduledLearningRate(o, 500), lr * alpha, 1e-9);
  o.schedule.kind = LearningRateSchedule::Kind::kConstant;
  EXPECT_EQ(ScheduledLearningRate(o, 3), static_cast<float>(lr));  // as Keras holds it
}

TEST(OptimizerTest, ExponentialScheduleByHand) {
  // ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5): 0.1 * 0.5^(s/10).
  OptimizerOptions o;
  o.learning_rate = 0.1;
  o.schedule.kind = LearningRateSchedule::Kind::kExponential;
  o.schedule.decay_steps = 10;
  o.schedule.decay_rate = 0.5;
  const double lr = 0.1;
  EXPECT_NEAR(ScheduledLearningRate(o, 1), lr, 1e-8);
  EXPECT_NEAR(ScheduledLearningRate(o, 6), lr * std::pow(0.5, 0.5), 1e-8);
  EXPECT_NEAR(ScheduledLearningRate(o, 21), lr * 0.25, 1e-8);
  o.schedule.staircase = true;
  EXPECT_NEAR(ScheduledLearningRate(o, 6), lr, 1e-8);
  EXPECT_NEAR(ScheduledLearningRate(o, 20), lr * 0.5, 1e-8);
  EXPECT_NEAR(ScheduledLearningRate(o, 21), lr * 0.25, 1e-8);
}

TEST(OptimizerTest, EveryKindAppliesTheScheduledRate) {
  // Plain SGD and Adagrad with a schedule step exactly as with the constant
  // rate the schedule gives at that step; Adam's step size scales with it.
  OptimizerOptions o;
  o.learning_rate = 0.5;
  o.schedule.kind = LearningRateSchedule::Kind::kCosine;
  o.schedule.decay_steps = 2;
  const int64_t step = 2;  // s = 1: half way, rate 0.25
  for (Kind k : {Kind::kSgd, Kind::kAdagrad, Kind::kAdam}) {
    OptimizerOptions scheduled = o, fixed = o;
    scheduled.kind = fixed.kind = k;
    fixed.schedule = {};
    fixed.learning_rate = ScheduledLearningRate(o, step);
    ASSERT_NEAR(fixed.learning_rate, 0.25, 1e-7);
    std::unique_ptr<Optimizer> a = MustCreate(scheduled), b = MustCreate(fixed);
    std::vector<float> pa = {1, -2, 3}, pb = pa, g = {0.5f, 0.25f, -1};
    std::vector<float> sa0(3, a->slot_initial_value(0)), sa1(3, 0.0f), sb0 = sa0, sb1 = sa1;
    float* slots_a[] = {sa0.data(), sa1.data()};
    float* slots_b[] = {sb0.data(), sb1.data()};
    a->Apply(step, pa.data(), slots_a, g.data(), 3);
    b->Apply(step, pb.data(), slots_b, g.data(), 3);
    EXPECT_EQ(pa, pb) << OptimizerKindName(k);
    EXPECT_NE(pa[0], 1.0f) << OptimizerKindName(k);
  }
}

TEST(OptimizerTest, AGrowingScheduleBeyondTheFloatRangeIsInfinite) {
  // Keras allows decay_rate > 1; 1e-3 * 10^42 is past FLT_MAX. The rate
  // becomes +inf (as in Keras's float32 schedule), not an undefined
  // double-to-float conversion.
  OptimizerOptions o;
  o.kind = Kind::kSgd;
  o.learning_rate = 1e-3;
  o.schedule.kind = LearningRateSchedule::Kind::kExponential;
  o.schedule.decay_steps = 1;
  o.schedule.decay_rate = 10;
  std::unique_ptr<Optimizer> opt = MustCreate(o);
  float p = 1.0f, g = 1.0f;
  opt->Apply(43, &p, nullptr, &g, 1);
  EXPECT_EQ(p, -std::numeric_limits<float>::infinity());
  p = 1.0f;
  opt->Apply(3, &p, nullptr, &g, 1);  // 1e-3 * 100 = 0.1
  EXPECT_NEAR(p, 0.9f, 1e-6);
}

TEST(OptimizerTest, ScheduleOptionsAreValidatedAndShown) {
  EXPECT_EQ(*ParseScheduleKind("constant"), LearningRateSchedule::Kind::kConstant);
  EXPECT_EQ(*ParseScheduleKind("cosine"), LearningRateSchedule::Kind::kCosine);
  EXPECT_EQ(*ParseScheduleKind("exponential"), LearningRateSchedule::Kind::kExponential);
  EXPECT_EQ(*ParseScheduleKind("polynomial"), LearningRateSchedule::Kind::kPolynomial);
  EXPECT_EQ(*ParseScheduleKind("inverse_time"), LearningRateSchedule::Kind::kInverseTime);
  EXPECT_EQ(*ParseScheduleKind("piecewise_constant"),
            LearningRateSchedule::Kind::kPiecewiseConstant);
  absl::StatusOr<LearningRateSchedule::Kind> bad = ParseScheduleKind("cosine_restarts");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(),
              AllOf(HasSubstr("\"cosine_restarts\""),
                    HasSubstr("constant, cosine, exponential, polynomial, inverse_time, "
                              "piecewise_constant")));

  OptimizerOptions o;
  o.schedule.kind = LearningRateSchedule::Kind::kCosine;
  ExpectInvalid(o, "decay_steps (--decay_steps)", "> 0");
  o.schedule.decay_steps = 100;
  o.schedule.alpha = 1.5;
  ExpectInvalid(o, "alpha (--cosine_alpha)", "[0, 1]");
  o.schedule.alpha = 0.0;
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, "
            "schedule=cosine(decay_steps=100, alpha=0))");
  o.schedule.kind = LearningRateSchedule::Kind::kExponential;
  o.schedule.decay_rate = 0.0;
  ExpectInvalid(o, "decay_rate (--decay_rate)", "> 0");
  o.schedule.decay_rate = 0.5;
  o.kind = Kind::kSgd;
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "sgd(learning_rate=0.001, momentum=0, nesterov=false, "
            "schedule=exponential(decay_steps=100, decay_rate=0.5, staircase=false))");

  // Warmup.
  o = {};
  o.schedule.kind = LearningRateSchedule::Kind::kCosine;
  o.schedule.decay_steps = 100;
  o.schedule.warmup_steps = -1;
  EXPECT_TRUE(Optimizer::Create(o).ok()) << "without a target, warmup_steps is not read";
  o.schedule.warmup_target = 0.01;
  ExpectInvalid(o, "warmup_steps (--warmup_steps)", ">= 0");
  o.schedule.warmup_steps = 10;
  o.schedule.warmup_target = 0.0;
  ExpectInvalid(o, "warmup_target (--warmup_target)", "> 0");
  o.schedule.warmup_target = 0.01;
  o.learning_rate = 0.0;  // a warmup may start from 0; nothing else may
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "adam(learning_rate=0, beta_1=0.9, beta_2=0.999, epsilon=1e-07, "
            "schedule=cosine(decay_steps=100, alpha=0, warmup_steps=10, warmup_target=0.01))");
  o.schedule.warmup_target.reset();
  ExpectInvalid(o, "learning_rate (--learning_rate)", "> 0");
  // Polynomial.
  o = {};
  o.schedule.kind = LearningRateSchedule::Kind::kPolynomial;
  ExpectInvalid(o,
                "the polynomial learning-rate schedule (--learning_rate_schedule) needs "
                "decay_steps (--decay_steps) > 0",
                "got 0");
  o.schedule.decay_steps = 50;
  o.schedule.power = -1;
  ExpectInvalid(o, "power (--power)", ">= 0");
  o.schedule.power = 0.5;
  o.schedule.end_learning_rate = -1e-4;
  ExpectInvalid(o, "end_learning_rate (--end_learning_rate)", ">= 0");
  o.schedule.end_learning_rate = 1e-5;
  o.schedule.cycle = true;
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, "
            "schedule=polynomial(decay_steps=50, end_learning_rate=1e-05, power=0.5, "
            "cycle=true))");
  // Inverse time: a rate of 0 keeps the learning rate.
  o = {};
  o.schedule.kind = LearningRateSchedule::Kind::kInverseTime;
  o.schedule.decay_steps = 10;
  o.schedule.decay_rate = -0.5;
  ExpectInvalid(o, "decay_rate (--decay_rate)", ">= 0");
  o.schedule.decay_rate = 0.0;
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, "
            "schedule=inverse_time(decay_steps=10, decay_rate=0, staircase=false))");
  // Piecewise constant.
  o = {};
  o.schedule.kind = LearningRateSchedule::Kind::kPiecewiseConstant;
  ExpectInvalid(o, "at least one boundary (--piecewise_boundaries)",
                "got 0 boundaries and 0 values");
  o.schedule.boundaries = {100, 200};
  o.schedule.values = {0.1, 0.01};
  ExpectInvalid(o, "one more value (--piecewise_values) than boundaries",
                "got 2 boundaries and 2 values");
  o.schedule.values = {0.1, 0.01, 0.001};
  o.schedule.boundaries = {200, 100};
  ExpectInvalid(o, "boundaries (--piecewise_boundaries) must increase", "got 200 then 100");
  o.schedule.boundaries = {100, 200};
  o.schedule.values = {0.1, -0.01, 0.001};
  ExpectInvalid(o, "values (--piecewise_values) must be finite and >= 0", "got -0.01");
  o.schedule.values = {0.1, 0.01, 0.001};
  EXPECT_EQ(MustCreate(o)->DebugString(),
            "adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, "
            "schedule=piecewise_constant(boundaries=[100, 200], values=[0.1, 0.01, 0.001]))");
}

// The schedules Keras has beyond cosine and exponential, by hand, at
// s = step - 1 (Keras evaluates at iterations before the update).
TEST(OptimizerTest, CosineWarmupByHand) {
  // CosineDecay(0.0, decay_steps=4, alpha=0.5, warmup_target=0.1, warmup_steps=2):
  // s=0: 0, s=1: 0.05, then from 0.1: s=2: 0.1, s=4: 0.1 * (0.5 * 0.5 + 0.5)
  // = 0.075, s>=6: 0.05.
  OptimizerOptions o;
  o.learning_rate = 0.0;
  o.schedule.kind = LearningRateSchedule::Kind::kCosine;
  o.schedule.decay_steps = 4;
  o.schedule.alpha = 0.5;
  o.schedule.warmup_steps = 2;
  o.schedule.warmup_target = 0.1;
  const double want[] = {0.0,   0.05,
                         0.1,   0.1 * (0.5 * 0.5 * (1 + std::cos(M_PI / 4)) + 0.5),
                         0.075, 0.1 * (0.5 * 0.5 * (1 + std::cos(3 * M_PI / 4)) + 0.5),
                         0.05,  0.05,
                         0.05};
  for (int s = 0; s < static_cast<int>(std::size(want)); ++s) {
    EXPECT_NEAR(ScheduledLearningRate(o, s + 1), want[s], 1e-8) << "s=" << s;
  }
  // No warmup steps: the decay starts at the target at once.
  o.schedule.warmup_steps = 0;
  EXPECT_NEAR(ScheduledLearningRate(o, 1), 0.1, 1e-8);
}

TEST(OptimizerTest, PolynomialScheduleByHand) {
  // PolynomialDecay(0.1, decay_steps=4, end_learning_rate=0.02, power=2):
  // (0.08) * (1 - s/4)^2 + 0.02.
  OptimizerOptions o;
  o.learning_rate = 0.1;
  o.schedule.kind = LearningRateSchedule::Kind::kPolynomial;
  o.schedule.decay_steps = 4;
  o.schedule.end_learning_rate = 0.02;
  o.schedule.power = 2;
  const double no_cycle[] = {0.1, 0.065, 0.04, 0.025, 0.02, 0.02, 0.02};
  for (int s = 0; s < 7; ++s) {
    EXPECT_NEAR(ScheduledLearningRate(o, s + 1), no_cycle[s], 1e-8) << "s=" << s;
  }
  // With cycle, s = 5 decays over 8 steps: 0.08 * (3/8)^2 + 0.02; s = 4
  // ends the first cycle at the end rate, s = 0 uses one span.
  o.schedule.cycle = true;
  EXPECT_NEAR(ScheduledLearningRate(o, 1), 0.1, 1e-8);
  EXPECT_NEAR(ScheduledLearningRate(o, 5), 0.02, 1e-8);
  EXPECT_NEAR(ScheduledLearningRate(o, 6), 0.08 * (3.0 / 8) * (3.0 / 8) + 0.02, 1e-8);
  EXPECT_NEAR(ScheduledLearningRate(o, 9), 0.02, 1e-8);
}

TEST(OptimizerTest, InverseTimeScheduleByHand) {
  // InverseTimeDecay(0.1, decay_steps=2, decay_rate=0.5): 0.1 / (1 + 0.5 * s / 2).
  OptimizerOptions o;
  o.learning_rate = 0.1;
  o.schedule.kind = LearningRateSchedule::Kind::kInverseTime;
  o.schedule.decay_steps = 2;
  o.schedule.decay_rate = 0.5;
  for (int s = 0; s < 6; ++s) {
    EXPECT_NEAR(ScheduledLearningRate(o, s + 1), 0.1 / (1 + 0.25 * s), 1e-8) << "s=" << s;
  }
  o.schedule.staircase = true;  // s / 2 floored
  for (int s = 0; s < 6; ++s) {
    EXPECT_NEAR(ScheduledLearningRate(o, s + 1), 0.1 / (1 + 0.5 * (s / 2)), 1e-8) << "s=" << s;
  }
}

// Keras holds a schedule's parameters as float32 tensors and raises the
// float32 decay rate to the power: rounding the rate only at the end, as
// psflow did, put ExponentialDecay(0.1, 1, 0.99999) 1.4 % off Keras's
// 0.0367378369 (Keras 3.15, TensorFlow 2.21) after 100,000 steps.
TEST(OptimizerTest, ParametersAreRoundedAsKerasHoldsThem) {
  OptimizerOptions o;
  o.learning_rate = 0.1;
  o.schedule.kind = LearningRateSchedule::Kind::kExponential;
  o.schedule.decay_steps = 1;
  o.schedule.decay_rate = 0.99999;
  // The same float32 as Keras's 0.0367378368973732.
  EXPECT_EQ(static_cast<float>(ScheduledLearningRate(o, 100001)), 0.0367378368973732f);
  o.schedule.kind = LearningRateSchedule::Kind::kInverseTime;  // 0.1 / (1 + 0.99999 s)
  const double rate = static_cast<float>(0.99999), lr = static_cast<float>(0.1);
  EXPECT_EQ(ScheduledLearningRate(o, 11), lr / (1 + rate * 10));
}

TEST(OptimizerTest, PiecewiseConstantScheduleByHand) {
  // PiecewiseConstantDecay([2, 5], [0.1, 0.01, 0.001]): s <= 2 -> 0.1,
  // 2 < s <= 5 -> 0.01, s > 5 -> 0.001; the learning rate is not read.
  OptimizerOptions o;
  o.learning_rate = 7.0;
  o.schedule.kind = LearningRateSchedule::Kind::kPiecewiseConstant;
  o.schedule.boundaries = {2, 5};
  o.schedule.values = {0.1, 0.01, 0.001};
  const double want[] = {0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.001, 0.001};
  for (int s = 0; s < 8; ++s) {
    EXPECT_EQ(ScheduledLearningRate(o, s + 1), static_cast<float>(want[s])) << "s=" << s;
  }
}

}  // namespace
}  // namespace psflow::server
