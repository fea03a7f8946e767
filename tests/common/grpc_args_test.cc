#include "common/grpc_args.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

// psflow's own settings keep their place, take the value given for their
// name, and the other given arguments follow in their order.
TEST(OverrideGrpcArgsTest, GivenValuesReplaceDefaultsOfTheSameName) {
  const GrpcArgs merged = OverrideGrpcArgs(
      {{"grpc.keepalive_time_ms", "30000"}, {"grpc.keepalive_timeout_ms", "20000"}},
      {{"grpc.x", "1"}, {"grpc.keepalive_timeout_ms", "5"}, {"grpc.y", "s"}});
  EXPECT_THAT(merged, ElementsAre(Pair("grpc.keepalive_time_ms", "30000"),
                                  Pair("grpc.keepalive_timeout_ms", "5"), Pair("grpc.x", "1"),
                                  Pair("grpc.y", "s")));
  EXPECT_THAT(OverrideGrpcArgs({{"a", "1"}}, {}), ElementsAre(Pair("a", "1")));
}

// Milliseconds, as gRPC reads them, and pings allowed while calls send no
// data.
TEST(KeepaliveGrpcArgsTest, GivesTheDurationsInMilliseconds) {
  EXPECT_THAT(KeepaliveGrpcArgs(absl::Seconds(30), absl::Milliseconds(2500)),
              ElementsAre(Pair("grpc.keepalive_time_ms", "30000"),
                          Pair("grpc.keepalive_timeout_ms", "2500"),
                          Pair("grpc.http2.max_pings_without_data", "0")));
}

}  // namespace
}  // namespace psflow
