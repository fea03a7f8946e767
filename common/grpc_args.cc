#include "common/grpc_args.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/support/channel_arguments.h"

namespace psflow {
namespace {

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
    int as_int = 0;
    if (absl::SimpleAtoi(value, &as_int)) continue;
    int64_t as_long = 0;
    if (absl::SimpleAtoi(value, &as_long)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": ", name, "=", value,
                       " is beyond gRPC's 32-bit integers (it would be dropped as a string)"));
    }
    const bool integer_arg = absl::StartsWith(name, "grpc.keepalive_") ||
                             absl::StartsWith(name, "grpc.http2.") || absl::EndsWith(name, "_ms") ||
                             absl::EndsWith(name, "_bytes") || absl::EndsWith(name, "_size") ||
                             absl::EndsWith(name, "_length") || absl::EndsWith(name, "_count");
    if (integer_arg) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, ": ", name, "=", value,
          " is not an integer, which gRPC reads it as (it would drop the value without a word)"));
    }
  }
  return absl::OkStatus();
}

void AddGrpcArgs(const GrpcArgs& args, grpc::ChannelArguments* out) {
  for (const auto& [name, value] : args) {
    int as_int = 0;
    if (absl::SimpleAtoi(value, &as_int)) {
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
