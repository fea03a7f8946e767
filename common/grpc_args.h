// Extra gRPC channel arguments given as name=value pairs (ps_server and
// worker --grpc_arg, push_pull_bench --client_grpc_arg). gRPC's few text
// arguments ("grpc.primary_user_agent", "grpc.lb_policy_name", ...) are
// passed as strings; every other value must be an integer, and is passed
// as one.
#ifndef PSFLOW_COMMON_GRPC_ARGS_H_
#define PSFLOW_COMMON_GRPC_ARGS_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace grpc {
class ChannelArguments;
class ServerBuilderOption;
}  // namespace grpc

namespace psflow {

using GrpcArgs = std::vector<std::pair<std::string, std::string>>;

// `defaults`, each replaced by the argument of `overrides` with its name,
// followed by the other `overrides`: psflow's own settings that --grpc_arg
// may change.
GrpcArgs OverrideGrpcArgs(GrpcArgs defaults, const GrpcArgs& overrides);

// HTTP/2 keepalive, for a client or a server: a ping every `time` while
// calls are open, also when they send no data, and the connection closed
// when a ping goes `timeout` unanswered (gRPC also makes `timeout` the
// sockets' TCP_USER_TIMEOUT).
GrpcArgs KeepaliveGrpcArgs(absl::Duration time, absl::Duration timeout);

// OK, or INVALID_ARGUMENT naming --`flag` and the argument, for a value
// gRPC would drop without a word: for any argument but the text ones, a
// value that is not an integer or is beyond 32 bits.
absl::Status CheckGrpcArgs(const char* flag, const GrpcArgs& args);

// Adds `args` to a client channel's arguments.
void AddGrpcArgs(const GrpcArgs& args, grpc::ChannelArguments* out);

// The same for a server: pass to grpc::ServerBuilder::SetOption.
std::unique_ptr<grpc::ServerBuilderOption> GrpcArgsOption(const GrpcArgs& args);

}  // namespace psflow

#endif  // PSFLOW_COMMON_GRPC_ARGS_H_
