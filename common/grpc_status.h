// Conversions between absl::Status and grpc::Status: the only place where
// status crosses the RPC edge. A broken stream or unreachable peer arrives as
// UNAVAILABLE, which callers retry.
#ifndef PSFLOW_COMMON_GRPC_STATUS_H_
#define PSFLOW_COMMON_GRPC_STATUS_H_

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace psflow {

grpc::Status ToGrpcStatus(const absl::Status& status);
// `peer` (e.g. "ps shard 1 at localhost:2223") prefixes the message so the
// user sees which server answered.
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view peer = {});

}  // namespace psflow

#endif  // PSFLOW_COMMON_GRPC_STATUS_H_
