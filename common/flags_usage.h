// Makes --help list the flags defined in a binary's main file (Abseil's
// default only matches files named after the program), and parses flag
// values shared by several binaries.
#ifndef PSFLOW_COMMON_FLAGS_USAGE_H_
#define PSFLOW_COMMON_FLAGS_USAGE_H_

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace psflow {

// `usage` is printed above the flags; `main_file` is a path suffix such as
// "ps_server/main.cc". Call before absl::ParseCommandLine.
void SetUsage(const char* usage, const char* main_file);

// Why the command line names a flag this binary does not define, or "" if
// it names none: "unknown flag --optimiser; did you mean --optimizer? (...)".
// Abseil's own message names neither the binary nor a likely flag. Looks
// at "--name", "-name", "--name=value" and "--noname" (a bool's negation),
// skips the value after a non-bool "--name value", lets through the names
// that --undefok lists (as Abseil ignores them), and stops at "--". Call
// before absl::ParseCommandLine, and exit 1 with the message.
std::string UnknownFlagProblem(int argc, char** argv, const char* program);

// Why a value given to one of the binary's flags does not parse, or "" if
// every one does: "--batch_size=64k is not a whole number (default 64)",
// "--batch_size needs a value: ...". Abseil's own message names neither the
// binary nor what was expected. Sets the flags it parses (the parse that
// follows sets them alike). Call after UnknownFlagProblem.
std::string BadValueProblem(int argc, char** argv);

// UnknownFlagProblem's and BadValueProblem's findings for the flags inside
// each --flagfile of the command line (Abseil's own, raw, said "ERROR:
// Unknown command line flag 'train_step'" with no binary and no guess),
// prefixed with "in --flagfile=PATH: ", and a line that holds a value
// after a space ("--overlap false", which Abseil reads as a flag of that
// name). "" where all are fine or a file cannot be read (Abseil says so).
// Flag files named inside flag files are not read. Call after
// BadValueProblem.
std::string FlagfileProblem(int argc, char** argv, const char* program);

// After the parse: the first optional number (by name) that was given an
// empty value, "--port= has no value (in a --flagfile, ...); ...",
// else "". Abseil reads "" as
// "not given" there; BadValueProblem refuses that on the command line, but
// it reads argv, and a --flagfile's "--port=" meant the default port,
// silently.
std::string EmptyOptionalNumberProblem();

// Parses the command line as absl::ParseCommandLine does, but exits 0
// after --help, --helpfull and their kin have printed (Abseil 20220623
// exits 1 there, which scripts read as a failure), and first exits 1 with
// UnknownFlagProblem's message, prefixed with "program: ", on an unknown
// flag, with BadValueProblem's on a value that does not parse, and with
// EmptyOptionalNumberProblem's after the parse. An
// argument that is not a flag exits 1 too (none of psflow's binaries takes
// one: "--nesterov false" would set --nesterov and drop "false").
//
// `before_error_exit`, where given, runs before each of those exits 1, and
// where Abseil's own parse exits 1 (a --flagfile that cannot be read, or
// with an unknown flag in it); not after --help. The worker removes an
// earlier run's summary there.
void ParseFlagsOrExit(int argc, char** argv, const char* program,
                      const std::function<void()>& before_error_exit = nullptr);

// The value the command line gives flag `name` (--name=V, -name=V, or
// --name V for a flag that is not a bool), the last one where it is given
// more than once as Abseil keeps the last; nullopt where it is not given.
// A --flagfile's values count where the flag stands (flag files named in
// flag files are not read); --fromenv's are not seen. For use before, or
// without, parsing: a parse that fails exits.
std::optional<std::string> CommandLineValue(int argc, char** argv, absl::string_view name);

// "program: message\n", the line a binary prints before it exits on bad
// input. A message over 1,000 bytes (one that quotes a value of 100 KB, say)
// keeps its first 600 and last 300 bytes, with how much was left out
// between them, so that the name of what was wrong and what was expected
// stay on the screen.
std::string ErrorLine(absl::string_view program, absl::string_view message);

// Splits each "name=value" of flag `flag` (e.g. --grpc_arg) at its first '=';
// INVALID_ARGUMENT naming the flag and the item when one has no '=' or no
// name.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseNameValues(
    const char* flag, const std::vector<std::string>& items);

}  // namespace psflow

#endif  // PSFLOW_COMMON_FLAGS_USAGE_H_
