// Tests of the reference backend: layer ops against hand-computed values,
// every parameter gradient against central finite differences of the mean
// loss (in double precision through ReferenceNet<double>, and in float
// through the ComputeBackend), the loss against a hand computation, and the
// argument checks.
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/backend.h"
#include "worker/cpu/cpu_backend.h"
#include "worker/cpu/reference_net.h"
#include "worker/cpu/reference_ops.h"
#include "worker/model/model_def.h"

namespace psflow::worker {
namespace {

using ::testing::HasSubstr;

template <typename T>
std::vector<const T*> ConstPtrs(const std::vector<std::vector<T>>& v) {
  std::vector<const T*> p;
  for (const auto& x : v) p.push_back(x.data());
  return p;
}
template <typename T>
std::vector<T*> Ptrs(std::vector<std::vector<T>>& v) {
  std::vector<T*> p;
  for (auto& x : v) p.push_back(x.data());
  return p;
}

ModelDef Parse(const std::string& spec, Shape3 input) {
  auto m = ParseModel(spec, input);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : ModelDef{};
}

// A random problem: Glorot kernels, random non-zero biases (so relus and
// pools see mixed signs), images in [-1, 1], labels in range.
struct Problem {
  ModelDef model;
  int batch = 0;
  std::vector<std::vector<double>> params;
  std::vector<double> images;
  std::vector<int32_t> labels;
};

Problem MakeProblem(const std::string& spec, Shape3 input, int batch, uint64_t seed) {
  Problem p;
  p.model = Parse(spec, input);
  p.batch = batch;
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (const auto& v : InitializeVariables(p.model, seed))
    p.params.emplace_back(v.begin(), v.end());
  for (const LayerDef& l : p.model.layers) {
    if (l.bias_var < 0) continue;
    for (double& b : p.params[l.bias_var]) b = 0.2 * u(gen);
  }
  p.images.resize(batch * input.size());
  for (double& x : p.images) x = u(gen);
  for (int b = 0; b < batch; ++b)
    p.labels.push_back(static_cast<int32_t>(gen() % p.model.num_classes));
  return p;
}

double MeanLoss(reference::ReferenceNet<double>& net, const Problem& p) {
  StepResult r;
  const auto params = ConstPtrs(p.params);
  EXPECT_TRUE(net.Run(params, p.images.data(), p.labels.data(), p.batch, {}, false, &r).ok());
  return r.loss_sum / p.batch;
}

// Checks every gradient element of the double-precision net against central
// differences, and the float backend's gradients against the double ones.
void CheckGradients(const std::string& spec, Shape3 input, int batch, uint64_t seed) {
  SCOPED_TRACE(spec);
  Problem p = MakeProblem(spec, input, batch, seed);
  reference::ReferenceNet<double> net;
  ASSERT_TRUE(net.Prepare(p.model, batch).ok());
  std::vector<std::vector<double>> grads;
  for (const auto& v : p.params) grads.emplace_back(v.size(), 0.0);
  StepResult r;
  const auto cparams = ConstPtrs(p.params);
  const auto gptrs = Ptrs(grads);
  ASSERT_TRUE(net.Run(cparams, p.images.data(), p.labels.data(), batch, gptrs, true, &r).ok());

  constexpr double kStep = 1e-6;
  for (size_t v = 0; v < p.params.size(); ++v) {
    for (size_t i = 0; i < p.params[v].size(); ++i) {
      const double saved = p.params[v][i];
      p.params[v][i] = saved + kStep;
      const double up = MeanLoss(net, p);
      p.params[v][i] = saved - kStep;
      const double down = MeanLoss(net, p);
      p.params[v][i] = saved;
      const double fd = (up - down) / (2 * kStep);
      ASSERT_NEAR(grads[v][i], fd, 1e-6 + 1e-4 * std::fabs(fd))
          << p.model.variables[v].name << "[" << i << "]";
    }
  }

  // The float backend agrees with the double net.
  auto backend = CreateReferenceBackend({});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->Prepare(p.model, batch + 2).ok());
  std::vector<std::vector<float>> fparams, fgrads;
  for (const auto& v : p.params) {
    fparams.emplace_back(v.begin(), v.end());
    fgrads.emplace_back(v.size(), 123.0f);  // must be overwritten
  }
  std::vector<float> fimages(p.images.begin(), p.images.end());
  StepResult fr;
  ASSERT_TRUE(
      (*backend)
          ->TrainStep(ConstPtrs(fparams), fimages.data(), p.labels.data(), batch, Ptrs(fgrads), &fr)
          .ok());
  EXPECT_NEAR(fr.loss_sum, r.loss_sum, 1e-4 * batch);
  EXPECT_EQ(fr.correct, r.correct);
  for (size_t v = 0; v < grads.size(); ++v) {
    for (size_t i = 0; i < grads[v].size(); ++i) {
      ASSERT_NEAR(fgrads[v][i], grads[v][i], 1e-5 + 1e-3 * std::fabs(grads[v][i]))
          << p.model.variables[v].name << "[" << i << "]";
    }
  }
}

TEST(ReferenceGradientTest, EveryLayerKindAndOption) {
  CheckGradients("conv2d:3:3:relu:same,maxpool:2,conv2d:2:2:s2,flatten,dense:4:relu,dense:3",
                 Shape3{6, 6, 2}, 3, 1);
}

TEST(ReferenceGradientTest, ValidConvWithStride) {
  CheckGradients("conv2d:3:3:s2:relu,conv2d:2:2,flatten,dense:3", Shape3{7, 8, 2}, 2, 2);
}

TEST(ReferenceGradientTest, SameConvWithEvenKernelAndStride) {
  // Asymmetric padding: pad_total = (3-1)*2+4-5 = 3, one row before, two after.
  CheckGradients("conv2d:2:4:same:s2,flatten,dense:2", Shape3{5, 5, 1}, 2, 3);
}

TEST(ReferenceGradientTest, MaxPoolWithStrideUnlikePoolSize) {
  CheckGradients("conv2d:2:2:relu,maxpool:3:s2:same,maxpool:2:s1,flatten,dense:3", Shape3{7, 7, 1},
                 3, 4);
  CheckGradients("maxpool:3:s1,flatten,dense:4:relu,dense:2", Shape3{5, 4, 3}, 2, 5);
}

TEST(ReferenceGradientTest, FloatBackendMatchesFiniteDifferences) {
  // Float finite differences through the ComputeBackend interface itself.
  Problem p = MakeProblem("conv2d:3:3:relu:same,maxpool:2,flatten,dense:4:relu,dense:3",
                          Shape3{6, 6, 2}, 3, 6);
  auto backend = CreateReferenceBackend({});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->Prepare(p.model, p.batch).ok());
  std::vector<std::vector<float>> params, grads;
  for (const auto& v : p.params) {
    params.emplace_back(v.begin(), v.end());
    grads.emplace_back(v.size());
  }
  std::vector<float> images(p.images.begin(), p.images.end());
  StepResult r;
  ASSERT_TRUE(
      (*backend)
          ->TrainStep(ConstPtrs(params), images.data(), p.labels.data(), p.batch, Ptrs(grads), &r)
          .ok());
  auto mean_loss = [&] {
    StepResult e;
    EXPECT_TRUE(
        (*backend)->Evaluate(ConstPtrs(params), images.data(), p.labels.data(), p.batch, &e).ok());
    return e.loss_sum / p.batch;
  };
  constexpr float kStep = 1e-3f;
  for (size_t v = 0; v < params.size(); ++v) {
    for (size_t i = 0; i < params[v].size(); ++i) {
      const float saved = params[v][i];
      params[v][i] = saved + kStep;
      const double up = mean_loss();
      params[v][i] = saved - kStep;
      const double down = mean_loss();
      params[v][i] = saved;
      const double fd = (up - down) / (double{saved + kStep} - double{saved - kStep});
      ASSERT_NEAR(grads[v][i], fd, 1e-3 + 1e-2 * std::fabs(fd))
          << p.model.variables[v].name << "[" << i << "]";
    }
  }
}

