#include "common/flags_usage.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/edit_distance.h"

namespace psflow {

void SetUsage(const char* usage, const char* main_file) {
  absl::SetProgramUsageMessage(usage);
  static std::string* file = new std::string(main_file);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view path) { return absl::EndsWith(path, *file); };
  config.contains_helpshort_flags = config.contains_help_flags;
  // Abseil's own says only whether *it* was built with NDEBUG.
  config.version_string = [] {
    const absl::string_view build_type = PSFLOW_BUILD_TYPE;
    return absl::StrCat(absl::flags_internal::ShortProgramInvocationName(), " (psflow ",
                        PSFLOW_VERSION, build_type.empty() ? "" : ", ", build_type,
                        build_type.empty() ? "" : " build", ")\nbuilt with gRPC ",
                        PSFLOW_GRPC_VERSION, ", Protocol Buffers ", PSFLOW_PROTOBUF_VERSION,
                        ", Abseil ", PSFLOW_ABSL_VERSION, "\n");
  };
  absl::SetFlagsUsageConfig(config);
}

namespace {

bool IsBool(const absl::CommandLineFlag* flag) { return flag->IsOfType<bool>(); }

// Flags that absl::ParseCommandLine handles itself (defined where it is
// linked in).
bool IsAbseilFlag(absl::string_view name) {
  for (const char* f :
       {"help", "helpfull", "helpshort", "helppackage", "helpon", "helpmatch", "version",
        "only_check_args", "flagfile", "fromenv", "tryfromenv", "undefok"}) {
    if (name == f) return true;
  }
  return false;
}

// One "--name[=value]" of the command line (or "-name"), with its value:
// after '=', else the next argument where Abseil takes that as the value
// (a defined flag that is not a bool, and --undefok), else none.
struct FlagArg {
  absl::string_view name;
  std::optional<absl::string_view> value;
};

// The flags of argv up to "--", as Abseil reads them; positional
// arguments left out.
std::vector<FlagArg> FlagArgs(int argc, char** argv) {
  std::vector<FlagArg> args;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // a positional argument
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const size_t eq = arg.find('=');
    FlagArg flag_arg{arg.substr(0, eq), std::nullopt};
    if (eq != absl::string_view::npos) {
      flag_arg.value = arg.substr(eq + 1);
    } else if (i + 1 < argc) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(flag_arg.name);
      if (flag_arg.name == "undefok" || (flag != nullptr && !IsBool(flag))) {
        flag_arg.value = argv[++i];  // "--name value"
      }
    }
    args.push_back(flag_arg);
  }
  return args;
}

// What a value of `flag`'s type looks like, for an error message.
std::string ExpectedValue(const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<bool>()) return "true or false";
  if (flag.IsOfType<int>() || flag.IsOfType<int64_t>() || flag.IsOfType<int32_t>() ||
      flag.IsOfType<uint32_t>() || flag.IsOfType<uint64_t>() ||
      flag.IsOfType<std::optional<int>>() || flag.IsOfType<std::optional<int64_t>>()) {
    return "a whole number";
  }
  if (flag.IsOfType<double>() || flag.IsOfType<float>() || flag.IsOfType<std::optional<double>>()) {
    return "a number";
  }
  if (flag.IsOfType<std::vector<std::string>>()) return "a comma-separated list";
  return "";  // Abseil's parser says what it wanted
}

// The range of `flag`'s integer type, as "LOW..HIGH", or "".
std::string IntegerRange(const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<int>() || flag.IsOfType<std::optional<int>>()) {
    return absl::StrCat(std::numeric_limits<int>::min(), "..", std::numeric_limits<int>::max());
  }
  if (flag.IsOfType<int64_t>() || flag.IsOfType<std::optional<int64_t>>()) {
    return absl::StrCat(std::numeric_limits<int64_t>::min(), "..",
                        std::numeric_limits<int64_t>::max());
  }
  if (flag.IsOfType<uint32_t>()) return absl::StrCat("0..", std::numeric_limits<uint32_t>::max());
  if (flag.IsOfType<uint64_t>()) return absl::StrCat("0..", std::numeric_limits<uint64_t>::max());
  return "";
}

// " (default D)", or "" where the default is empty or unset.
std::string Default(const absl::CommandLineFlag& flag) {
  const std::string d = flag.DefaultValue();
  return d.empty() ? "" : absl::StrCat(" (default ", d, ")");
}

}  // namespace

