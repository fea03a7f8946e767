#include "common/grpc_log.h"

#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "grpc/support/log.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// gRPC reads its log verbosity (GRPC_VERBOSITY, ERROR by default) in
// grpc_init; before it, gpr_log writes nothing.
class GrpcLogHoldTest : public ::testing::Test {
 protected:
  void SetUp() override { grpc_init(); }
  void TearDown() override { grpc_shutdown(); }
};

TEST_F(GrpcLogHoldTest, HeldLinesAreLoggedWhenTheHoldEndsInOrder) {
  testing::internal::CaptureStderr();
  std::string during;
  {
    GrpcLogHold hold;
    gpr_log(GPR_ERROR, "first held line");
    gpr_log(GPR_ERROR, "second held line");
    EXPECT_EQ(hold.OwnLines(), 2);
    during = testing::internal::GetCapturedStderr();
    testing::internal::CaptureStderr();
  }
  const std::string after = testing::internal::GetCapturedStderr();
  EXPECT_THAT(during, Not(HasSubstr("held line")));
  const size_t first = after.find("first held line");
  const size_t second = after.find("second held line");
  ASSERT_NE(first, std::string::npos) << after;
  ASSERT_NE(second, std::string::npos) << after;
  EXPECT_LT(first, second);
  // Each keeps the file that logged it.
  EXPECT_THAT(after, HasSubstr("grpc_log_test.cc:"));
}

TEST_F(GrpcLogHoldTest, DroppedOwnLinesGoButOtherThreadsLinesStay) {
  testing::internal::CaptureStderr();
  {
    GrpcLogHold hold;
    gpr_log(GPR_ERROR, "explained by the caller");
    std::thread([] { gpr_log(GPR_ERROR, "from another thread"); }).join();
    EXPECT_EQ(hold.OwnLines(), 1);
    hold.DropOwnLines();
    gpr_log(GPR_ERROR, "also explained");
  }
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, Not(HasSubstr("explained")));
  EXPECT_THAT(out, HasSubstr("from another thread"));
}

TEST_F(GrpcLogHoldTest, AfterTheHoldGrpcLogsAsBefore) {
  { GrpcLogHold hold; }
  testing::internal::CaptureStderr();
  gpr_log(GPR_ERROR, "logged at once");
  EXPECT_THAT(testing::internal::GetCapturedStderr(), HasSubstr("logged at once"));
  // Holds follow one another.
  testing::internal::CaptureStderr();
  {
    GrpcLogHold hold;
    gpr_log(GPR_ERROR, "a second hold");
    hold.DropOwnLines();
  }
  EXPECT_THAT(testing::internal::GetCapturedStderr(), Not(HasSubstr("a second hold")));
}

}  // namespace
}  // namespace psflow