TEST(ReferenceOpsTest, SameConvPaddingMatchesHandComputedSums) {
  // 3x3 input in[i][j] = 3i + j, one 2x2 all-ones filter, same padding:
  // pad_total = 1 goes after (TF), so out[i][j] sums in[i..i+1][j..j+1].
  ModelDef m = Parse("conv2d:1:2:same,flatten,dense:2", Shape3{3, 3, 1});
  std::vector<double> in(9), kernel(4, 1.0), bias{0.5}, out(9);
  for (int i = 0; i < 9; ++i) in[i] = i;
  reference::Conv2DForward(m.layers[0], 1, in.data(), kernel.data(), bias.data(), out.data());
  const double expected[9] = {
      0 + 1 + 3 + 4, 1 + 2 + 4 + 5, 2 + 5, 3 + 4 + 6 + 7, 4 + 5 + 7 + 8, 5 + 8, 6 + 7, 7 + 8, 8};
  for (int i = 0; i < 9; ++i) EXPECT_DOUBLE_EQ(out[i], expected[i] + 0.5) << i;

  // 3x3 all-ones filter on a 3x3 all-ones input, same: counts of neighbours.
  ModelDef m3 = Parse("conv2d:1:3:same,flatten,dense:2", Shape3{3, 3, 1});
  std::vector<double> ones(9, 1.0), k9(9, 1.0), zero{0.0};
  reference::Conv2DForward(m3.layers[0], 1, ones.data(), k9.data(), zero.data(), out.data());
  const double counts[9] = {4, 6, 4, 6, 9, 6, 4, 6, 4};
  for (int i = 0; i < 9; ++i) EXPECT_DOUBLE_EQ(out[i], counts[i]) << i;
}

