// Conversions between absl::Status and grpc::Status: the only place where
// status crosses the RPC edge. A broken stream or unreachable peer arrives as
// UNAVAILABLE, which callers retry.
#ifndef PSFLOW_COMMON_GRPC_STATUS_H_
#define PSFLOW_COMMON_GRPC_STATUS_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace psflow {

// Sends `status`'s message through FitStatusMessage.
grpc::Status ToGrpcStatus(const absl::Status& status);
// gRPC carries a status message in the grpc-message trailer, which
// percent-encodes every byte outside printable ASCII, and a client refuses
// trailers over 8 KiB by default (GRPC_ARG_MAX_METADATA_SIZE): the call then
// ends RESOURCE_EXHAUSTED and the message is lost (an error naming a 10 KB
// variable did). A message whose encoding passes
// kMaxEncodedStatusMessageBytes keeps its beginning and its end, whole
// UTF-8 characters, and says how many bytes of the middle it left out.
inline constexpr size_t kMaxEncodedStatusMessageBytes = 4096;
std::string FitStatusMessage(absl::string_view message);
// `peer` (e.g. "ps shard 1 (localhost:2223)") prefixes the message so the
// user sees which server answered.
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view peer = {});
// As FromGrpcStatus, for a call that the client did not cancel itself, so
// that a CANCELLED was the server's doing (or a proxy's). A shard stopped
// by SIGTERM ended so, with no message, a push that reached it as it
// stopped: the worker gave up at once with a bare "CANCELLED". That is a
// peer going away, not a refusal: it becomes UNAVAILABLE, which callers
// retry, and says so.
absl::Status FromServerStatus(const grpc::Status& status, absl::string_view peer);

}  // namespace psflow

#endif  // PSFLOW_COMMON_GRPC_STATUS_H_