std::string UnknownFlagProblem(int argc, char** argv, const char* program) {
  const std::vector<FlagArg> args = FlagArgs(argc, argv);
  // Names that --undefok=a,b lets Abseil ignore (a launcher may pass one
  // set of flags to every binary).
  std::vector<std::string> undefok;
  for (const FlagArg& arg : args) {
    if (arg.name != "undefok" || !arg.value) continue;
    for (absl::string_view name : absl::StrSplit(*arg.value, ',', absl::SkipEmpty())) {
      undefok.emplace_back(name);
    }
  }
  for (const FlagArg& arg : args) {
    const absl::string_view name = arg.name;
    if (IsAbseilFlag(name)) continue;
    // A defined flag is parsed whether or not --undefok lists it.
    if (absl::FindCommandLineFlag(name) != nullptr) continue;
    if (absl::StartsWith(name, "no") && !arg.value) {
      const absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && IsBool(negated)) continue;
    }
    if (std::find(undefok.begin(), undefok.end(), name) != undefok.end() ||
        (absl::StartsWith(name, "no") &&
         std::find(undefok.begin(), undefok.end(), name.substr(2)) != undefok.end())) {
      continue;  // Abseil ignores it (and its value, given as --name=value)
    }
    // The closest defined flag, if it is close at all.
    std::string closest;
    size_t best = std::max<size_t>(2, name.size() / 3) + 1;
    for (const auto& [candidate, unused] : absl::GetAllFlags()) {
      const size_t d = EditDistance(name, candidate);
      if (d < best || (d == best && !closest.empty() && candidate < closest)) {
        if (d < best) best = d;
        closest = std::string(candidate);
      }
    }
    return absl::StrCat("unknown flag --", name,
                        closest.empty() ? "" : absl::StrCat("; did you mean --", closest, "?"),
                        " (", program,
                        " --help lists every flag; a cluster is described by "
                        "TF_CONFIG or by flags)");
  }
  return "";
}

std::string BadValueProblem(int argc, char** argv) {
  for (const FlagArg& arg : FlagArgs(argc, argv)) {
    const absl::string_view name = arg.name;
    // Abseil refuses a flag file it cannot open, but reads a directory as
    // an empty file: every flag meant to be in it was lost without a word.
    // (Only the command line's: one named inside a flag file is not seen
    // here, nor are the values of flags that come from a flag file.)
    if (name == "flagfile" && arg.value) {
      for (absl::string_view path : absl::StrSplit(*arg.value, ',', absl::SkipEmpty())) {
        struct stat st;
        if (stat(std::string(path).c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
          return absl::StrCat("--flagfile=", path,
                              " is a directory; expected a file of flags, one --name=value "
                              "per line");
        }
      }
    }
    if (IsAbseilFlag(name)) continue;  // Abseil's own, checked by Abseil
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr || flag->IsRetired()) continue;  // --noname, or unknown: not ours here
    if (!arg.value) {
      if (IsBool(flag)) continue;
      const std::string expected = ExpectedValue(*flag);
      return absl::StrCat("--", name, " needs a value: --", name, "=VALUE",
                          expected.empty() ? "" : ", ", expected, Default(*flag));
    }
    const std::string value(*arg.value);
    // Abseil reads "" as "not given" for an optional number: "--port=" was
    // the default port, silently, where "--batch_size=" is refused.
    if (value.empty()) {
      const std::string expected = ExpectedValue(*flag);
      if (expected == "a whole number" || expected == "a number") {
        return absl::StrCat("--", name, "= has no value; expected ", expected, Default(*flag),
                            ", or leave the flag out");
      }
    }
    // Parsing sets the flag, as the parse that follows would anyway.
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      const std::string expected = ExpectedValue(*flag);
      absl::string_view digits = value;
      absl::ConsumePrefix(&digits, "-") || absl::ConsumePrefix(&digits, "+");
      if (expected == "a whole number" && !digits.empty() &&
          std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit)) {
        const std::string range = IntegerRange(*flag);
        return absl::StrCat("--", name, "=", value, " is out of range for this flag",
                            range.empty() ? "" : absl::StrCat(" (its type holds ", range, ")"),
                            Default(*flag));
      }
      if (!expected.empty()) {
        return absl::StrCat("--", name, "=", value, " is not ", expected, Default(*flag));
      }
      // Abseil's "Illegal value '<value>' specified for flag '<name>'; <why>":
      // the why, found after the flag's name (the value may hold "; ").
      const std::string lead = absl::StrCat("for flag '", name, "'; ");
      const size_t why = error.find(lead);
      return absl::StrCat(
          "--", name, "=", value, " is not valid", why == std::string::npos ? "" : ": ",
          why == std::string::npos ? "" : error.substr(why + lead.size()), Default(*flag));
    }
  }
  return "";
}