TEST(ReferenceOpsTest, ConvKernelLayoutIsKerasHwio) {
  // 1x1 input with 2 channels, 1x1 kernel [1,1,2,3]: out[f] = sum_c x[c] * K[c][f].
  ModelDef m = Parse("conv2d:3:1,flatten,dense:2", Shape3{1, 1, 2});
  std::vector<double> x{2, 3}, k{1, 10, 100, 1000, 10000, 100000}, b{0, 0, 0}, out(3);
  reference::Conv2DForward(m.layers[0], 1, x.data(), k.data(), b.data(), out.data());
  EXPECT_DOUBLE_EQ(out[0], 2 * 1 + 3 * 1000);
  EXPECT_DOUBLE_EQ(out[1], 2 * 10 + 3 * 10000);
  EXPECT_DOUBLE_EQ(out[2], 2 * 100 + 3 * 100000);
}

TEST(ReferenceOpsTest, MaxPoolRoutesTiedGradientToTheFirstMax) {
  ModelDef m = Parse("maxpool:2,flatten,dense:2", Shape3{2, 2, 1});
  const LayerDef& pool = m.layers[0];
  std::vector<double> tied{5, 5, 5, 5}, d_out{2.0}, d_in(4), out(1);
  reference::MaxPoolForward(pool, 1, tied.data(), out.data());
  EXPECT_EQ(out[0], 5);
  reference::MaxPoolBackward(pool, 1, tied.data(), d_out.data(), d_in.data());
  EXPECT_THAT(d_in, ::testing::ElementsAre(2, 0, 0, 0));
  std::vector<double> later{1, 3, 3, 2};
  reference::MaxPoolBackward(pool, 1, later.data(), d_out.data(), d_in.data());
  EXPECT_THAT(d_in, ::testing::ElementsAre(0, 2, 0, 0));
}

