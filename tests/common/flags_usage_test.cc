// ParseNameValues: the name=value lists of --grpc_arg (ps_server, worker)
// and --client_grpc_arg (push_pull_bench).
#include "common/flags_usage.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using Pairs = std::vector<std::pair<std::string, std::string>>;

TEST(ParseNameValuesTest, SplitsAtTheFirstEquals) {
  auto got = ParseNameValues("grpc_arg", {"grpc.a=1", "b=x=y", "c="});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (Pairs{{"grpc.a", "1"}, {"b", "x=y"}, {"c", ""}}));
  auto none = ParseNameValues("grpc_arg", {});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(ParseNameValuesTest, AnItemWithoutNameOrEqualsIsRefused) {
  for (const char* bad : {"novalue", "=5"}) {
    auto got = ParseNameValues("grpc_arg", {"ok=1", bad});
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(got.status().message(), ::testing::HasSubstr("--grpc_arg"));
    EXPECT_THAT(got.status().message(), ::testing::HasSubstr(bad));
  }
}

}  // namespace
}  // namespace psflow