namespace {

// The arguments of flag file `path` as Abseil reads them: one a line,
// blank lines and '#' comments skipped (Abseil refuses other lines that
// do not start with '-' itself); nullopt where it cannot be read (Abseil
// names it). A line holding a value after a space ("--overlap false",
// which Abseil takes for a flag of that name) sets `*problem`.
std::optional<std::vector<std::string>> FlagfileArgs(absl::string_view path, std::string* problem) {
  std::ifstream in{std::string(path)};
  if (!in) return std::nullopt;
  std::vector<std::string> args;
  for (std::string line; std::getline(in, line);) {
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.size() < 2 || text[0] != '-' || text == "--") continue;
    const absl::string_view flag = text.substr(text[1] == '-' ? 2 : 1);
    const absl::string_view name = flag.substr(0, flag.find('='));
    const size_t space = name.find_first_of(" \t");
    if (space != absl::string_view::npos && problem->empty()) {
      absl::string_view value = absl::StripLeadingAsciiWhitespace(flag.substr(space));
      absl::ConsumePrefix(&value, "=");
      *problem =
          absl::StrCat("in --flagfile=", path, ": '", text,
                       "' is not a flag: a flag file holds one flag a line, its value "
                       "joined with '=' (--",
                       name.substr(0, space), "=", absl::StripLeadingAsciiWhitespace(value), ")");
    }
    args.emplace_back(text);
  }
  return args;
}

// The paths of argv's --flagfile flags, in order.
std::vector<std::string> FlagfilePaths(int argc, char** argv) {
  std::vector<std::string> paths;
  for (const FlagArg& arg : FlagArgs(argc, argv)) {
    if (arg.name != "flagfile" || !arg.value) continue;
    for (absl::string_view path : absl::StrSplit(*arg.value, ',', absl::SkipEmpty())) {
      paths.emplace_back(path);
    }
  }
  return paths;
}

// `args` as an argv (pointers into it).
std::vector<char*> Argv(std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return argv;
}

}  // namespace

std::string FlagfileProblem(int argc, char** argv, const char* program) {
  // --undefok counts wherever it is given, as Abseil reads it at the end.
  std::vector<std::string> undefok;
  std::vector<std::pair<std::string, std::vector<std::string>>> files;
  std::string problem;
  for (const std::string& path : FlagfilePaths(argc, argv)) {
    std::optional<std::vector<std::string>> args = FlagfileArgs(path, &problem);
    if (!problem.empty()) return problem;
    if (!args) continue;
    files.emplace_back(path, *std::move(args));
  }
  std::vector<std::string> all(argv, argv + argc);
  for (const auto& [path, args] : files) all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> all_argv = Argv(all);
  for (const FlagArg& arg : FlagArgs(static_cast<int>(all_argv.size()), all_argv.data())) {
    if (arg.name == "undefok" && arg.value) {
      undefok.push_back(absl::StrCat("--undefok=", *arg.value));
    }
  }
  for (auto& [path, args] : files) {
    std::vector<std::string> file_args = {program};
    file_args.insert(file_args.end(), undefok.begin(), undefok.end());
    file_args.insert(file_args.end(), args.begin(), args.end());
    std::vector<char*> file_argv = Argv(file_args);
    const int file_argc = static_cast<int>(file_argv.size());
    const std::string where = absl::StrCat("in --flagfile=", path, ": ");
    if (std::string unknown = UnknownFlagProblem(file_argc, file_argv.data(), program);
        !unknown.empty()) {
      return where + unknown;
    }
    if (std::string bad = BadValueProblem(file_argc, file_argv.data()); !bad.empty()) {
      return where + bad;
    }
  }
  return "";
}

namespace {

// ParseFlagsOrExit's before_error_exit while Abseil's own parse runs, which
// exits 1 itself on what the checks before it do not see (a --flagfile that
// cannot be read, or with an unknown flag in it).
const std::function<void()>* parse_exit_hook = nullptr;

void RunParseExitHook() {
  if (parse_exit_hook != nullptr && *parse_exit_hook) (*parse_exit_hook)();
}

}  // namespace

