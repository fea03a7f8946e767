// ParseNameValues: the name=value lists of --grpc_arg (ps_server, worker)
// and --client_grpc_arg (push_pull_bench). UnknownFlagProblem: the message
// for a mistyped or foreign flag. BadValueProblem: the message for a value
// that does not parse. CommandLineValue: a flag's value read from the
// command line before (or without) parsing.
#include "common/flags_usage.h"

#include <unistd.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

ABSL_FLAG(std::string, optimizer, "adam", "for the test");
ABSL_FLAG(bool, fused_push_pull, false, "for the test");
ABSL_FLAG(double, learning_rate, 0.1, "for the test");
ABSL_FLAG(int, batch_size, 64, "for the test");
ABSL_FLAG(std::optional<int>, port, std::nullopt, "for the test");

namespace psflow {
namespace {

using Pairs = std::vector<std::pair<std::string, std::string>>;

TEST(ParseNameValuesTest, SplitsAtTheFirstEquals) {
  auto got = ParseNameValues("grpc_arg", {"grpc.a=1", "b=x=y", "c="});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (Pairs{{"grpc.a", "1"}, {"b", "x=y"}, {"c", ""}}));
  auto none = ParseNameValues("grpc_arg", {});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(ParseNameValuesTest, AnItemWithoutNameOrEqualsIsRefused) {
  for (const char* bad : {"novalue", "=5"}) {
    auto got = ParseNameValues("grpc_arg", {"ok=1", bad});
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(got.status().message(), ::testing::HasSubstr("--grpc_arg"));
    EXPECT_THAT(got.status().message(), ::testing::HasSubstr(bad));
  }
}

std::string Problem(std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return UnknownFlagProblem(static_cast<int>(argv.size()), argv.data(), "prog");
}

TEST(UnknownFlagProblemTest, NamesTheFlagAndTheClosestOne) {
  EXPECT_EQ(Problem({"--optimiser=adam"}),
            "unknown flag --optimiser; did you mean --optimizer? (prog --help lists every flag; "
            "a cluster is described by TF_CONFIG or by flags)");
  EXPECT_THAT(Problem({"-learning_rat", "0.1"}),
              ::testing::HasSubstr("unknown flag --learning_rat; did you mean --learning_rate?"));
  // TensorFlow 1's flags: nothing close, no guess.
  EXPECT_THAT(Problem({"--optimizer=sgd", "--job_name=ps"}),
              ::testing::StartsWith("unknown flag --job_name (prog --help"));
}

TEST(UnknownFlagProblemTest, AcceptsEveryFormAbseilParses) {
  EXPECT_EQ(Problem({}), "");
  // A defined flag that --undefok also lists is parsed, its value too.
  EXPECT_EQ(Problem({"--undefok=learning_rate", "--learning_rate", "-0.5"}), "");
  EXPECT_EQ(Problem({"--optimizer=sgd", "-learning_rate=0.5", "--fused_push_pull"}), "");
  EXPECT_EQ(Problem({"--nofused_push_pull", "--fused_push_pull=false"}), "");
  // The value of a non-bool flag given as the next argument, even if it
  // starts with '-'; and nothing after "--".
  EXPECT_EQ(Problem({"--learning_rate", "-1", "--optimizer", "--sgd"}), "");
  EXPECT_EQ(Problem({"--", "--not_a_flag"}), "");
  EXPECT_EQ(Problem({"positional", "-"}), "");
  EXPECT_EQ(Problem({"--help"}), "");
  // What --undefok lists, Abseil ignores: so do we (in either form).
  EXPECT_EQ(Problem({"--undefok=job_name,verbose", "--job_name=ps", "--noverbose"}), "");
  EXPECT_EQ(Problem({"--job_name=ps", "--undefok", "job_name"}), "");
  EXPECT_THAT(Problem({"--undefok=job_name", "--task_index=0"}),
              ::testing::HasSubstr("unknown flag --task_index"));
  // A negation of a flag that is not a bool is not one.
  EXPECT_THAT(Problem({"--nooptimizer"}), ::testing::HasSubstr("unknown flag --nooptimizer"));
}

std::string BadValue(std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return BadValueProblem(static_cast<int>(argv.size()), argv.data());
}

TEST(BadValueProblemTest, NamesTheFlagTheValueAndWhatWasExpected) {
  absl::FlagSaver restore;  // the check sets the flags it parses
  EXPECT_EQ(BadValue({"--batch_size=64k"}), "--batch_size=64k is not a whole number (default 64)");
  EXPECT_EQ(BadValue({"--batch_size=99999999999"}),
            "--batch_size=99999999999 is out of range for this flag (its type holds "
            "-2147483648..2147483647) (default 64)");
  EXPECT_EQ(BadValue({"--optimizer=sgd", "--batch_size", "12x"}),
            "--batch_size=12x is not a whole number (default 64)");
  EXPECT_EQ(BadValue({"-learning_rate=fast"}),
            "--learning_rate=fast is not a number (default 0.1)");
  EXPECT_EQ(BadValue({"--fused_push_pull=maybe"}),
            "--fused_push_pull=maybe is not true or false (default false)");
  EXPECT_EQ(BadValue({"--batch_size"}),
            "--batch_size needs a value: --batch_size=VALUE, a whole number (default 64)");
}

TEST(ErrorLineTest, KeepsShortMessagesAndCutsTheMiddleOfLongOnes) {
  EXPECT_EQ(ErrorLine("worker", "--epochs=0; expected 1 or more"),
            "worker: --epochs=0; expected 1 or more\n");
  const std::string value(100000, 'x');
  const std::string message = "--optimizer=" + value + " is not one of adam, sgd";
  const std::string line = ErrorLine("ps_server", message);
  EXPECT_LT(line.size(), 1000u);
  EXPECT_THAT(line, ::testing::StartsWith("ps_server: --optimizer=xxx"));
  EXPECT_THAT(line, ::testing::EndsWith("xxx is not one of adam, sgd\n"));
  EXPECT_THAT(line, ::testing::HasSubstr(
                        absl::StrCat(" ... [", message.size() - 900, " bytes left out] ... ")));
}

// Abseil reads "" as "not given" for an optional number: "--port=" left
// the default port without a word.
TEST(BadValueProblemTest, AnEmptyNumberIsRefused) {
  absl::FlagSaver restore;
  EXPECT_EQ(BadValue({"--port="}),
            "--port= has no value; expected a whole number, or leave the "
            "flag out");
  EXPECT_EQ(BadValue({"--batch_size="}),
            "--batch_size= has no value; expected a whole number (default 64), or leave the flag "
            "out");
  EXPECT_EQ(BadValue({"--optimizer="}), "");  // a string may be empty
}

// Abseil reads a directory given as --flagfile as an empty file.
TEST(BadValueProblemTest, AFlagfileThatIsADirectoryIsRefused) {
  const std::string dir = ::testing::TempDir();
  EXPECT_EQ(BadValue({"--flagfile=" + dir}),
            absl::StrCat("--flagfile=", dir,
                         " is a directory; expected a file of flags, one --name=value per line"));
  EXPECT_THAT(BadValue({"--flagfile", "/nonexistent/flags," + dir}),
              ::testing::HasSubstr("is a directory"));
  EXPECT_EQ(BadValue({"--flagfile=/nonexistent/flags"}), "");  // Abseil says it cannot open it
}

TEST(BadValueProblemTest, AcceptsGoodValuesAndLeavesOthersToTheirChecks) {
  absl::FlagSaver restore;
  EXPECT_EQ(BadValue({}), "");
  EXPECT_EQ(BadValue({"--batch_size=32", "--learning_rate", "-0.5", "--fused_push_pull",
                      "--nofused_push_pull", "--optimiser=x", "--helpfull"}),
            "");
  EXPECT_EQ(absl::GetFlag(FLAGS_batch_size), 32);  // parsed as the real parse will
  EXPECT_EQ(BadValue({"--", "--batch_size=x"}), "");
}

std::optional<std::string> Value(std::vector<std::string> args, absl::string_view name) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return CommandLineValue(static_cast<int>(argv.size()), argv.data(), name);
}

// The flags inside a --flagfile get the command line's messages, saying
// which file (Abseil's own said "ERROR: Unknown command line flag
// 'optimiser'", with no binary and no guess).
TEST(FlagfileProblemTest, NamesTheFileAndTheFlag) {
  const std::string dir = ::testing::TempDir();
  auto problem_in = [&](const std::string& name, const std::string& text) {
    const std::string path = absl::StrCat(dir, "/flags_usage_test_", getpid(), "_", name);
    FILE* f = std::fopen(path.c_str(), "w");
    EXPECT_NE(f, nullptr);
    if (f == nullptr) return std::string("no file");
    std::fputs(text.c_str(), f);
    std::fclose(f);
    std::vector<std::string> args = {"prog", "--batch_size=32", "--flagfile=" + path};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    const std::string problem = FlagfileProblem(static_cast<int>(argv.size()), argv.data(), "prog");
    std::remove(path.c_str());
    return absl::StrReplaceAll(problem, {{path, "F"}});
  };
  EXPECT_EQ(problem_in("good", "# a comment\n\n  --batch_size=16\n--fused_push_pull\n"), "");
  EXPECT_EQ(problem_in("unknown", "--batch_size=16\n--optimiser=sgd\n"),
            "in --flagfile=F: unknown flag --optimiser; did you mean --optimizer? (prog --help "
            "lists every flag; a cluster is described by TF_CONFIG or by flags)");
  EXPECT_EQ(problem_in("bad", "--batch_size=16k\n"),
            "in --flagfile=F: --batch_size=16k is not a whole number (default 64)");
  EXPECT_EQ(
      problem_in("spaced", "--fused_push_pull false\n"),
      "in --flagfile=F: '--fused_push_pull false' is not a flag: a flag file holds one flag a "
      "line, its value joined with '=' (--fused_push_pull=false)");
  EXPECT_EQ(problem_in("spaced_equals", "--learning_rate = 0.5\n"),
            "in --flagfile=F: '--learning_rate = 0.5' is not a flag: a flag file holds one flag a "
            "line, its value joined with '=' (--learning_rate=0.5)");
  EXPECT_EQ(problem_in("dash", "-\n--batch_size=16\n"), "");
  // A --undefok counts wherever it stands, the command line's for a file
  // too, as Abseil reads it.
  {
    const std::string path = absl::StrCat(dir, "/flags_usage_test_", getpid(), "_undefok");
    FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("--other_binarys_flag=1\n", f);
    std::fclose(f);
    std::vector<std::string> args = {"prog", "--undefok=other_binarys_flag", "--flagfile=" + path};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    EXPECT_EQ(FlagfileProblem(static_cast<int>(argv.size()), argv.data(), "prog"), "");
    args.erase(args.begin() + 1);
    argv.clear();
    for (std::string& a : args) argv.push_back(a.data());
    EXPECT_THAT(FlagfileProblem(static_cast<int>(argv.size()), argv.data(), "prog"),
                ::testing::HasSubstr("unknown flag --other_binarys_flag"));
    std::remove(path.c_str());
  }
  // A file that cannot be read is Abseil's to name.
  std::vector<std::string> args = {"prog", "--flagfile=/nonexistent/psflow_flags"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  EXPECT_EQ(FlagfileProblem(2, argv.data(), "prog"), "");
  absl::SetFlag(&FLAGS_batch_size, 64);
}

TEST(CommandLineValueTest, FindsTheValueInEveryFormAbseilTakes) {
  EXPECT_EQ(Value({"--optimizer=sgd"}, "optimizer"), "sgd");
  EXPECT_EQ(Value({"-optimizer=sgd"}, "optimizer"), "sgd");
  EXPECT_EQ(Value({"--batch_size", "32", "--optimizer", "adagrad"}, "optimizer"), "adagrad");
  EXPECT_EQ(Value({"--optimizer="}, "optimizer"), "");
  // The last one wins, as in Abseil's parse; an unknown flag before it or
  // a bad value of another flag does not hide it.
  EXPECT_EQ(
      Value({"--optimizer=sgd", "--no_such=1", "--batch_size=x", "--optimizer=adam"}, "optimizer"),
      "adam");
}

// A --flagfile's values count where the flag stands: the last one given,
// file or command line, is the one Abseil keeps.
TEST(CommandLineValueTest, SeesAFlagfilesValuesWhereItStands) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/flags_usage_test_", getpid(), "_value");
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("# settings\n--optimizer=sgd\n", f);
  std::fclose(f);
  auto value = [](std::vector<std::string> args) {
    args.insert(args.begin(), "prog");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return CommandLineValue(static_cast<int>(argv.size()), argv.data(), "optimizer");
  };
  EXPECT_EQ(value({"--flagfile=" + path}), "sgd");
  EXPECT_EQ(value({"--flagfile", path}), "sgd");
  EXPECT_EQ(value({"--flagfile=" + path, "--optimizer=adam"}), "adam");
  EXPECT_EQ(value({"--optimizer=adam", "--flagfile=" + path}), "sgd");
  // Two files in a row: the later one's value wins.
  const std::string other = path + "_other";
  FILE* g = std::fopen(other.c_str(), "w");
  ASSERT_NE(g, nullptr);
  std::fputs("--optimizer=lion\n", g);
  std::fclose(g);
  EXPECT_EQ(value({"--flagfile=" + other, "--flagfile=" + path}), "sgd");
  EXPECT_EQ(value({"--flagfile=" + path, "--flagfile=" + other}), "lion");
  std::remove(other.c_str());
  EXPECT_EQ(value({"--flagfile=/nonexistent/psflow_flags"}), std::nullopt);
  std::remove(path.c_str());
}

TEST(CommandLineValueTest, NothingWhereTheFlagIsNotGiven) {
  EXPECT_EQ(Value({}, "optimizer"), std::nullopt);
  EXPECT_EQ(Value({"--optimizer_x=sgd", "--batch_size=3"}, "optimizer"), std::nullopt);
  EXPECT_EQ(Value({"--", "--optimizer=sgd"}, "optimizer"), std::nullopt);
  EXPECT_EQ(Value({"positional", "optimizer=sgd"}, "optimizer"), std::nullopt);
  // "--fused_push_pull sgd": a bool takes no next argument.
  EXPECT_EQ(Value({"--fused_push_pull", "sgd"}, "fused_push_pull"), std::nullopt);
}

}  // namespace
}  // namespace psflow
