#include "common/protobuf_log.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "psflow.pb.h"

namespace psflow {
namespace {

TEST(LogRateLimiterTest, AdmitsSoManyAWindowAndCountsTheRest) {
  LogRateLimiter limiter(3, absl::Minutes(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  int64_t dropped = -1;
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(limiter.Admit(t0 + absl::Seconds(i), &dropped));
    EXPECT_EQ(dropped, 0);
  }
  EXPECT_FALSE(limiter.Admit(t0 + absl::Seconds(10), &dropped));
  EXPECT_FALSE(limiter.Admit(t0 + absl::Seconds(59), &dropped));
  // A new window: the next line says how many were dropped.
  EXPECT_TRUE(limiter.Admit(t0 + absl::Seconds(60), &dropped));
  EXPECT_EQ(dropped, 2);
  EXPECT_TRUE(limiter.Admit(t0 + absl::Seconds(61), &dropped));
  EXPECT_EQ(dropped, 0);
}

// What a shard sees: requests whose names are not UTF-8. protobuf logs an
// ERROR line for each; the limit keeps the first few.
TEST(ProtobufLogTest, InvalidUtf8RequestsLogAFewLinesNotOneEach) {
  LimitProtobufLog(4);
  // PullRequest.variables (field 2) = the bytes C3 28, not UTF-8.
  const std::string bytes("\x12\x02\xc3\x28", 4);
  testing::internal::CaptureStderr();
  int refused = 0;
  for (int i = 0; i < 100; ++i) {
    PullRequest request;
    if (!request.ParseFromString(bytes)) ++refused;
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(refused, 100);  // the parse still fails: only the log is limited
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    EXPECT_THAT(std::string(line), ::testing::StartsWith("[libprotobuf ERROR "));
    EXPECT_TRUE(absl::StrContains(line, "UTF-8")) << line;
    ++lines;
  }
  EXPECT_EQ(lines, 4);
}

}  // namespace
}  // namespace psflow
