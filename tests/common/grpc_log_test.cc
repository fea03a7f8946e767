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

// Where gRPC 1.51's HTTP/2 server logs a failed bind.
constexpr char kChttp2Server[] = "src/core/ext/transport/chttp2/server/chttp2_server.cc";

void LogAsChttp2Server(const char* message) {
  gpr_log_message(kChttp2Server, 1045, GPR_LOG_SEVERITY_ERROR, message);
}

// gRPC reads its log verbosity (GRPC_VERBOSITY, ERROR by default) in
// grpc_init; before it, gpr_log writes nothing.
class GrpcLogHoldTest : public ::testing::Test {
 protected:
  void SetUp() override { grpc_init(); }
  void TearDown() override { grpc_shutdown(); }
};

TEST_F(GrpcLogHoldTest, HeldLinesAreWrittenWhenTheHoldEndsInOrder) {
  testing::internal::CaptureStderr();
  std::string during;
  {
    GrpcLogHold hold;
    LogAsChttp2Server("first held line");
    LogAsChttp2Server("second held line");
    EXPECT_EQ(hold.HeldLines(), 2);
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
  // In gRPC's format, with the file and line that logged it.
  EXPECT_THAT(after, HasSubstr("chttp2_server.cc:1045]"));
  EXPECT_EQ(after[0], 'E') << after;
}

// Only the bind failure the caller explains goes: other lines of the holding
// thread, and every line of other threads, are written at once, so that a
// gRPC assertion that aborts the process is still seen.
TEST_F(GrpcLogHoldTest, DroppedLinesGoAndEveryOtherLineIsWrittenAtOnce) {
  testing::internal::CaptureStderr();
  std::string during;
  {
    GrpcLogHold hold;
    LogAsChttp2Server("explained by the caller");
    gpr_log(GPR_ERROR, "another file, this thread");
    std::thread([] {
      gpr_log(GPR_ERROR, "from another thread");
      LogAsChttp2Server("the server of another thread");
    }).join();
    EXPECT_EQ(hold.HeldLines(), 1);
    during = testing::internal::GetCapturedStderr();
    testing::internal::CaptureStderr();
    hold.DropHeldLines();
    LogAsChttp2Server("also explained");
  }
  const std::string after = testing::internal::GetCapturedStderr();
  EXPECT_THAT(during, HasSubstr("another file, this thread"));
  EXPECT_THAT(during, HasSubstr("grpc_log_test.cc:"));
  EXPECT_THAT(during, HasSubstr("from another thread"));
  EXPECT_THAT(during, HasSubstr("the server of another thread"));
  EXPECT_THAT(during + after, Not(HasSubstr("explained")));
}

TEST_F(GrpcLogHoldTest, AfterTheHoldGrpcLogsAsBefore) {
  { GrpcLogHold hold; }
  testing::internal::CaptureStderr();
  LogAsChttp2Server("logged at once");
  EXPECT_THAT(testing::internal::GetCapturedStderr(), HasSubstr("logged at once"));
  // Holds follow one another.
  testing::internal::CaptureStderr();
  {
    GrpcLogHold hold;
    LogAsChttp2Server("a second hold");
    hold.DropHeldLines();
  }
  EXPECT_THAT(testing::internal::GetCapturedStderr(), Not(HasSubstr("a second hold")));
}

}  // namespace
}  // namespace psflow