std::optional<std::string> CommandLineValue(int argc, char** argv, absl::string_view name) {
  // Each --flagfile's flags where it stands, as Abseil reads them (a
  // file's value, then the command line's after it, which wins).
  std::vector<std::string> expanded = {argc > 0 ? argv[0] : ""};
  for (int i = 1; i < argc; ++i) {
    expanded.emplace_back(argv[i]);
    // The argument alone, or with the next where it may be its value
    // ("--flagfile PATH"); a joined "--flagfile=a" is not paired with the
    // next, which would read a "--flagfile=b" after it twice.
    std::vector<char*> one = {argv[0], argv[i]};
    if (!absl::StrContains(argv[i], '=') && i + 1 < argc) one.push_back(argv[i + 1]);
    const std::vector<std::string> paths = FlagfilePaths(static_cast<int>(one.size()), one.data());
    if (paths.empty()) continue;
    if (one.size() == 3) expanded.emplace_back(argv[++i]);
    std::string unused;
    for (const std::string& path : paths) {
      if (auto args = FlagfileArgs(path, &unused)) {
        expanded.insert(expanded.end(), args->begin(), args->end());
      }
    }
  }
  std::vector<char*> expanded_argv = Argv(expanded);
  std::optional<std::string> value;
  for (const FlagArg& arg :
       FlagArgs(static_cast<int>(expanded_argv.size()), expanded_argv.data())) {
    if (arg.name == name && arg.value) value = std::string(*arg.value);
  }
  return value;
}

std::string ErrorLine(absl::string_view program, absl::string_view message) {
  constexpr size_t kMax = 1000, kHead = 600, kTail = 300;
  if (message.size() <= kMax) return absl::StrCat(program, ": ", message, "\n");
  return absl::StrCat(program, ": ", message.substr(0, kHead), " ... [",
                      message.size() - kHead - kTail, " bytes left out] ... ",
                      message.substr(message.size() - kTail), "\n");
}

std::string EmptyOptionalNumberProblem() {
  std::vector<const absl::CommandLineFlag*> empty;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const bool optional_number = flag->IsOfType<std::optional<int>>() ||
                                 flag->IsOfType<std::optional<int64_t>>() ||
                                 flag->IsOfType<std::optional<double>>();
    if (optional_number && flag->CurrentValue().empty() &&
        absl::flags_internal::WasPresentOnCommandLine(name)) {
      empty.push_back(flag);
    }
  }
  if (empty.empty()) return "";
  const absl::CommandLineFlag* first =
      *std::min_element(empty.begin(), empty.end(),
                        [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  return absl::StrCat("--", first->Name(),
                      "= has no value (in a --flagfile, --fromenv or --tryfromenv); expected ",
                      ExpectedValue(*first), Default(*first), ", or leave the flag out");
}

void ParseFlagsOrExit(int argc, char** argv, const char* program,
                      const std::function<void()>& before_error_exit) {
  const auto fail = [&](const std::string& problem) {
    const std::string line = ErrorLine(program, problem);
    std::fwrite(line.data(), 1, line.size(), stderr);
    if (before_error_exit) before_error_exit();
    std::exit(1);
  };
  if (const std::string unknown = UnknownFlagProblem(argc, argv, program); !unknown.empty()) {
    fail(unknown);
  }
  if (const std::string bad = BadValueProblem(argc, argv); !bad.empty()) fail(bad);
  if (const std::string in_file = FlagfileProblem(argc, argv, program); !in_file.empty()) {
    fail(in_file);
  }
  // absl::ParseCommandLine is this with kHandleUsage, whose exit code for a
  // printed help is 1 in Abseil 20220623 (0 in later releases). Its other
  // exits (a bad value, an unknown flag) stay as they are.
  namespace fi = absl::flags_internal;
  static const bool exit_hook_registered = std::atexit(RunParseExitHook) == 0;
  if (exit_hook_registered) parse_exit_hook = &before_error_exit;
  const std::vector<char*> left = fi::ParseCommandLineImpl(
      argc, argv, fi::ArgvListAction::kRemoveParsedArgs, fi::UsageFlagsAction::kIgnoreUsage,
      fi::OnUndefinedFlag::kAbortIfUndefined);
  parse_exit_hook = nullptr;
  if (fi::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) >= 0) {
    std::cout.flush();
    std::exit(0);
  }
  if (const std::string empty = EmptyOptionalNumberProblem(); !empty.empty()) fail(empty);
  // Abseil leaves what is not a flag, which no psflow binary reads: in
  // "--nesterov false" the bool was set by "--nesterov" and "false" was
  // dropped without a word, so the setting was the opposite of the one
  // asked for.
  if (left.size() > 1) {
    fail(absl::StrCat("unexpected argument '", left[1], "'; ", program,
                      " takes only flags, each value joined to its flag (--name=value; a bool: "
                      "--name, --noname or --name=false)"));
  }
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseNameValues(
    const char* flag, const std::vector<std::string>& items) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& item : items) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", item,
                                                     "' is not name=value"));
    }
    out.emplace_back(item.substr(0, eq), item.substr(eq + 1));
  }
  return out;
}

}  // namespace psflow
