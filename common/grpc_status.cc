#include "common/grpc_status.h"

#include <string>

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

}  // namespace

std::string FitStatusMessage(absl::string_view message) {
  size_t total = 0;
  for (char c : message) total += EncodedBytes(c);
  if (total <= kMaxEncodedStatusMessageBytes) return std::string(message);
  // Half of what is left after the note in the middle, for each end.
  const size_t half = (kMaxEncodedStatusMessageBytes - 64) / 2;
  size_t head = 0, used = 0;
  while (used + EncodedBytes(message[head]) <= half) used += EncodedBytes(message[head++]);
  while (head > 0 && IsUtf8Continuation(message[head])) --head;  // whole characters only
  size_t tail = message.size();
  used = 0;
  while (used + EncodedBytes(message[tail - 1]) <= half) used += EncodedBytes(message[--tail]);
  while (tail < message.size() && IsUtf8Continuation(message[tail])) ++tail;
  return absl::StrCat(message.substr(0, head), " [... ", tail - head, " bytes left out ...] ",
                      message.substr(tail));
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      FitStatusMessage(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view peer) {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  if (peer.empty()) return absl::Status(code, status.error_message());
  return absl::Status(code, absl::StrCat(peer, ": ", status.error_message()));
}

}  // namespace psflow
