// The oneDNN ("cpu") backend against the reference implementation: for small
// models covering every layer kind and option, the loss, the correct count
// and every gradient must match ReferenceNet<double> (the plain loops of
// worker/cpu/reference_ops.h run in double precision).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "worker/backend.h"
#include "worker/cpu/cpu_backend.h"
#include "worker/cpu/reference_net.h"
#include "worker/model/model_def.h"

namespace psflow::worker {
namespace {

// Parameters, a batch and the double-precision reference results for them.
struct Case {
  ModelDef model;
  std::vector<std::vector<float>> params;
  std::vector<float> images;
  std::vector<int32_t> labels;
};

Case MakeCase(const std::string& spec, Shape3 input, int batch, uint64_t seed) {
  Case c;
  absl::StatusOr<ModelDef> model = ParseModel(spec, input);
  EXPECT_TRUE(model.ok()) << model.status();
  c.model = *model;
  c.params = InitializeVariables(c.model, seed);
  std::mt19937_64 gen(seed + 1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  // Keras starts biases at zero; random ones exercise the bias paths and
  // move ReLU boundaries.
  for (const LayerDef& l : c.model.layers) {
    if (l.bias_var < 0) continue;
    for (float& b : c.params[l.bias_var]) b = 0.2f * uniform(gen);
  }
  c.images.resize(batch * input.size());
  for (float& x : c.images) x = uniform(gen);
  std::uniform_int_distribution<int32_t> label(0, c.model.num_classes - 1);
  for (int i = 0; i < batch; ++i) c.labels.push_back(label(gen));
  return c;
}

struct Outcome {
  StepResult result;
  std::vector<std::vector<double>> grads;
};

Outcome RunReference(const Case& c, int batch) {
  reference::ReferenceNet<double> net;
  EXPECT_TRUE(net.Prepare(c.model, batch).ok());
  std::vector<std::vector<double>> params;
  for (const auto& p : c.params) params.emplace_back(p.begin(), p.end());
  const std::vector<double> images(c.images.begin(),
                                   c.images.begin() + batch * c.model.input.size());
  Outcome out;
  std::vector<const double*> param_ptrs;
  std::vector<double*> grad_ptrs;
  for (size_t i = 0; i < params.size(); ++i) {
    param_ptrs.push_back(params[i].data());
    out.grads.emplace_back(params[i].size(), 0.0);
  }
  for (auto& g : out.grads) grad_ptrs.push_back(g.data());
  const absl::Status s =
      net.Run(param_ptrs, images.data(), c.labels.data(), batch, grad_ptrs, true, &out.result);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// Runs one TrainStep of `backend` (already prepared) on the first `batch`
// examples of `c`. The gradient buffers start as NaN so that any element the
// backend fails to write shows up.
Outcome RunBackend(ComputeBackend* backend, const Case& c, int batch) {
  Outcome out;
  std::vector<const float*> param_ptrs;
  std::vector<std::vector<float>> grads;
  for (const auto& p : c.params) {
    param_ptrs.push_back(p.data());
    grads.emplace_back(p.size(), std::numeric_limits<float>::quiet_NaN());
  }
  std::vector<float*> grad_ptrs;
  for (auto& g : grads) grad_ptrs.push_back(g.data());
  const absl::Status s = backend->TrainStep(param_ptrs, c.images.data(), c.labels.data(), batch,
                                            grad_ptrs, &out.result);
  EXPECT_TRUE(s.ok()) << s;
  for (const auto& g : grads) out.grads.emplace_back(g.begin(), g.end());
  return out;
}

// Loss within relative 1e-5; each gradient element within 1e-4 relative
// plus 1e-5 of the largest magnitude of that variable's reference gradient
// (float accumulation over up to ~20k terms against a double reference).
void ExpectMatches(const Case& c, const Outcome& got, const Outcome& want) {
  EXPECT_NEAR(got.result.loss_sum, want.result.loss_sum,
              1e-5 * std::max(1.0, std::abs(want.result.loss_sum)));
  EXPECT_EQ(got.result.correct, want.result.correct);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t v = 0; v < want.grads.size(); ++v) {
    const std::vector<double>& w = want.grads[v];
    const std::vector<double>& g = got.grads[v];
    ASSERT_EQ(g.size(), w.size()) << c.model.variables[v].name;
    double max_abs = 0;
    for (double x : w) max_abs = std::max(max_abs, std::abs(x));
    ASSERT_GT(max_abs, 0.0) << c.model.variables[v].name << ": reference gradient is all zero";
    int bad = 0;
    for (size_t i = 0; i < w.size() && bad < 5; ++i) {
      const double tol = 1e-4 * std::abs(w[i]) + 1e-5 * max_abs;
      if (!(std::abs(g[i] - w[i]) <= tol)) {  // also catches NaN
        ADD_FAILURE() << c.model.variables[v].name << "[" << i << "]: got " << g[i]
                      << ", reference " << w[i] << " (tolerance " << tol << ")";
        ++bad;
      }
    }
  }
}

std::unique_ptr<ComputeBackend> NewBackend(int threads = 1) {
  BackendOptions options;
  options.threads = threads;
  absl::StatusOr<std::unique_ptr<ComputeBackend>> b = CreateOneDnnBackend(options);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

struct ModelCase {
  const char* spec;
  Shape3 input;
  int batch;
};

class OneDnnMatchesReference : public ::testing::TestWithParam<ModelCase> {};

TEST_P(OneDnnMatchesReference, LossCorrectAndGradients) {
  const ModelCase& m = GetParam();
  const Case c = MakeCase(m.spec, m.input, m.batch, 42);
  std::unique_ptr<ComputeBackend> backend = NewBackend();
  ASSERT_NE(backend, nullptr);
  ASSERT_TRUE(backend->Prepare(c.model, m.batch).ok());
  ExpectMatches(c, RunBackend(backend.get(), c, m.batch), RunReference(c, m.batch));
}

INSTANTIATE_TEST_SUITE_P(
    Models, OneDnnMatchesReference,
    ::testing::Values(
        ModelCase{kSeedModelSpec, {28, 28, 1}, 4}, ModelCase{kTwoConvModelSpec, {28, 28, 1}, 2},
        // same padding, relu, pool 2, two dense layers
        ModelCase{"conv2d:4:3:relu:same,maxpool:2,flatten,dense:6:relu,dense:5", {8, 8, 2}, 5},
        // valid stride-2 conv without relu, then an even-kernel same conv
        // (padding only after), pool 3 with stride 2
        ModelCase{"conv2d:3:3:valid:s2,conv2d:5:2:relu:same,maxpool:3:s2,flatten,dense:4",
                  {11, 11, 3},
                  5},
        ModelCase{"conv2d:3:3:valid:s2,conv2d:5:2:relu:same,maxpool:3:s2,flatten,dense:4",
                  {11, 11, 3},
                  1},
        // non-square input, same stride-2 conv, same stride-1 pool
        ModelCase{
            "conv2d:6:5:relu:same:s2,maxpool:2:s1:same,conv2d:4:3,flatten,dense:7:relu,dense:3",
            {10, 9, 1},
            3},
        // channel counts that make oneDNN choose blocked layouts
        ModelCase{
            "conv2d:16:3:relu,conv2d:32:3:relu:s2,maxpool:2,flatten,dense:10", {12, 12, 3}, 5},
        // dense first (no input gradient), dense without relu in the middle
        ModelCase{"flatten,dense:8,dense:6:relu,dense:3", {4, 3, 2}, 5},
        // pooling first: nothing below it to back-propagate into
        ModelCase{"maxpool:2,flatten,dense:3", {6, 6, 2}, 5}));

TEST(OneDnnBackendTest, SmallerBatchesThanMaxBatchMatchReference) {
  const Case c = MakeCase("conv2d:8:3:relu,maxpool:2,flatten,dense:5", {9, 9, 2}, 8, 7);
  std::unique_ptr<ComputeBackend> backend = NewBackend();
  ASSERT_NE(backend, nullptr);
  ASSERT_TRUE(backend->Prepare(c.model, 8).ok());
  for (int batch : {3, 8, 1, 3}) {
    SCOPED_TRACE(batch);
    ExpectMatches(c, RunBackend(backend.get(), c, batch), RunReference(c, batch));
  }
}

TEST(OneDnnBackendTest, TwoThreadsMatchReference) {
  const Case c = MakeCase(kSeedModelSpec, {28, 28, 1}, 6, 3);
  std::unique_ptr<ComputeBackend> backend = NewBackend(2);
  ASSERT_NE(backend, nullptr);
  ASSERT_TRUE(backend->Prepare(c.model, 6).ok());
  ExpectMatches(c, RunBackend(backend.get(), c, 6), RunReference(c, 6));
}

TEST(OneDnnBackendTest, EvaluateMatchesReferenceLossAndCorrect) {
  const Case c = MakeCase("conv2d:4:3:relu:same,maxpool:2,flatten,dense:5", {8, 8, 1}, 16, 11);
  std::unique_ptr<ComputeBackend> backend = NewBackend();
  ASSERT_NE(backend, nullptr);
  ASSERT_TRUE(backend->Prepare(c.model, 16).ok());
  std::vector<const float*> params;
  for (const auto& p : c.params) params.push_back(p.data());
  StepResult got;
  got.loss_sum = 1.5;  // Evaluate adds to what is there
  got.correct = 2;
  ASSERT_TRUE(backend->Evaluate(params, c.images.data(), c.labels.data(), 16, &got).ok());
  const Outcome want = RunReference(c, 16);
  EXPECT_NEAR(got.loss_sum - 1.5, want.result.loss_sum, 1e-5 * std::abs(want.result.loss_sum));
  EXPECT_EQ(got.correct - 2, want.result.correct);
}

class OneDnnBackendErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = MakeCase("conv2d:2:3,flatten,dense:3", {5, 5, 1}, 4, 1);
    backend_ = NewBackend();
    ASSERT_NE(backend_, nullptr);
    for (auto& p : c_.params) {
      params_.push_back(p.data());
      grad_store_.emplace_back(p.size());
    }
    for (auto& g : grad_store_) grads_.push_back(g.data());
  }
  Case c_;
  std::unique_ptr<ComputeBackend> backend_;
  std::vector<const float*> params_;
  std::vector<std::vector<float>> grad_store_;
  std::vector<float*> grads_;
  StepResult result_;
};

TEST_F(OneDnnBackendErrorTest, StepBeforePrepareIsFailedPrecondition) {
  EXPECT_EQ(
      backend_->TrainStep(params_, c_.images.data(), c_.labels.data(), 2, grads_, &result_).code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST_F(OneDnnBackendErrorTest, BadArgumentsAreInvalidArgument) {
  ASSERT_TRUE(backend_->Prepare(c_.model, 2).ok());
  const float* images = c_.images.data();
  const int32_t* labels = c_.labels.data();
  EXPECT_EQ(backend_->TrainStep(params_, images, labels, 3, grads_, &result_).code(),
            absl::StatusCode::kInvalidArgument);  // batch > max_batch
  EXPECT_EQ(backend_->TrainStep(params_, images, labels, 0, grads_, &result_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->Evaluate(params_, images, labels, 3, &result_).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<const float*> short_params(params_.begin(), params_.end() - 1);
  EXPECT_EQ(backend_->TrainStep(short_params, images, labels, 2, grads_, &result_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->Evaluate(short_params, images, labels, 2, &result_).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float*> short_grads(grads_.begin(), grads_.end() - 1);
  EXPECT_EQ(backend_->TrainStep(params_, images, labels, 2, short_grads, &result_).code(),
            absl::StatusCode::kInvalidArgument);
  const int32_t bad_labels[2] = {0, 3};  // the model has 3 classes
  EXPECT_EQ(backend_->TrainStep(params_, images, bad_labels, 2, grads_, &result_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->Prepare(c_.model, 0).code(), absl::StatusCode::kInvalidArgument);
}

TEST(OneDnnBackendFactoryTest, NonPositiveThreadsIsInvalidArgument) {
  BackendOptions options;
  options.threads = 0;
  EXPECT_EQ(CreateOneDnnBackend(options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace psflow::worker
