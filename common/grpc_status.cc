#include "common/grpc_status.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace psflow {
namespace {

// The bytes `c` takes in the grpc-message trailer, which percent-encodes
// every byte outside printable ASCII, and '%'.
size_t EncodedBytes(char c) {
  const auto b = static_cast<unsigned char>(c);
  return b >= 0x20 && b <= 0x7e && b != '%' ? 1 : 3;
}

bool IsUtf8Continuation(char c) { return (static_cast<unsigned char>(c) & 0xc0) == 0x80; }

// The UTF-8 character that `at` falls inside of, [begin, end), with
// begin < at; {at, at} where `at` is a character's first byte or lies in
// bytes that are not UTF-8 (where no cut is better than another).
std::pair<size_t, size_t> CharacterAround(absl::string_view s, size_t at) {
  if (at >= s.size() || !IsUtf8Continuation(s[at])) return {at, at};
  size_t lead = at;
  while (lead > 0 && at - lead < 3 && IsUtf8Continuation(s[lead])) --lead;
  const auto b = static_cast<unsigned char>(s[lead]);
  const size_t length = b >= 0xf0 && b <= 0xf4   ? 4
                        : b >= 0xe0 && b <= 0xef ? 3
                        : b >= 0xc2 && b <= 0xdf ? 2
                                                 : 0;
  if (length == 0 || lead + length <= at || lead + length > s.size()) return {at, at};
  return {lead, lead + length};
}

}  // namespace

std::string FitStatusMessage(absl::string_view message) {
  size_t total = 0;
  for (char c : message) total += EncodedBytes(c);
  if (total <= kMaxEncodedStatusMessageBytes) return std::string(message);
  // Half of what is left after the note in the middle, for each end.
  const size_t half = (kMaxEncodedStatusMessageBytes - 64) / 2;
  size_t head = 0, used = 0;
  while (used + EncodedBytes(message[head]) <= half) used += EncodedBytes(message[head++]);
  head = CharacterAround(message, head).first;  // whole characters only
  size_t tail = message.size();
  used = 0;
  while (used + EncodedBytes(message[tail - 1]) <= half) used += EncodedBytes(message[--tail]);
  tail = CharacterAround(message, tail).second;  // starts after a character it would cut
  return absl::StrCat(message.substr(0, head), " [... ", tail - head, " bytes left out ...] ",
                      message.substr(tail));
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      FitStatusMessage(status.message()));
}

absl::Status FromServerStatus(const grpc::Status& status, absl::string_view peer) {
  if (status.error_code() != grpc::StatusCode::CANCELLED) return FromGrpcStatus(status, peer);
  // gRPC's own cancellation says only "CANCELLED".
  const std::string& said = status.error_message();
  const bool bare = said.empty() || said == "CANCELLED" || said == "Cancelled";
  return absl::UnavailableError(
      absl::StrCat(peer, peer.empty() ? "" : ": ", "the server ended the call (CANCELLED",
                   bare ? "" : ": ", bare ? "" : said, "), as a server that is stopping does"));
}

absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view peer) {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  if (peer.empty()) return absl::Status(code, status.error_message());
  return absl::Status(code, absl::StrCat(peer, ": ", status.error_message()));
}

}  // namespace psflow
