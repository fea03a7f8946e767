#include "common/flags_usage.h"

#include <string>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace psflow {

void SetUsage(const char* usage, const char* main_file) {
  absl::SetProgramUsageMessage(usage);
  static std::string* file = new std::string(main_file);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view path) { return absl::EndsWith(path, *file); };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace psflow
