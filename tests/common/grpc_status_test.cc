#include "common/grpc_status.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// The message's size in the grpc-message trailer: printable ASCII but '%'
// as it is, every other byte as %XX.
size_t Encoded(absl::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += c >= 0x20 && c <= 0x7e && c != '%' ? 1 : 3;
  return n;
}

// Whether `s` is well-formed UTF-8 (no sequence cut short or begun in the middle).
bool WholeUtf8(absl::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t len = c < 0x80           ? 1
                       : (c >> 5) == 0x6  ? 2
                       : (c >> 4) == 0xe  ? 3
                       : (c >> 3) == 0x1e ? 4
                                          : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

// The number in " [... N bytes left out ...] ", or -1.
int64_t LeftOut(absl::string_view fitted) {
  const size_t at = fitted.find(" [... ");
  const size_t end = fitted.find(" bytes left out ...] ");
  int64_t n = -1;
  if (at == absl::string_view::npos || end == absl::string_view::npos || end < at) return -1;
  return absl::SimpleAtoi(fitted.substr(at + 6, end - at - 6), &n) ? n : -1;
}

TEST(FitStatusMessageTest, KeepsAMessageThatFits) {
  EXPECT_EQ(FitStatusMessage(""), "");
  const std::string fits(kMaxEncodedStatusMessageBytes, 'a');
  EXPECT_EQ(FitStatusMessage(fits), fits);
  // 1365 bytes of '%' take 4095 encoded.
  const std::string percent(kMaxEncodedStatusMessageBytes / 3, '%');
  EXPECT_EQ(FitStatusMessage(percent), percent);
}

TEST(FitStatusMessageTest, KeepsBothEndsOfALongMessage) {
  const std::string message = "variable 'ghost/" + std::string(20000, 'g') +
                              "' is not on this shard; expected one of 3 parts";
  const std::string fitted = FitStatusMessage(message);
  EXPECT_LE(Encoded(fitted), kMaxEncodedStatusMessageBytes);
  EXPECT_GE(Encoded(fitted), kMaxEncodedStatusMessageBytes - 80);  // not cut much shorter
  EXPECT_THAT(fitted, StartsWith("variable 'ghost/ggg"));
  EXPECT_THAT(fitted, EndsWith("ggg' is not on this shard; expected one of 3 parts"));
  const int64_t left_out = LeftOut(fitted);
  const size_t note =
      std::string(" [...  bytes left out ...] ").size() + std::to_string(left_out).size();
  EXPECT_EQ(fitted.size() - note + left_out, message.size());
  // One byte over is cut too.
  const std::string over(kMaxEncodedStatusMessageBytes + 1, 'a');
  EXPECT_LT(FitStatusMessage(over).size(), over.size());
  EXPECT_GT(LeftOut(FitStatusMessage(over)), 0);
}

TEST(FitStatusMessageTest, CutsOnlyBetweenWholeUtf8Characters) {
  // Two-, three- and four-byte characters, each cut at every offset that
  // the budget may land on.
  for (const std::string ch : {"\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80"}) {
    for (int prefix = 0; prefix < 4; ++prefix) {
      std::string message(prefix, 'p');
      for (int i = 0; i < 3000; ++i) message += ch;
      message += std::string(prefix, 's');
      const std::string fitted = FitStatusMessage(message);
      EXPECT_LE(Encoded(fitted), kMaxEncodedStatusMessageBytes) << ch.size() << " " << prefix;
      EXPECT_TRUE(WholeUtf8(fitted)) << ch.size() << " " << prefix;
      EXPECT_THAT(fitted, HasSubstr("bytes left out"));
    }
  }
}

// Bytes that are not UTF-8 (names reach messages as the client sent them)
// are cut where the budget falls: nothing more is lost looking for a
// character's start.
TEST(FitStatusMessageTest, BytesThatAreNotUtf8LoseNoMoreThanTheBudget) {
  const std::string message = "variable '" + std::string(10000, '\x80') + "' is not on shard 0";
  const std::string fitted = FitStatusMessage(message);
  EXPECT_LE(Encoded(fitted), kMaxEncodedStatusMessageBytes);
  EXPECT_GE(Encoded(fitted), kMaxEncodedStatusMessageBytes - 80);
  EXPECT_THAT(fitted, StartsWith("variable '\x80\x80"));
  EXPECT_THAT(fitted, EndsWith("\x80\x80' is not on shard 0"));
  // A lone lead byte at the cut, with no continuation after it.
  const std::string lone = std::string(3000, 'a') + "\xc3" + std::string(3000, 'b');
  EXPECT_LE(Encoded(FitStatusMessage(lone)), kMaxEncodedStatusMessageBytes);
}

// A CANCELLED that the client did not ask for is the server going away:
// retried as UNAVAILABLE, and said so. Every other code is kept.
TEST(FromServerStatusTest, CancelledByTheServerIsRetriedAsUnavailable) {
  // gRPC's own words are only the code's name.
  for (const char* bare_message : {"", "CANCELLED", "Cancelled"}) {
    const absl::Status bare = FromServerStatus(
        grpc::Status(grpc::StatusCode::CANCELLED, bare_message), "ps shard 1 (h:1)");
    EXPECT_EQ(bare.code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(bare.message(),
              "ps shard 1 (h:1): the server ended the call (CANCELLED), as a server that is "
              "stopping does");
  }
  const absl::Status said =
      FromServerStatus(grpc::Status(grpc::StatusCode::CANCELLED, "Pull: cancelled"), "");
  EXPECT_EQ(said.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(said.message(),
            "the server ended the call (CANCELLED: Pull: cancelled), as a server that is "
            "stopping does");
  EXPECT_TRUE(FromServerStatus(grpc::Status::OK, "p").ok());
  EXPECT_EQ(FromServerStatus(grpc::Status(grpc::StatusCode::NOT_FOUND, "why"), "p"),
            absl::NotFoundError("p: why"));
  EXPECT_EQ(FromServerStatus(grpc::Status(grpc::StatusCode::ABORTED, "why"), ""),
            absl::AbortedError("why"));
  EXPECT_EQ(FromServerStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "gone"), "p"),
            absl::UnavailableError("p: gone"));
}

TEST(ToGrpcStatusTest, KeepsTheCodeAndFitsTheMessage) {
  const grpc::Status ok = ToGrpcStatus(absl::OkStatus());
  EXPECT_TRUE(ok.ok());
  const grpc::Status short_one = ToGrpcStatus(absl::NotFoundError("variable 'w'"));
  EXPECT_EQ(short_one.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(short_one.error_message(), "variable 'w'");
  const grpc::Status long_one = ToGrpcStatus(absl::InvalidArgumentError(std::string(9000, 'x')));
  EXPECT_EQ(long_one.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LE(Encoded(long_one.error_message()), kMaxEncodedStatusMessageBytes);
}

}  // namespace
}  // namespace psflow
