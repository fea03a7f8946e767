#include "common/grpc_args.h"

#include <algorithm>
#include <cstdint>
#include <iterator>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "grpc/grpc.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/support/channel_arguments.h"

namespace psflow {
namespace {

// gRPC 1.51's arguments that take text (grpc_types.h); the others take
// integers, or pointers that no flag can give.
constexpr absl::string_view kStringArgs[] = {
    GRPC_ARG_DEFAULT_AUTHORITY,
    GRPC_ARG_PRIMARY_USER_AGENT_STRING,
    GRPC_ARG_SECONDARY_USER_AGENT_STRING,
    GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
    GRPC_ARG_SERVICE_CONFIG,
    GRPC_ARG_LB_POLICY_NAME,
    GRPC_ARG_OPTIMIZATION_TARGET,
    GRPC_ARG_HTTP_PROXY,
    GRPC_ARG_CHANNEL_POOL_DOMAIN,
};

bool IsStringArg(absl::string_view name) {
  return std::find(std::begin(kStringArgs), std::end(kStringArgs), name) != std::end(kStringArgs);
}

class ArgsOption : public grpc::ServerBuilderOption {
 public:
  explicit ArgsOption(GrpcArgs args) : args_(std::move(args)) {}
  void UpdateArguments(grpc::ChannelArguments* args) override { AddGrpcArgs(args_, args); }
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>*) override {}

 private:
  const GrpcArgs args_;
};

}  // namespace

GrpcArgs OverrideGrpcArgs(GrpcArgs defaults, const GrpcArgs& overrides) {
  for (const auto& [name, value] : overrides) {
    auto same = std::find_if(defaults.begin(), defaults.end(),
                             [&](const auto& arg) { return arg.first == name; });
    if (same != defaults.end()) {
      same->second = value;
    } else {
      defaults.emplace_back(name, value);
    }
  }
  return defaults;
}

GrpcArgs KeepaliveGrpcArgs(absl::Duration time, absl::Duration timeout) {
  return {{GRPC_ARG_KEEPALIVE_TIME_MS, absl::StrCat(absl::ToInt64Milliseconds(time))},
          {GRPC_ARG_KEEPALIVE_TIMEOUT_MS, absl::StrCat(absl::ToInt64Milliseconds(timeout))},
          {GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, "0"}};
}

absl::Status CheckGrpcArgs(const char* flag, const GrpcArgs& args) {
  for (const auto& [name, value] : args) {
    if (IsStringArg(name)) continue;  // any text, digits included
    int as_int = 0;
    if (absl::SimpleAtoi(value, &as_int)) {
      // psflow sets the message size limits: a shard's from its
      // --max_chunk_bytes (where the value given was silently overridden),
      // a worker's to none, which pulls of any model need.
      if (name == "grpc.max_receive_message_length" || name == "grpc.max_send_message_length") {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", flag, ": ", name, "=", value,
            " is not taken: psflow sets the message size limits (a shard's from its "
            "--max_chunk_bytes, a worker's to none); size the messages with --max_chunk_bytes"));
      }
      continue;
    }
    int64_t as_long = 0;
    if (absl::SimpleAtoi(value, &as_long)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": ", name, "=", value,
                       " is beyond gRPC's 32-bit integers (it would be dropped as a string)"));
    }
    // gRPC reads every other argument as an integer and drops a string
    // given for one without a word: "grpc.so_reuseport=false" left its
    // default of 1 in force, and a second shard could take the port.
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, ": ", name, "=", value,
        " is not an integer, which gRPC reads it as (it would drop the value without a word; "
        "1 and 0 for true and false). The arguments that take text are ",
        absl::StrJoin(kStringArgs, ", ")));
  }
  return absl::OkStatus();
}

void AddGrpcArgs(const GrpcArgs& args, grpc::ChannelArguments* out) {
  for (const auto& [name, value] : args) {
    int as_int = 0;
    // A text argument stays text even when it is all digits: gRPC drops an
    // integer given for it ("grpc.primary_user_agent=12345").
    if (!IsStringArg(name) && absl::SimpleAtoi(value, &as_int)) {
      out->SetInt(name, as_int);
    } else {
      out->SetString(name, value);
    }
  }
}

std::unique_ptr<grpc::ServerBuilderOption> GrpcArgsOption(const GrpcArgs& args) {
  return std::make_unique<ArgsOption>(args);
}

}  // namespace psflow
