// Makes --help list the flags defined in a binary's main file (Abseil's
// default only matches files named after the program).
#ifndef PSFLOW_COMMON_FLAGS_USAGE_H_
#define PSFLOW_COMMON_FLAGS_USAGE_H_

namespace psflow {

// `usage` is printed above the flags; `main_file` is a path suffix such as
// "ps_server/main.cc". Call before absl::ParseCommandLine.
void SetUsage(const char* usage, const char* main_file);

}  // namespace psflow

#endif  // PSFLOW_COMMON_FLAGS_USAGE_H_
