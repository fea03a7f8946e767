// The CUDA backend against the reference backend (plain loops), layer kind
// by layer kind. Every GPU test skips when no GPU is visible; the no-GPU
// error and the Keras window arithmetic are checked everywhere.
#include "worker/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/float_buffer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/backend.h"
#include "worker/cpu/cpu_backend.h"
#include "worker/model/model_def.h"

namespace psflow::worker {
namespace {

using ::testing::HasSubstr;

#define SKIP_WITHOUT_GPU()                                                 \
  do {                                                                     \
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA GPU visible";     \
  } while (0)

// Random inputs for one step: Glorot kernels, non-zero biases (so that a
// missing bias add shows), images in [0, 1), labels in [0, classes).
struct StepData {
  std::vector<std::vector<float>> params;
  std::vector<float> images;
  std::vector<int32_t> labels;

  std::vector<const float*> param_ptrs() const {
    std::vector<const float*> p;
    for (const auto& v : params) p.push_back(v.data());
    return p;
  }
};

StepData MakeStepData(const ModelDef& model, int batch, uint64_t seed) {
  StepData d;
  d.params = InitializeVariables(model, seed);
  std::mt19937_64 gen(seed + 1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f), bias(-0.1f, 0.1f);
  for (const LayerDef& l : model.layers) {
    if (l.bias_var >= 0) {
      for (float& b : d.params[l.bias_var]) b = bias(gen);
    }
  }
  d.images.resize(batch * model.input.size());
  for (float& x : d.images) x = unit(gen);
  std::uniform_int_distribution<int32_t> label(0, model.num_classes - 1);
  for (int b = 0; b < batch; ++b) d.labels.push_back(label(gen));
  return d;
}

struct StepOutput {
  StepResult result;
  std::vector<std::vector<float>> grads;
};

// Runs one TrainStep; gradients start as NaN so that an element the backend
// forgets to write shows up.
absl::StatusOr<StepOutput> Train(ComputeBackend& backend, const ModelDef& model,
                                 const StepData& d, int batch) {
  StepOutput out;
  std::vector<float*> grad_ptrs;
  for (const VariableSpec& v : model.variables) {
    out.grads.emplace_back(v.num_elements(), std::nanf(""));
    grad_ptrs.push_back(out.grads.back().data());
  }
  const std::vector<const float*> params = d.param_ptrs();
  absl::Status s = backend.TrainStep(params, d.images.data(), d.labels.data(), batch, grad_ptrs,
                                     &out.result);
  if (!s.ok()) return s;
  return out;
}

// FP32 without TF32: every element within 1e-4 of the tensor's largest
// magnitude plus 1e-3 relative. A few elements may differ more when a
// pre-activation within rounding of zero takes the other side of a ReLU in
// the two backends; a layout or precision bug breaks most elements, so at
// most 0.5% (and at least 2) outliers are tolerated, and those only within
// 10% of the largest magnitude.
::testing::AssertionResult Close(const std::string& what, const std::vector<float>& got,
                                 const std::vector<float>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << what << ": " << got.size() << " elements, expected "
                                         << want.size();
  }
  float scale = 0;
  for (float w : want) scale = std::max(scale, std::fabs(w));
  if (!(scale > 0)) return ::testing::AssertionFailure() << what << ": reference is all zero";
  size_t outliers = 0, worst = 0;
  double worst_err = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double{got[i]} - want[i]);
    if (!(err <= 1e-4 * scale + 1e-3 * std::fabs(want[i]))) ++outliers;  // NaN counts
    if (!(err <= worst_err)) {
      worst_err = err;
      worst = i;
    }
  }
  const size_t allowed = std::max<size_t>(2, got.size() / 200);
  if (outliers <= allowed && worst_err <= 0.1 * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << outliers << " of " << got.size() << " elements off (allowed "
         << allowed << "); worst at " << worst << ": cuda " << got[worst] << " vs reference "
         << want[worst] << " (error " << worst_err << ", tensor max |ref| " << scale << ")";
}

struct ModelCase {
  std::string name;
  std::string spec;
  Shape3 input;
  int batch;
};

void PrintTo(const ModelCase& c, std::ostream* os) { *os << c.name << " " << c.spec; }

class CudaMatchesReferenceTest : public ::testing::TestWithParam<ModelCase> {};

TEST_P(CudaMatchesReferenceTest, LossCorrectAndEveryGradient) {
  SKIP_WITHOUT_GPU();
  const ModelCase& c = GetParam();
  auto model = ParseModel(c.spec, c.input);
  ASSERT_TRUE(model.ok()) << model.status();
  auto cuda = CreateCudaBackend(BackendOptions{});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  auto ref = CreateReferenceBackend(BackendOptions{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_TRUE((*cuda)->Prepare(*model, c.batch).ok());
  ASSERT_TRUE((*ref)->Prepare(*model, c.batch).ok());

  const StepData data = MakeStepData(*model, c.batch, /*seed=*/7);
  auto got = Train(**cuda, *model, data, c.batch);
  ASSERT_TRUE(got.ok()) << got.status();
  auto want = Train(**ref, *model, data, c.batch);
  ASSERT_TRUE(want.ok()) << want.status();

  EXPECT_NEAR(got->result.loss_sum, want->result.loss_sum,
              1e-5 * std::fabs(want->result.loss_sum) + 1e-5);
  EXPECT_EQ(got->result.correct, want->result.correct);
  for (size_t v = 0; v < model->variables.size(); ++v) {
    EXPECT_TRUE(Close(model->variables[v].name, got->grads[v], want->grads[v]));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, CudaMatchesReferenceTest,
    ::testing::Values(
        ModelCase{"Seed", "seed", {28, 28, 1}, 4},
        // Symmetric same padding (cuDNN pads), valid max pool.
        ModelCase{"ConvSamePool", "conv2d:8:3:relu:same,maxpool:2,flatten,dense:10", {9, 9, 2}, 3},
        // Stride 2 with asymmetric same padding (explicit pad), an even
        // kernel's asymmetric padding with an input gradient, a conv
        // without relu, two dense layers.
        ModelCase{"StrideTwoAsymmetric",
                  "conv2d:6:3:relu:same:s2,conv2d:4:2:relu:same,conv2d:5:3:valid,flatten,"
                  "dense:16:relu,dense:7",
                  {10, 10, 3},
                  4},
        // Max pools with asymmetric and symmetric same padding, both with
        // input gradients, and a symmetric same conv between them.
        ModelCase{"SamePools",
                  "conv2d:4:3:relu,maxpool:2:same,conv2d:6:3:relu:same,maxpool:3:s2:same,"
                  "flatten,dense:10",
                  {11, 11, 2},
                  3},
        ModelCase{"StrideTwoValid", "conv2d:4:3:relu:s2,conv2d:4:3:s2,flatten,dense:3",
                  {13, 13, 2}, 5},
        ModelCase{"DenseOnly", "flatten,dense:32:relu,dense:5", {4, 4, 3}, 6},
        ModelCase{"PoolFirst", "maxpool:2,conv2d:3:3:relu,flatten,dense:4", {8, 8, 1}, 2}),
    [](const ::testing::TestParamInfo<ModelCase>& info) { return info.param.name; });

TEST(CudaBackendTest, SmallerBatchAndRepeatedStepsMatchReference) {
  SKIP_WITHOUT_GPU();
  auto model = ParseModel(kTwoConvModelSpec, {28, 28, 1});
  ASSERT_TRUE(model.ok()) << model.status();
  auto cuda = CreateCudaBackend(BackendOptions{});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  auto ref = CreateReferenceBackend(BackendOptions{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_TRUE((*cuda)->Prepare(*model, 8).ok());
  ASSERT_TRUE((*ref)->Prepare(*model, 8).ok());
  const StepData data = MakeStepData(*model, 5, /*seed=*/11);
  // A batch below max_batch (the last of an epoch), twice: buffers are
  // reused, nothing may accumulate across steps.
  auto first = Train(**cuda, *model, data, 5);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = Train(**cuda, *model, data, 5);
  ASSERT_TRUE(second.ok()) << second.status();
  auto want = Train(**ref, *model, data, 5);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_NEAR(second->result.loss_sum, first->result.loss_sum,
              1e-6 * std::fabs(first->result.loss_sum));
  EXPECT_NEAR(first->result.loss_sum, want->result.loss_sum,
              1e-5 * std::fabs(want->result.loss_sum) + 1e-5);
  EXPECT_EQ(first->result.correct, want->result.correct);
  for (size_t v = 0; v < model->variables.size(); ++v) {
    EXPECT_TRUE(Close(model->variables[v].name + " (step 1)", first->grads[v], want->grads[v]));
    EXPECT_TRUE(Close(model->variables[v].name + " (step 2)", second->grads[v], want->grads[v]));
  }
}

// Pinned caller memory (PinHostMemory, as the trainer does for its big
// tensors) changes only how bytes reach the device: the step's results match
// those through the staging buffers, before and after (to rounding: cuDNN
// may pick a non-deterministic algorithm; a wrong copy would leave NaN or
// another variable's values).
TEST(CudaBackendTest, PinnedHostMemoryGivesTheSameStep) {
  SKIP_WITHOUT_GPU();
  auto model = ParseModel("seed", {28, 28, 1});  // dense/kernel is 11 MB
  ASSERT_TRUE(model.ok()) << model.status();
  auto cuda = CreateCudaBackend(BackendOptions{});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  ASSERT_TRUE((*cuda)->Prepare(*model, 16).ok());
  StepData data = MakeStepData(*model, 16, /*seed=*/5);
  auto staged = Train(**cuda, *model, data, 16);
  ASSERT_TRUE(staged.ok()) << staged.status();
  // A step with other parameters, so that the device no longer holds
  // data's: a direct copy that is skipped or lands elsewhere shows below.
  ASSERT_TRUE(Train(**cuda, *model, MakeStepData(*model, 16, /*seed=*/6), 16).ok());

  // The same parameters in FloatBuffers (big ones own their pages, as in
  // the trainer); its big tensors and gradients pinned in place.
  std::vector<FloatBuffer> params, grads;
  std::vector<const float*> param_ptrs;
  std::vector<float*> grad_ptrs;
  for (size_t v = 0; v < model->variables.size(); ++v) {
    params.emplace_back(static_cast<int64_t>(data.params[v].size()));
    std::copy(data.params[v].begin(), data.params[v].end(), params.back().data());
    grads.emplace_back(static_cast<int64_t>(data.params[v].size()), std::nanf(""));
  }
  std::vector<void*> pinned;
  for (size_t v = 0; v < params.size(); ++v) {
    param_ptrs.push_back(params[v].data());
    grad_ptrs.push_back(grads[v].data());
    const size_t bytes = params[v].size() * sizeof(float);
    if (bytes < FloatBuffer::kOwnPagesBytes) continue;
    for (float* p : {params[v].data(), grads[v].data()}) {
      ASSERT_TRUE((*cuda)->PinHostMemory(p, bytes).ok());
      pinned.push_back(p);
    }
  }
  ASSERT_EQ(pinned.size(), 2u) << "the seed model has one big variable";
  // Pinning the same memory again is refused, and changes nothing.
  absl::Status again = (*cuda)->PinHostMemory(pinned[0], 4096);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_THAT(again.message(), HasSubstr("staging buffers"));
  StepOutput pinned_out;
  ASSERT_TRUE((*cuda)
                  ->TrainStep(param_ptrs, data.images.data(), data.labels.data(), 16, grad_ptrs,
                              &pinned_out.result)
                  .ok());
  for (const FloatBuffer& g : grads) pinned_out.grads.emplace_back(g.data(), g.data() + g.size());
  EXPECT_NEAR(pinned_out.result.loss_sum, staged->result.loss_sum,
              1e-6 * std::fabs(staged->result.loss_sum));
  EXPECT_EQ(pinned_out.result.correct, staged->result.correct);
  for (size_t v = 0; v < model->variables.size(); ++v) {
    EXPECT_TRUE(Close(model->variables[v].name + " (pinned)", pinned_out.grads[v],
                      staged->grads[v]));
  }
  for (void* p : pinned) (*cuda)->UnpinHostMemory(p);
  auto after = Train(**cuda, *model, data, 16);
  ASSERT_TRUE(after.ok()) << after.status();
  for (size_t v = 0; v < model->variables.size(); ++v) {
    EXPECT_TRUE(Close(model->variables[v].name + " (unpinned again)", after->grads[v],
                      staged->grads[v]));
  }
}

TEST(CudaBackendTest, EvaluateMatchesReference) {
  SKIP_WITHOUT_GPU();
  auto model = ParseModel("seed", {28, 28, 1});
  ASSERT_TRUE(model.ok()) << model.status();
  auto cuda = CreateCudaBackend(BackendOptions{});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  auto ref = CreateReferenceBackend(BackendOptions{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_TRUE((*cuda)->Prepare(*model, 16).ok());
  ASSERT_TRUE((*ref)->Prepare(*model, 16).ok());
  const StepData data = MakeStepData(*model, 16, /*seed=*/3);
  StepResult got, want;
  ASSERT_TRUE(
      (*cuda)->Evaluate(data.param_ptrs(), data.images.data(), data.labels.data(), 16, &got).ok());
  ASSERT_TRUE(
      (*ref)->Evaluate(data.param_ptrs(), data.images.data(), data.labels.data(), 16, &want).ok());
  EXPECT_GT(want.loss_sum, 0);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-5 * want.loss_sum);
  EXPECT_EQ(got.correct, want.correct);
}

TEST(CudaBackendTest, MemoryLimitTooSmallIsResourceExhausted) {
  SKIP_WITHOUT_GPU();
  auto model = ParseModel("seed", {28, 28, 1});
  ASSERT_TRUE(model.ok()) << model.status();
  // The seed model's 2.77M parameters alone take 11 MB, twice with grads.
  BackendOptions tight;
  tight.gpu_memory_limit_mb = 8;
  auto cuda = CreateCudaBackend(tight);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  const absl::Status s = (*cuda)->Prepare(*model, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("8.0 MB"));
  EXPECT_THAT(s.message(), HasSubstr("needs"));
  // Nothing was prepared: a step is refused, not run on missing buffers.
  const StepData data = MakeStepData(*model, 1, 1);
  StepResult r;
  EXPECT_EQ((*cuda)->Evaluate(data.param_ptrs(), data.images.data(), data.labels.data(), 1, &r)
                .code(),
            absl::StatusCode::kFailedPrecondition);

  BackendOptions roomy;
  roomy.gpu_memory_limit_mb = 1024;
  auto ok = CreateCudaBackend(roomy);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE((*ok)->Prepare(*model, 64).ok());
}

TEST(CudaBackendTest, BadArgumentsAreInvalidArgument) {
  SKIP_WITHOUT_GPU();
  BackendOptions bad_device;
  bad_device.device_index = CudaDeviceCount();
  EXPECT_EQ(CreateCudaBackend(bad_device).status().code(), absl::StatusCode::kInvalidArgument);

  auto model = ParseModel("flatten,dense:3", {2, 2, 1});
  ASSERT_TRUE(model.ok()) << model.status();
  auto cuda = CreateCudaBackend(BackendOptions{});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  ASSERT_TRUE((*cuda)->Prepare(*model, 2).ok());
  StepData data = MakeStepData(*model, 2, 5);
  data.labels[1] = 3;  // classes are 0..2
  auto out = Train(**cuda, *model, data, 2);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("label"));
  data.labels[1] = 0;
  EXPECT_EQ(Train(**cuda, *model, data, 3).status().code(), absl::StatusCode::kInvalidArgument);
  // A null parameter or gradient buffer is refused, as by the CPU backends
  // (it used to be dereferenced), and the backend still steps afterwards.
  std::vector<const float*> params = data.param_ptrs();
  std::vector<std::vector<float>> grads;
  std::vector<float*> grad_ptrs;
  for (const VariableSpec& v : model->variables) {
    grads.emplace_back(v.num_elements());
    grad_ptrs.push_back(grads.back().data());
  }
  StepResult r;
  params[0] = nullptr;
  absl::Status s =
      (*cuda)->TrainStep(params, data.images.data(), data.labels.data(), 2, grad_ptrs, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("parameter buffer of " + model->variables[0].name));
  EXPECT_EQ((*cuda)->Evaluate(params, data.images.data(), data.labels.data(), 2, &r).code(),
            absl::StatusCode::kInvalidArgument);
  params = data.param_ptrs();
  grad_ptrs.back() = nullptr;
  s = (*cuda)->TrainStep(params, data.images.data(), data.labels.data(), 2, grad_ptrs, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("gradient buffer of " + model->variables.back().name));
  EXPECT_TRUE(Train(**cuda, *model, data, 2).ok());
}

// Runs only where there is no GPU (CI, the development machines).
TEST(CudaBackendTest, WithoutGpuCreateIsFailedPrecondition) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA GPU is visible";
  auto backend = CreateCudaBackend(BackendOptions{});
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(backend.status().message(), HasSubstr("no CUDA GPU is visible"));
  EXPECT_THAT(backend.status().message(), HasSubstr("cudaGetDeviceCount"));
  EXPECT_THAT(backend.status().message(), HasSubstr("--device=cpu"));
}

}  // namespace
}  // namespace psflow::worker
