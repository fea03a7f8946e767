// Gradient clipping on the worker against Keras 3's formulas
// (keras/src/optimizers/base_optimizer.py: _clip_by_norm, clip_by_global_norm,
// ops.clip), computed here by hand.
#include "worker/gradient_clip.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::worker {
namespace {

using ::testing::HasSubstr;

struct Grads {
  std::vector<std::vector<float>> data;
  std::vector<float*> ptrs;
  std::vector<int64_t> sizes;
  explicit Grads(std::vector<std::vector<float>> d) : data(std::move(d)) {
    for (auto& v : data) {
      ptrs.push_back(v.data());
      sizes.push_back(static_cast<int64_t>(v.size()));
    }
  }
  void Clip(const ClipOptions& o) { ClipGradients(o, ptrs, sizes); }
};

// Per variable: a gradient longer than clipnorm is scaled to it, a shorter
// one keeps its values (g * c / c).
TEST(GradientClipTest, ClipNormScalesEachVariableOnItsOwn) {
  Grads g({{3, 4}, {0.3f, 0.4f}, {0, 0}});  // norms 5, 0.5, 0
  ClipOptions o;
  o.clipnorm = 1.0;
  g.Clip(o);
  EXPECT_THAT(g.data[0], ::testing::ElementsAre(0.6f, 0.8f));  // 3 * 1 / 5, 4 * 1 / 5
  EXPECT_THAT(g.data[1], ::testing::ElementsAre(0.3f, 0.4f));
  EXPECT_THAT(g.data[2], ::testing::ElementsAre(0.0f, 0.0f));  // no NaN from a zero norm
}

// All variables together: scaled by clip / global norm when it is longer.
TEST(GradientClipTest, GlobalClipNormScalesAllByOneFactor) {
  Grads g({{3, 0}, {0, 4}});  // global norm 5
  ClipOptions o;
  o.global_clipnorm = 2.5;
  g.Clip(o);
  EXPECT_THAT(g.data[0], ::testing::ElementsAre(1.5f, 0.0f));
  EXPECT_THAT(g.data[1], ::testing::ElementsAre(0.0f, 2.0f));
  Grads small({{0.3f}, {0.4f}});  // norm 0.5 < 2.5: scale 2.5 * (1 / 2.5)
  small.Clip(o);
  const float scale = 2.5f * static_cast<float>(1.0 / 2.5);
  EXPECT_EQ(small.data[0][0], 0.3f * scale);
  EXPECT_EQ(small.data[1][0], 0.4f * scale);
}

// Keras multiplies by the clip, then divides by the norm, each rounded: the
// other order gives other floats for some elements, and would fail here.
TEST(GradientClipTest, ClipNormMultipliesThenDivides) {
  std::vector<float> values;
  for (int i = 1; i <= 64; ++i) values.push_back(0.013f * static_cast<float>(i * i % 37));
  Grads g({values});
  ClipOptions o;
  o.clipnorm = 0.3;
  g.Clip(o);
  double sum = 0;
  for (float x : values) sum += static_cast<double>(x) * x;
  const float norm = static_cast<float>(std::sqrt(sum)), clip = 0.3f;
  ASSERT_GT(norm, clip);
  int orders_differ = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(g.data[0][i], (values[i] * clip) / norm) << i;
    orders_differ += (values[i] * clip) / norm != (values[i] / norm) * clip;
  }
  EXPECT_GT(orders_differ, 0) << "these values cannot tell the orders apart";
}

// A gradient whose norm is not finite is left as it is (Keras makes it NaN),
// so that the push's check names the element; clipnorm leaves the other
// variables' clipped.
TEST(GradientClipTest, NonFiniteNormsLeaveTheGradientForThePushsCheck) {
  const float inf = std::numeric_limits<float>::infinity();
  for (bool global : {false, true}) {
    SCOPED_TRACE(global ? "global_clipnorm" : "clipnorm");
    Grads g({{inf, 1}, {3, 4}});
    ClipOptions o;
    (global ? o.global_clipnorm : o.clipnorm) = 1;
    g.Clip(o);
    EXPECT_EQ(g.data[0][0], inf);
    EXPECT_EQ(g.data[0][1], 1.0f);
    if (global) {
      EXPECT_THAT(g.data[1], ::testing::ElementsAre(3.0f, 4.0f));
    } else {
      EXPECT_THAT(g.data[1], ::testing::ElementsAre(0.6f, 0.8f));
    }
  }
}

// Norms whose squares are beyond float32 (Keras's float32 sum would
// overflow there): clipped by the norm, summed in double.
TEST(GradientClipTest, NormsBeyondFloatSquaresAreClipped) {
  Grads g({{3e19f, -4e19f}});  // norm 5e19, its square 2.5e39
  ClipOptions o;
  o.clipnorm = 1;
  g.Clip(o);
  EXPECT_FLOAT_EQ(g.data[0][0], 0.6f);
  EXPECT_FLOAT_EQ(g.data[0][1], -0.8f);
}

TEST(GradientClipTest, ClipValueClipsEachElement) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Grads g({{-3, -0.5f, 0, 0.25f, 7, nan}});
  ClipOptions o;
  o.clipvalue = 0.5;
  g.Clip(o);
  EXPECT_EQ(g.data[0][0], -0.5f);
  EXPECT_EQ(g.data[0][1], -0.5f);
  EXPECT_EQ(g.data[0][2], 0.0f);
  EXPECT_EQ(g.data[0][3], 0.25f);
  EXPECT_EQ(g.data[0][4], 0.5f);
  EXPECT_TRUE(std::isnan(g.data[0][5]));
}

TEST(GradientClipTest, OffLeavesTheGradientAlone) {
  Grads g({{3, 4}});
  ClipOptions o;
  EXPECT_FALSE(o.enabled());
  g.Clip(o);
  EXPECT_THAT(g.data[0], ::testing::ElementsAre(3.0f, 4.0f));
}

TEST(GradientClipTest, BadOptionsAreRefusedNamingTheFlag) {
  EXPECT_TRUE(ValidateClipOptions({}).ok());
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double bad : {-1.0, nan, 1e300, 1e-50, 1e-39}) {
    ClipOptions o;
    o.clipvalue = bad;
    const absl::Status s = ValidateClipOptions(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("--clipvalue="));
    EXPECT_THAT(s.message(), HasSubstr("expected 0 (off) or a finite value > 0 (from 1.17549e-38"));
  }
  ClipOptions two;
  two.clipnorm = 1;
  two.global_clipnorm = 5;
  EXPECT_THAT(ValidateClipOptions(two).message(), HasSubstr("at most one may be set"));
}

}  // namespace
}  // namespace psflow::worker
