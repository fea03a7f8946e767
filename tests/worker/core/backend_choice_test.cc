// The worker's --device choice (CreateBackend): what each name gives on a
// machine without a GPU, as CI's, whether or not the build has CUDA. The
// CUDA test binary covers its own error only where CMake found CUDA; CI's
// machines have no toolkit, so its build's "built without CUDA" message
// is checked here.
#include <memory>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/backend.h"

namespace psflow::worker {
namespace {

using ::testing::HasSubstr;

TEST(BackendChoiceTest, CudaWithoutAGpuSaysWhyAndWhatToUse) {
  if (CudaAvailable()) GTEST_SKIP() << "a CUDA GPU is visible";
  auto backend = CreateBackend("cuda", BackendOptions{});
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition) << backend.status();
#ifdef PSFLOW_TEST_HAVE_CUDA
  EXPECT_THAT(backend.status().message(), HasSubstr("no CUDA GPU is visible"));
#else
  EXPECT_THAT(backend.status().message(), HasSubstr("this worker was built without CUDA"));
#endif
  EXPECT_THAT(backend.status().message(), HasSubstr("--device=cpu"));
}

TEST(BackendChoiceTest, AutoWithoutAGpuIsTheCpu) {
  if (CudaAvailable()) GTEST_SKIP() << "a CUDA GPU is visible";
  auto backend = CreateBackend("auto", BackendOptions{});
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "cpu");
}

TEST(BackendChoiceTest, NamedBackendsAndUnknownNames) {
  for (const char* name : {"cpu", "reference"}) {
    auto backend = CreateBackend(name, BackendOptions{});
    ASSERT_TRUE(backend.ok()) << name << ": " << backend.status();
    EXPECT_EQ((*backend)->name(), name);
  }
  auto unknown = CreateBackend("tpu", BackendOptions{});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(),
              HasSubstr("unknown device \"tpu\"; expected auto, cpu, cuda or reference"));
}

}  // namespace
}  // namespace psflow::worker