TEST(ReferenceOpsTest, SameMaxPoolIgnoresPadding) {
  // All-negative 3x3 input, pool 2 same (stride 2): out 2x2, padding after;
  // a zero-padded pool would output 0 in the last row/column.
  ModelDef m = Parse("maxpool:2:same,flatten,dense:2", Shape3{3, 3, 1});
  std::vector<double> in{-1, -2, -3, -4, -5, -6, -7, -8, -9}, out(4);
  reference::MaxPoolForward(m.layers[0], 1, in.data(), out.data());
  EXPECT_THAT(out, ::testing::ElementsAre(-1, -3, -7, -9));
}

TEST(ReferenceBackendTest, LossOfOneDenseLayerMatchesHandComputation) {
  ModelDef m = Parse("dense:3", Shape3{1, 1, 2});
  std::vector<std::vector<float>> params = {{0.1f, 0.2f, -0.3f, 0.4f, -0.5f, 0.6f},
                                            {0.0f, 0.1f, -0.1f}};
  std::vector<float> images = {1, -1, 0.5f, 2};
  std::vector<int32_t> labels = {1, 0};
  // Logits by hand: x0 W + b = [-0.3, 0.8, -1.0]; x1 W + b = [0.85, -0.8, 0.95].
  const double z[2][3] = {{-0.3, 0.8, -1.0}, {0.85, -0.8, 0.95}};
  double expected = 0;
  double dz[2][3];
  for (int b = 0; b < 2; ++b) {
    double sum = 0;
    for (double v : z[b]) sum += std::exp(v);
    expected += std::log(sum) - z[b][labels[b]];
    for (int j = 0; j < 3; ++j) dz[b][j] = (std::exp(z[b][j]) / sum - (j == labels[b])) / 2;
  }
  auto backend = CreateReferenceBackend({});
  ASSERT_TRUE(backend.ok());
  EXPECT_EQ((*backend)->name(), "reference");
  ASSERT_TRUE((*backend)->Prepare(m, 4).ok());
  std::vector<std::vector<float>> grads = {std::vector<float>(6), std::vector<float>(3)};
  StepResult r;
  r.loss_sum = 1.0;  // TrainStep adds to it
  r.correct = 5;
  ASSERT_TRUE((*backend)
                  ->TrainStep(ConstPtrs(params), images.data(), labels.data(), 2, Ptrs(grads), &r)
                  .ok());
  EXPECT_NEAR(r.loss_sum, 1.0 + expected, 1e-5);
  EXPECT_EQ(r.correct, 5 + 1);  // example 0 right (argmax 1), example 1 wrong (argmax 2)
  for (int j = 0; j < 3; ++j) {
    EXPECT_NEAR(grads[1][j], dz[0][j] + dz[1][j], 1e-6) << j;
    for (int i = 0; i < 2; ++i) {
      EXPECT_NEAR(grads[0][i * 3 + j], images[i] * dz[0][j] + images[2 + i] * dz[1][j], 1e-6);
    }
  }
  StepResult e;
  ASSERT_TRUE((*backend)->Evaluate(ConstPtrs(params), images.data(), labels.data(), 2, &e).ok());
  EXPECT_NEAR(e.loss_sum, expected, 1e-5);
  EXPECT_EQ(e.correct, 1);
}

TEST(ReferenceBackendTest, HugeLogitsStayFinite) {
  // Logits [1000, 0] with label 1: loss = 1000 + log(1 + e^-1000) = 1000.
  ModelDef m = Parse("dense:2", Shape3{1, 1, 1});
  std::vector<std::vector<float>> params = {{1000.0f, 0.0f}, {0.0f, 0.0f}};
  std::vector<float> image = {1.0f};
  std::vector<int32_t> label = {1};
  auto backend = CreateReferenceBackend({});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->Prepare(m, 1).ok());
  std::vector<std::vector<float>> grads = {std::vector<float>(2), std::vector<float>(2)};
  StepResult r;
  ASSERT_TRUE((*backend)
                  ->TrainStep(ConstPtrs(params), image.data(), label.data(), 1, Ptrs(grads), &r)
                  .ok());
  EXPECT_NEAR(r.loss_sum, 1000.0, 1e-3);
  EXPECT_EQ(r.correct, 0);
  EXPECT_NEAR(grads[1][0], 1.0, 1e-6);  // softmax [1, 0] - one_hot [0, 1]
  EXPECT_NEAR(grads[1][1], -1.0, 1e-6);
}

