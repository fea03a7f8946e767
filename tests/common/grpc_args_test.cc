#include "common/grpc_args.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "grpcpp/support/channel_arguments.h"
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
// Values gRPC would drop without a word are refused, naming the flag.
TEST(CheckGrpcArgsTest, RefusesValuesGrpcWouldDrop) {
  EXPECT_TRUE(CheckGrpcArgs("grpc_arg", {{"grpc.keepalive_time_ms", "1000"},
                                         {"grpc.primary_user_agent", "psflow-test"},
                                         {"grpc.http2.max_frame_size", "-1"}})
                  .ok());
  const absl::Status big = CheckGrpcArgs("grpc_arg", {{"grpc.keepalive_time_ms", "99999999999"}});
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(big.message(), ::testing::HasSubstr("--grpc_arg: grpc.keepalive_time_ms=99999999999 "
                                                  "is beyond gRPC's 32-bit integers"));
  for (const char* name : {"grpc.keepalive_time_ms", "grpc.http2.lookahead_bytes",
                           "grpc.max_receive_message_length", "grpc.server_handshake_timeout_ms",
                           "grpc.max_concurrent_streams", "grpc.expand_wildcard_addrs"}) {
    const absl::Status text = CheckGrpcArgs("grpc_arg", {{name, "abc"}});
    EXPECT_EQ(text.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(text.message(), ::testing::HasSubstr("=abc is not an integer")) << name;
  }
  // A true/false argument takes 1 or 0: "false" was dropped, and gRPC's
  // default (1) let a second shard listen on the same port.
  const absl::Status word = CheckGrpcArgs("grpc_arg", {{"grpc.so_reuseport", "false"}});
  EXPECT_EQ(word.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(word.message(), ::testing::HasSubstr("grpc.so_reuseport=false is not an integer"));
  EXPECT_THAT(word.message(), ::testing::HasSubstr("1 and 0 for true and false"));
  EXPECT_THAT(word.message(), ::testing::HasSubstr("grpc.optimization_target"));
  // The message size limits are psflow's own: a value was taken silently
  // and then overridden.
  for (const char* name : {"grpc.max_receive_message_length", "grpc.max_send_message_length"}) {
    const absl::Status managed = CheckGrpcArgs("grpc_arg", {{name, "10"}});
    EXPECT_EQ(managed.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(managed.message(), ::testing::HasSubstr(absl::StrCat(name, "=10 is not taken")));
    EXPECT_THAT(managed.message(), ::testing::HasSubstr("--max_chunk_bytes"));
  }
  EXPECT_TRUE(CheckGrpcArgs("grpc_arg", {{"grpc.so_reuseport", "0"},
                                         {"grpc.optimization_target", "throughput"},
                                         {"grpc.lb_policy_name", "round_robin"}})
                  .ok());
}

// gRPC drops an integer given for a text argument without a word
// ("grpc.primary_user_agent=12345"): all-digit text stays a string.
TEST(AddGrpcArgsTest, TextArgumentsStayTextEvenWhenAllDigits) {
  const GrpcArgs args = {{"grpc.default_authority", "12345"},
                         {"grpc.keepalive_time_ms", "1000"},
                         {"grpc.lb_policy_name", "99999999999"}};
  EXPECT_TRUE(CheckGrpcArgs("grpc_arg", args).ok());
  grpc::ChannelArguments channel_args;
  AddGrpcArgs(args, &channel_args);
  const grpc_channel_args c = channel_args.c_channel_args();
  int found = 0;
  for (size_t i = 0; i < c.num_args; ++i) {
    const std::string key = c.args[i].key;
    if (key == "grpc.default_authority") {
      ++found;
      ASSERT_EQ(c.args[i].type, GRPC_ARG_STRING) << key;
      EXPECT_STREQ(c.args[i].value.string, "12345");
    } else if (key == "grpc.lb_policy_name") {
      ++found;
      ASSERT_EQ(c.args[i].type, GRPC_ARG_STRING) << key;
      EXPECT_STREQ(c.args[i].value.string, "99999999999");
    } else if (key == "grpc.keepalive_time_ms") {
      ++found;
      ASSERT_EQ(c.args[i].type, GRPC_ARG_INTEGER) << key;
      EXPECT_EQ(c.args[i].value.integer, 1000);
    }
  }
  EXPECT_EQ(found, 3);
}

TEST(KeepaliveGrpcArgsTest, GivesTheDurationsInMilliseconds) {
  EXPECT_THAT(KeepaliveGrpcArgs(absl::Seconds(30), absl::Milliseconds(2500)),
              ElementsAre(Pair("grpc.keepalive_time_ms", "30000"),
                          Pair("grpc.keepalive_timeout_ms", "2500"),
                          Pair("grpc.http2.max_pings_without_data", "0")));
}

}  // namespace
}  // namespace psflow