TEST(ReferenceBackendTest, RejectsBadArguments) {
  ModelDef m = Parse("flatten,dense:3", Shape3{2, 1, 1});
  auto backend = CreateReferenceBackend({});
  ASSERT_TRUE(backend.ok());
  std::vector<std::vector<float>> params = {std::vector<float>(6, 0.1f), std::vector<float>(3)};
  std::vector<std::vector<float>> grads = params;
  std::vector<float> images(2 * 5, 0.5f);
  std::vector<int32_t> labels = {0, 1, 2, 0, 1};
  StepResult r;
  auto step = [&](int batch, const std::vector<int32_t>& l) {
    return (*backend)->TrainStep(ConstPtrs(params), images.data(), l.data(), batch, Ptrs(grads),
                                 &r);
  };
  EXPECT_EQ(step(1, labels).code(), absl::StatusCode::kFailedPrecondition);  // no Prepare
  ASSERT_TRUE((*backend)->Prepare(m, 4).ok());
  EXPECT_TRUE(step(4, labels).ok());
  absl::Status too_big = step(5, labels);
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.message(), HasSubstr("got 5"));
  EXPECT_EQ(step(0, labels).code(), absl::StatusCode::kInvalidArgument);
  absl::Status bad_label = step(2, {0, 3});
  EXPECT_EQ(bad_label.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_label.message(), HasSubstr("label of example 1 is 3"));
  EXPECT_EQ(step(1, {-1}).code(), absl::StatusCode::kInvalidArgument);
  std::vector<const float*> one_param = {params[0].data()};
  EXPECT_EQ(
      (*backend)->TrainStep(one_param, images.data(), labels.data(), 1, Ptrs(grads), &r).code(),
      absl::StatusCode::kInvalidArgument);
  std::vector<float*> one_grad = {grads[0].data()};
  EXPECT_EQ((*backend)
                ->TrainStep(ConstPtrs(params), images.data(), labels.data(), 1, one_grad, &r)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*backend)->Evaluate(one_param, images.data(), labels.data(), 1, &r).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*backend)->Evaluate(ConstPtrs(params), images.data(), labels.data(), 5, &r).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReferenceBackendTest, SeedModelTrainsOnAFixedBatch) {
  // Plain SGD on one batch of the seed model must lower its loss; at Glorot
  // initialization (zero biases, small logits) the mean loss is near ln(10).
  ModelDef m = Parse("seed", Shape3{28, 28, 1});
  constexpr int kBatch = 8;
  auto params = InitializeVariables(m, 11);
  std::vector<std::vector<float>> grads;
  for (const auto& v : params) grads.emplace_back(v.size());
  std::mt19937_64 gen(3);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> images(kBatch * 28 * 28);
  for (float& x : images) x = u(gen);
  std::vector<int32_t> labels;
  for (int b = 0; b < kBatch; ++b) labels.push_back(b % 10);
  auto backend = CreateReferenceBackend({});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->Prepare(m, kBatch).ok());
  double first = 0, last = 0;
  for (int step = 0; step < 5; ++step) {
    StepResult r;
    ASSERT_TRUE(
        (*backend)
            ->TrainStep(ConstPtrs(params), images.data(), labels.data(), kBatch, Ptrs(grads), &r)
            .ok());
    if (step == 0) first = r.loss_sum / kBatch;
    last = r.loss_sum / kBatch;
    for (size_t v = 0; v < params.size(); ++v) {
      for (size_t i = 0; i < params[v].size(); ++i) params[v][i] -= 0.05f * grads[v][i];
    }
  }
  EXPECT_NEAR(first, std::log(10.0), 1.0);
  EXPECT_LT(last, first - 0.1);
}

}  // namespace
}  // namespace psflow::worker
