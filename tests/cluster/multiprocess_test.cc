// Multi-process test of the real binaries: 2 ps_server + 2 worker processes
// configured only through TF_CONFIG (as Kubeflow's TFJob does), training the
// seed model on Debian's Fashion-MNIST for a few hundred steps.
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/process_stats.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "psflow.grpc.pb.h"
#include "tests/cluster/subprocess.h"

namespace {

using psflow::ParameterServer;
using psflow::PushResponse;
using psflow::StatusRequest;
using psflow::StatusResponse;
using psflow::test_support::IsRunning;
using psflow::test_support::JsonNumber;
using psflow::test_support::LocalCluster;
using psflow::test_support::NoSanitizerReport;
using psflow::test_support::ProcessTest;
using psflow::test_support::ReadFile;
using psflow::test_support::WaitForText;

class MultiProcessTest : public ProcessTest {
 protected:
  // Runs `argv` (with `tf_config`, none by default) to its end and returns
  // its exit code and output.
  std::pair<int, std::string> RunToEnd(const std::vector<std::string>& argv,
                                       const std::string& tf_config = "") {
    const std::string log = absl::StrCat(dir_, "/run-", ++runs_, ".log");
    const pid_t pid = Start(argv, tf_config, log);
    if (pid <= 0) return {-2, "spawn failed"};
    const int code = Reap(pid, std::chrono::seconds(20));
    EXPECT_TRUE(NoSanitizerReport(ReadFile(log))) << absl::StrJoin(argv, " ");
    return {code, ReadFile(log)};
  }

  // Starts ps_server with `flags` on a free port, waits for it to listen,
  // stops it with SIGTERM and returns what it printed ("" after a failure,
  // which is reported).
  std::string StartedAndStoppedShardSays(const std::vector<std::string>& flags) {
    const std::string log = absl::StrCat(dir_, "/run-", ++runs_, ".log");
    std::vector<std::string> argv = {PSFLOW_PS_SERVER_BIN, "--port=0"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const pid_t pid = Start(argv, "", log);
    if (pid <= 0) {
      ADD_FAILURE() << "spawn failed";
      return "";
    }
    if (!WaitForText(log, "listening on", pid, std::chrono::seconds(20))) {
      ADD_FAILURE() << "never listened: " << ReadFile(log);
      return "";
    }
    ::kill(pid, SIGTERM);
    EXPECT_EQ(Reap(pid, std::chrono::seconds(20)), 0) << ReadFile(log);
    return ReadFile(log);
  }

  // Starts a shard on a free loopback port, logging to `log`, and sets
  // `address` to where it listens; returns its pid, or 0 if it did not
  // start listening.
  // The worker binary, alone, trains 2 steps against the shard at `address`.
  std::pair<int, std::string> TrainTwoSteps(const std::string& address) {
    return RunToEnd({PSFLOW_WORKER_BIN, "--ps_hosts=" + address, "--worker_hosts=127.0.0.1:1",
                     "--train_steps=2", "--epochs=1", "--threads=1"});
  }

  pid_t StartLoopbackShard(const std::string& log, std::string* address,
                           const std::vector<std::string>& flags = {}) {
    std::vector<std::string> argv = {PSFLOW_PS_SERVER_BIN, "--address=127.0.0.1:0"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const pid_t pid = Start(argv, "", log);
    if (pid <= 0 || !WaitForText(log, "listening on", pid, std::chrono::seconds(20))) return 0;
    const std::string text = ReadFile(log);
    const size_t at = text.find("listening on 127.0.0.1:") + std::strlen("listening on ");
    *address = text.substr(at, text.find(',', at) - at);
    return pid;
  }

 private:
  int runs_ = 0;
};

TEST_F(MultiProcessTest, TwoPsTwoWorkersThroughTfConfig) {
  struct stat st;
  ASSERT_EQ(::stat("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", &st), 0)
      << "Fashion-MNIST is missing: install Debian's dataset-fashion-mnist (deploy/setup.sh)";
  const std::string& dir = dir_;
  const LocalCluster cluster(2, 2);
  auto tf_config = [&](const char* type, int index) { return cluster.TfConfig(type, index); };

  std::vector<pid_t> ps_pids;
  for (int i = 0; i < 2; ++i) {
    ps_pids.push_back(
        Start({PSFLOW_PS_SERVER_BIN}, tf_config("ps", i), absl::StrCat(dir, "/ps-", i, ".log")));
    ASSERT_GT(ps_pids.back(), 0);
  }
  std::vector<pid_t> worker_pids;
  for (int i = 0; i < 2; ++i) {
    worker_pids.push_back(
        Start({PSFLOW_WORKER_BIN, "--train_steps=150", "--epochs=1", "--device=cpu",
               absl::StrCat("--summary_json=", dir, "/worker-", i, ".json")},
              tf_config("worker", i), absl::StrCat(dir, "/worker-", i, ".log")));
    ASSERT_GT(worker_pids.back(), 0);
  }
  std::vector<int> codes;
  for (pid_t p : worker_pids) codes.push_back(Reap(p, std::chrono::seconds(240)));
  for (pid_t p : ps_pids) ::kill(p, SIGTERM);
  std::vector<int> ps_codes;
  for (pid_t p : ps_pids) ps_codes.push_back(Reap(p, std::chrono::seconds(20)));

  for (int i = 0; i < 2; ++i) {
    const std::string log = ReadFile(absl::StrCat(dir, "/worker-", i, ".log"));
    EXPECT_EQ(codes[i], 0) << "worker " << i << " log:\n" << log;
    EXPECT_TRUE(NoSanitizerReport(log));
    const std::string json = ReadFile(absl::StrCat(dir, "/worker-", i, ".json"));
    ASSERT_FALSE(json.empty()) << "worker " << i << " wrote no summary; log:\n" << log;
    for (const char* key :
         {"test_accuracy", "test_loss", "steps", "examples_per_sec", "wall_seconds", "compute_s",
          "clip_s", "push_s", "pull_s", "push_pull_s", "resident_bytes"}) {
      EXPECT_GT(JsonNumber(json, key), -1e299) << key << " missing in " << json;
    }
    EXPECT_EQ(JsonNumber(json, "steps"), 150);
    // 150 steps of Adam on the seed model are far above chance (0.1).
    EXPECT_GT(JsonNumber(json, "test_accuracy"), 0.6) << json;
  }
  EXPECT_THAT(ReadFile(dir + "/worker-0.log"), ::testing::HasSubstr("(chief)"));
  // Without --threads the two workers on this machine share its cores (each
  // taking all of them ran 3.3 times slower on 2 cores).
  const int want = std::max(1, psflow::UsableCores() / 2);
  const std::string threads = absl::StrCat(", ", want, want == 1 ? " thread," : " threads,");
  for (int i = 0; i < 2; ++i) {
    EXPECT_THAT(ReadFile(absl::StrCat(dir, "/worker-", i, ".log")), ::testing::HasSubstr(threads));
  }
  // The seed model has 7 parts on 2 shards (dense/kernel is cut in two).
  EXPECT_THAT(ReadFile(dir + "/worker-0.log"),
              ::testing::HasSubstr("registered the model: 7 parts created with this worker's "
                                   "initial values, 0 kept"));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(ps_codes[i], 0) << ReadFile(absl::StrCat(dir, "/ps-", i, ".log"));
    EXPECT_THAT(ReadFile(absl::StrCat(dir, "/ps-", i, ".log")),
                ::testing::HasSubstr(absl::StrCat("shard ", i, " of 2")));
    EXPECT_TRUE(NoSanitizerReport(ReadFile(absl::StrCat(dir, "/ps-", i, ".log"))));
  }
}

// The summary is checked for writability before the run, but a summary
// that cannot be written at the end (a full disk) fails the run, and a run
// that fails leaves no empty file behind (the check used to create it).
TEST_F(MultiProcessTest, SummaryIsWrittenWholeOrTheRunFails) {
  const LocalCluster cluster(1, 1);
  const pid_t ps = Start({PSFLOW_PS_SERVER_BIN}, cluster.TfConfig("ps", 0), dir_ + "/ps.log");
  ASSERT_GT(ps, 0);
  const std::string ps_hosts = "--ps_hosts=" + cluster.ps[0];
  const std::string worker_hosts = "--worker_hosts=" + cluster.workers[0];
  {
    const auto [code, out] =
        RunToEnd({PSFLOW_WORKER_BIN, ps_hosts, worker_hosts, "--train_steps=3", "--epochs=1",
                  "--threads=1", "--device=cpu", "--summary_json=/dev/full"});
    EXPECT_EQ(code, 1) << out;
    EXPECT_THAT(out, ::testing::HasSubstr("--summary_json: cannot write /dev/full"));
  }
  {
    const std::string summary = dir_ + "/failed.json";
    const auto [code, out] = RunToEnd(
        {PSFLOW_WORKER_BIN, ps_hosts, worker_hosts, "--batch_size=0", "--summary_json=" + summary});
    EXPECT_EQ(code, 1) << out;
    EXPECT_THAT(out, ::testing::HasSubstr("--batch_size=0"));
    struct stat st {};
    EXPECT_NE(::stat(summary.c_str(), &st), 0) << summary << " was left behind";
  }
  {
    // A summary an earlier run left is gone when this run fails, so that a
    // script reading it cannot take it for this run's.
    const std::string summary = dir_ + "/stale.json";
    // (Also when a flag's value is refused, the first check after parsing,
    // and when the flag parser itself refuses the command line, a
    // --flagfile's line included.)
    const std::string flagfile = dir_ + "/bad.flags";
    std::ofstream(flagfile) << "--epochs=1\n--no_such_flag_in_a_file=1\n";
    // An empty optional number in a flag file meant "not given", silently.
    const std::string empty_flagfile = dir_ + "/empty.flags";
    std::ofstream(empty_flagfile) << "--task_index=\n";
    ASSERT_EQ(::setenv("FLAGS_task_index", "", 1), 0);
    absl::Cleanup unset = [] { ::unsetenv("FLAGS_task_index"); };
    for (const auto& [bad, said] :
         {std::pair<std::string, std::string>{"--dataset=no_such_dataset", "no_such_dataset"},
          {"--epochs=0", "--epochs=0"},
          {"--no_such_flag=1", "unknown flag --no_such_flag"},
          {"--epochs=three", "--epochs=three is not a whole number"},
          {"stray", "unexpected argument 'stray'"},
          {"--flagfile=" + flagfile, "worker: in --flagfile=" + flagfile +
                                         ": unknown flag --no_such_flag_in_a_file (worker --help"},
          {"--flagfile=" + empty_flagfile,
           "in --flagfile=" + empty_flagfile + ": --task_index= has no value"},
          // FLAGS_task_index set empty below: the same from the environment.
          {"--fromenv=task_index", "--task_index= has no value (in a --flagfile, --fromenv"}}) {
      std::ofstream(summary) << "{\"test_accuracy\": 0.9}\n";
      const auto [code, out] =
          RunToEnd({PSFLOW_WORKER_BIN, ps_hosts, worker_hosts, bad, "--summary_json=" + summary});
      EXPECT_EQ(code, 1) << out;
      EXPECT_THAT(out, ::testing::HasSubstr(said));
      struct stat st {};
      EXPECT_NE(::stat(summary.c_str(), &st), 0)
          << "the earlier run's " << summary << " is left after " << bad;
    }
  }
  {
    // The summary's path in a flag file whose other flag is refused: the
    // check stops before the flag is set, and the path is still found.
    const std::string summary = dir_ + "/in_file.json";
    std::ofstream(summary) << "{\"test_accuracy\": 0.9}\n";
    const std::string flagfile = dir_ + "/summary.flags";
    std::ofstream(flagfile) << "--no_such_flag_here=1\n--summary_json=" << summary << "\n";
    const auto [code, out] =
        RunToEnd({PSFLOW_WORKER_BIN, ps_hosts, worker_hosts, "--flagfile=" + flagfile});
    EXPECT_EQ(code, 1) << out;
    EXPECT_THAT(out, ::testing::HasSubstr("unknown flag --no_such_flag_here"));
    struct stat st {};
    EXPECT_NE(::stat(summary.c_str(), &st), 0) << "the earlier run's " << summary << " is left";
  }
  {
    // A symbolic link stays, and the summary it points to is emptied (the
    // link alone used to be removed, the earlier summary kept).
    const std::string target = dir_ + "/target.json", link = dir_ + "/link.json";
    std::ofstream(target) << "{\"test_accuracy\": 0.9}\n";
    ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
    const auto [code, out] = RunToEnd(
        {PSFLOW_WORKER_BIN, ps_hosts, worker_hosts, "--epochs=0", "--summary_json=" + link});
    EXPECT_EQ(code, 1) << out;
    struct stat st {};
    ASSERT_EQ(::lstat(link.c_str(), &st), 0) << "the link was removed";
    EXPECT_EQ(ReadFile(target), "") << "the earlier summary is left behind the link";
  }
  {
    // --summary_json=/dev/stdout with stdout going to a file: the summary
    // comes after the log, which neither the removal at the start nor the
    // summary's writing may empty.
    const std::string log = dir_ + "/stdout-summary.log";
    const pid_t worker =
        Start({PSFLOW_WORKER_BIN, ps_hosts, worker_hosts, "--train_steps=3", "--epochs=1",
               "--threads=1", "--device=cpu", "--summary_json=/dev/stdout"},
              "", log);
    EXPECT_EQ(Reap(worker, std::chrono::seconds(120)), 0) << ReadFile(log);
    const std::string out = ReadFile(log);
    EXPECT_THAT(out, ::testing::HasSubstr("registered the model"));
    EXPECT_THAT(out, ::testing::HasSubstr("\"test_accuracy\""));
  }
  ::kill(ps, SIGTERM);
  EXPECT_EQ(Reap(ps, std::chrono::seconds(20)), 0) << ReadFile(dir_ + "/ps.log");
}

// As PID 1 (a container's entry point), the kernel drops every signal the
// process has no handler for: the worker ignored SIGTERM (docker stop, a
// pod's deletion) and trained on until SIGKILL. It ends on it there too.
TEST_F(MultiProcessTest, WorkerAsPidOneStopsOnSigterm) {
  const char* unshare = "/usr/bin/unshare";  // util-linux, essential in Debian
  if (const auto [code, out] = RunToEnd({unshare, "--pid", "--fork", "/bin/true"}); code != 0) {
    GTEST_SKIP() << "cannot make a PID namespace here (not root?): " << out;
  }
  const std::string log = dir_ + "/worker.log";
  // The worker waits for a shard that is not there (nothing listens on
  // port 1): it would wait 120 s. (--kill-child: a test that gives up on
  // unshare kills the worker too.)
  const pid_t outer = Start(
      {unshare, "--pid", "--fork", "--kill-child", PSFLOW_WORKER_BIN, "--ps_hosts=127.0.0.1:1",
       "--worker_hosts=localhost:1", "--wait_for_variables_s=120", "--threads=1"},
      "", log);
  ASSERT_GT(outer, 0);
  ASSERT_TRUE(
      psflow::test_support::WaitForText(log, "worker 0 of 1", outer, std::chrono::seconds(20)))
      << ReadFile(log);
  // The worker is unshare's one child (PID 1 in its namespace).
  const std::string children =
      ReadFile(absl::StrCat("/proc/", outer, "/task/", outer, "/children"));
  pid_t worker = 0;
  ASSERT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(children), &worker)) << children;
  ASSERT_EQ(::kill(worker, SIGTERM), 0);
  // unshare passes the worker's end on: exit code 143 or killed by SIGTERM.
  EXPECT_EQ(Reap(outer, std::chrono::seconds(20)), 128 + SIGTERM)
      << "SIGTERM to the worker as PID 1 did not end it\n"
      << ReadFile(log);
}

// --help lists the binary's own flags and exits 0 (Debian's Abseil exits
// 1 after printing it), as does --version; a bad flag value still exits 1.
TEST_F(MultiProcessTest, HelpListsTheFlagsAndExitsZero) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{PSFLOW_PS_SERVER_BIN, "--help"}, {"ps_server --port=2222", "--optimizer", "--beta_1"}},
      {{PSFLOW_PS_SERVER_BIN, "--helpfull"}, {"--max_chunk_bytes", "--flagfile"}},
      {{PSFLOW_WORKER_BIN, "--help"}, {"worker --ps_hosts=", "--fused_push_pull"}},
      // psflow's version and libraries, not Abseil's "Debug build (NDEBUG
      // not #defined)", which described Debian's Abseil.
      {{PSFLOW_PS_SERVER_BIN, "--version"}, {"ps_server (psflow 0.", "built with gRPC 1."}},
      {{PSFLOW_WORKER_BIN, "--version"}, {"worker (psflow 0.", "Protocol Buffers 3."}},
  };
  for (const auto& [argv, expected] : cases) {
    const auto [code, out] = RunToEnd(argv);
    EXPECT_EQ(code, 0) << absl::StrJoin(argv, " ") << "\n" << out;
    for (const std::string& text : expected) {
      EXPECT_THAT(out, ::testing::HasSubstr(text)) << absl::StrJoin(argv, " ");
    }
  }
  const auto [code, out] = RunToEnd({PSFLOW_PS_SERVER_BIN, "--port=two"});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("ps_server: --port=two is not a whole number"));
}

// A malformed TF_CONFIG is refused with a message naming the key; nothing runs.
TEST_F(MultiProcessTest, MalformedTfConfigIsAClearError) {
  const auto [code, out] =
      RunToEnd({PSFLOW_PS_SERVER_BIN},
               "{\"cluster\": {\"ps\": [\"localhost:1\"]}, \"task\": {\"type\": \"ps\", "
               "\"index\": 4}}");
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("task.index"));
}

TEST_F(MultiProcessTest, MalformedGrpcArgIsAClearError) {
  const auto [code, out] =
      RunToEnd({PSFLOW_PS_SERVER_BIN, "--port=0", "--grpc_arg=grpc.http2.lookahead_bytes"});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("'grpc.http2.lookahead_bytes' is not name=value"));
}

// Flags that contradict each other or make no sense are refused, naming the
// flags; before, negative values were ignored, --num_shards could disagree
// with --ps_hosts, and errors named the worker's --task_type/--task_index.
TEST_F(MultiProcessTest, ContradictoryPsServerFlagsAreRefused) {
  const std::string ps = PSFLOW_PS_SERVER_BIN;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{ps, "--ps_hosts=127.0.0.1:1", "--num_shards=4"},
       "--num_shards=4 but --ps_hosts lists 1 ps address"},
      {{ps, "--num_shards=0"}, "--num_shards=0; expected 1 or more"},
      {{ps, "--shard_index=-7"}, "--shard_index=-7; expected 0 or more"},
      {{ps, "--port=-5"}, "--port=-5; expected 0..65535"},
      {{ps, "--port=0", "--shard_index=3", "--num_shards=2"},
       "--shard_index=3 but there are 2 shards"},
      {{ps, "--ps_hosts=127.0.0.1:1,127.0.0.1:2"}, "--shard_index was not given"},
      {{ps, "--port=0", "--num_shards=2"}, "--num_shards=2 but --shard_index was not given"},
      {{ps, "--port=0", "--address=127.0.0.1:0"}, "--port and --address were both given"},
      // "false" used to be dropped, leaving --nesterov on.
      {{ps, "--port=0", "--optimizer=sgd", "--momentum=0.9", "--nesterov", "false"},
       "ps_server: unexpected argument 'false'"},
      // Used to listen on port 99999 % 65536, and on a nameless socket.
      {{ps, "--address=127.0.0.1:99999"},
       "--address=\"127.0.0.1:99999\" has port \"99999\", outside"},
      {{ps, "--address=unix:"}, "--address=\"unix:\" has an empty unix socket path"},
      // Control bytes come out escaped, not raw on the terminal.
      {{ps, "--address=h\x1b[31m:1"}, "--address=\"h\\x1b[31m:1\" has '\\x1b' in its host name"},
      {{ps, "--port=0", "--threads=-5"}, "--threads=-5; expected 0 (no limit) or more"},
      // Used to abort in std::thread.
      {{ps, "--port=0", "--apply_threads=100000"}, "--apply_threads=100000; expected -1"},
      {{ps, "--port=0", "--apply_threads=-5"}, "--apply_threads=-5; expected -1"},
      {{ps, "--port=0", "--grpc_arg=grpc.keepalive_time_ms=99999999999"},
       "is beyond gRPC's 32-bit integers"},
      // Used to be dropped, and a second shard could take the same port.
      {{ps, "--port=0", "--grpc_arg=grpc.so_reuseport=false"},
       "grpc.so_reuseport=false is not an integer"},
      // Used to make every push fail (window + 1 overflowed), or take 5 GB.
      {{ps, "--port=0", "--apply_window=2147483647"},
       "--apply_window is 2147483647; expected 1 to 64"},
      {{ps, "--address=unix-abstract:123"},
       "--address=\"unix-abstract:123\" is an abstract unix socket, which psflow does not take"},
      {{ps, "--port=0", "--max_variable_bytes=-2"},
       "max_variable_bytes (--max_variable_bytes) is -2; expected -1"},
      // Its sum with gRPC's framing allowance used to wrap around.
      {{ps, "--port=0", "--max_chunk_bytes=9223372036854775807"},
       "(--max_chunk_bytes) is 9223372036854775807; expected 4 to 1073741824"},
  };
  for (const auto& [argv, want] : cases) {
    const auto [code, out] = RunToEnd(argv);
    EXPECT_EQ(code, 1) << absl::StrJoin(argv, " ") << "\n" << out;
    EXPECT_THAT(out, ::testing::HasSubstr(want)) << absl::StrJoin(argv, " ");
    EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("--task_"))) << absl::StrJoin(argv, " ");
  }
  // TF_CONFIG says this is a worker: --shard_index must not turn it into a
  // shard on the worker's host. Refused without first warning that the flag
  // overrides TF_CONFIG's index, which read as if it had been obeyed.
  const auto [code, out] =
      RunToEnd({ps, "--shard_index=0"},
               R"({"cluster":{"ps":["127.0.0.1:1"],"worker":["127.0.0.1:2","127.0.0.1:3"]},)"
               R"("task":{"type":"worker","index":1}})");
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out,
              ::testing::HasSubstr("--shard_index=0 but TF_CONFIG's task type is \"worker\";"));
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("warning"))) << out;

  const std::string worker = PSFLOW_WORKER_BIN;
  const std::string hosts[] = {"--ps_hosts=127.0.0.1:1", "--worker_hosts=127.0.0.1:2"};
  const std::vector<std::pair<std::vector<std::string>, std::string>> worker_cases = {
      {{worker, hosts[0]}, "without TF_CONFIG, give --worker_hosts"},
      {{worker, hosts[0], hosts[1], "--epochs=0"}, "--epochs=0; expected 1 or more"},
      {{worker, hosts[0], hosts[1], "--train_steps=-5"}, "--train_steps=-5; expected 0"},
      {{worker, hosts[0], hosts[1], "--threads=-3"}, "--threads=-3; expected 0"},
      // About 1.2e10 parameters (290 GB of buffers): refused, not bad_alloc.
      {{worker, hosts[0], hosts[1],
        "--model=flatten,dense:2700000,dense:790,dense:2700000,dense:790,dense:2700000,dense:10"},
       "parameters (6 float32 copies"},
      // Activations of 1.5e9 values per example: std::bad_alloc (the
      // reference backend) or "could not create a memory object" (oneDNN).
      {{worker, hosts[0], hosts[1], "--device=reference",
        "--model=conv2d:2000000:1,maxpool:28,flatten,dense:10"},
       "GiB for a batch's activations and their gradients (1570000794 values per example)"},
      {{worker, hosts[0], hosts[1], "--batch_size=100000000"},
       "876.2 GiB for the input batches assembled ahead"},
      {{worker, hosts[0], hosts[1], "--summary_json=/nonexistent/dir/x.json"},
       "--summary_json=/nonexistent/dir/x.json cannot be written"},
      {{worker, hosts[0], hosts[1], "--fused_push_pull", "false"},
       "worker: unexpected argument 'false'"},
      // gRPC dropped it, and keepalive with it.
      {{worker, hosts[0], hosts[1], "--grpc_arg=grpc.keepalive_time_ms=abc"},
       "grpc.keepalive_time_ms=abc is not an integer"},
      // Used to crash in OpenMP.
      {{worker, hosts[0], hosts[1], "--threads=100000"}, "--threads=100000; expected 0"},
      {{worker, hosts[0], hosts[1], "--gpu_memory_limit_mb=-1"},
       "--gpu_memory_limit_mb=-1; expected 0"},
      // Used to become a cap of 0 bytes.
      {{worker, hosts[0], hosts[1], "--gpu_memory_limit_mb=inf"},
       "--gpu_memory_limit_mb=inf; expected 0 (no cap) to 1073741824 (1 PiB)"},
      {{worker, hosts[0], hosts[1], "--clipnorm=1", "--global_clipnorm=5"},
       "--clipnorm=1, --clipvalue=0 and --global_clipnorm=5: at most one may be set"},
      {{worker, hosts[0], hosts[1], "--clipvalue=-0.5"},
       "--clipvalue=-0.5; expected 0 (off) or a finite value > 0"},
      {{worker, hosts[0], hosts[1], "--wait_for_variables_s=-5"},
       "--wait_for_variables_s=-5; expected 0"},
      {{worker, hosts[0], hosts[1], "--max_chunk_bytes=2000000000"},
       "--max_chunk_bytes=2000000000; expected 4 to"},
  };
  for (const auto& [argv, want] : worker_cases) {
    const auto [code, out] = RunToEnd(argv);
    EXPECT_EQ(code, 1) << absl::StrJoin(argv, " ") << "\n" << out;
    EXPECT_THAT(out, ::testing::HasSubstr(want)) << absl::StrJoin(argv, " ");
  }
}

// A TFJob's other task types, given to the worker binary, are refused with
// what to run instead.
TEST_F(MultiProcessTest, OtherTfJobTaskTypesSayWhatToRun) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ps", "the worker binary runs \"worker\" or \"chief\" tasks (a ps task runs ps_server)"},
      {"evaluator", "psflow has no evaluator task yet: leave it out of the job"},
  };
  for (const auto& [type, want] : cases) {
    const auto [code, out] =
        RunToEnd({PSFLOW_WORKER_BIN},
                 absl::StrCat(R"({"cluster":{"ps":["127.0.0.1:1"],"worker":["127.0.0.1:2"]},)",
                              R"("task":{"type":")", type, R"(","index":0}})"));
    EXPECT_EQ(code, 1) << type << "\n" << out;
    EXPECT_THAT(out, ::testing::HasSubstr(want)) << type;
  }
}

// A second shard started on a port another one listens on fails, naming
// the address: gRPC's default SO_REUSEPORT had let it listen beside the
// first, and the kernel split the workers' connections between the two.
TEST_F(MultiProcessTest, PortInUseIsRefused) {
  LocalCluster cluster(1, 0);
  const std::string port = cluster.ps[0].substr(cluster.ps[0].rfind(':') + 1);
  const std::string log = dir_ + "/ps.log";
  const pid_t first = Start({PSFLOW_PS_SERVER_BIN, "--port=" + port}, "", log);
  ASSERT_GT(first, 0);
  ASSERT_TRUE(WaitForText(log, "listening on", first, std::chrono::seconds(20))) << ReadFile(log);
  const auto [code, out] = RunToEnd({PSFLOW_PS_SERVER_BIN, "--port=" + port});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("could not listen on 0.0.0.0:" + port));
  EXPECT_TRUE(IsRunning(first));
  ::kill(first, SIGTERM);
  EXPECT_EQ(Reap(first, std::chrono::seconds(20)), 0) << ReadFile(log);
}

// A hyper-parameter that the chosen optimizer or schedule does not read is
// named in a warning (it changed nothing, silently).
TEST_F(MultiProcessTest, FlagsTheChosenOptimizerDoesNotReadAreWarnedAbout) {
  const std::string text = StartedAndStoppedShardSays(
      {"--momentum=0.9", "--beta_1=0.8", "--decay_rate=0.5", "--learning_rate_schedule=cosine",
       "--decay_steps=9", "--power=2", "--warmup_steps=3"});
  EXPECT_THAT(text, ::testing::HasSubstr(
                        "--momentum is ignored: only --optimizer=sgd|rmsprop reads it, and it "
                        "is adam"));
  EXPECT_THAT(text, ::testing::HasSubstr("--decay_rate is ignored: only "
                                         "--learning_rate_schedule=exponential|inverse_time reads "
                                         "it, and it is cosine"));
  EXPECT_THAT(text, ::testing::HasSubstr("--power is ignored: only "
                                         "--learning_rate_schedule=polynomial reads it, and it "
                                         "is cosine"));
  EXPECT_THAT(text, ::testing::HasSubstr("--warmup_steps is ignored without --warmup_target"));
  EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("--beta_1 is ignored")));
}

// --optimizer=adamw is Adam with Keras AdamW's weight decay, and the shard's
// first line says what it applies; AMSGrad and the exclusions are warned
// about where nothing reads them.
TEST_F(MultiProcessTest, AdamWAndItsFlagsAreNamedOrWarnedAbout) {
  struct Run {
    std::vector<std::string> flags;
    std::vector<std::string> said;
  };
  const Run runs[] = {
      // Adam's flags are read by adamw: no warning.
      {{"--optimizer=adamw", "--amsgrad", "--beta_1=0.8", "--exclude_from_weight_decay=bias,norm"},
       {"optimizer adam(learning_rate=0.001, beta_1=0.8, beta_2=0.999, epsilon=1e-07, "
        "amsgrad=true, weight_decay=0.004, exclude_from_weight_decay=[\"bias\", \"norm\"])"}},
      {{"--optimizer=sgd", "--amsgrad", "--exclude_from_weight_decay=bias"},
       {"--amsgrad is ignored: only --optimizer=adam|adamw reads it, and it is sgd",
        "--exclude_from_weight_decay is ignored: there is no weight decay (--weight_decay is "
        "0; --optimizer=adamw has one)",
        "optimizer sgd("}},
  };
  for (const Run& run : runs) {
    SCOPED_TRACE(absl::StrJoin(run.flags, " "));
    const std::string text = StartedAndStoppedShardSays(run.flags);
    for (const std::string& said : run.said) EXPECT_THAT(text, ::testing::HasSubstr(said));
    if (run.said.size() == 1) {
      EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("ignored")));
    }
  }
  // A pattern that is no regular expression stops the shard, named.
  const auto [code, out] = RunToEnd({PSFLOW_PS_SERVER_BIN, "--port=0", "--weight_decay=0.1",
                                     "--exclude_from_weight_decay=dense/(kernel"});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("\"dense/(kernel\" is not a valid regular expression"));
  // A comma too many: an empty pattern would exclude every variable.
  const auto [empty_code, empty_out] = RunToEnd(
      {PSFLOW_PS_SERVER_BIN, "--port=0", "--optimizer=adamw", "--exclude_from_weight_decay=bias,"});
  EXPECT_EQ(empty_code, 1) << empty_out;
  EXPECT_THAT(empty_out, ::testing::HasSubstr("has an empty pattern"));
}

// Every optimizer and schedule flag reaches the shard's optimizer: its
// first line shows each value given (a flag dropped on the way would show
// its default).
TEST_F(MultiProcessTest, EveryOptimizerAndScheduleFlagReachesTheShard) {
  struct Run {
    std::vector<std::string> flags;
    std::string optimizer;     // as the first line shows it
    std::string warning = "";  // expected on stderr, if any
  };
  const Run runs[] = {
      {{"--optimizer=rmsprop", "--learning_rate=0.002", "--rho=0.8", "--momentum=0.5",
        "--epsilon=1e-05", "--centered"},
       "rmsprop(learning_rate=0.002, rho=0.8, momentum=0.5, epsilon=1e-05, centered=true)"},
      {{"--optimizer=lion"}, "lion(learning_rate=0.001, beta_1=0.9, beta_2=0.99)"},
      {{"--optimizer=lion", "--beta_1=0.5", "--beta_2=0.7", "--weight_decay=0.01"},
       "lion(learning_rate=0.001, beta_1=0.5, beta_2=0.7, weight_decay=0.01)"},
      {{"--optimizer=sgd", "--learning_rate=0.5", "--learning_rate_schedule=polynomial",
        "--decay_steps=50", "--end_learning_rate=1e-05", "--power=0.5", "--cycle"},
       "sgd(learning_rate=0.5, momentum=0, nesterov=false, schedule=polynomial(decay_steps=50, "
       "end_learning_rate=1e-05, power=0.5, cycle=true))"},
      {{"--learning_rate=0", "--learning_rate_schedule=cosine", "--decay_steps=100",
        "--cosine_alpha=0.1", "--warmup_steps=10", "--warmup_target=0.01"},
       "schedule=cosine(decay_steps=100, alpha=0.1, warmup_steps=10, warmup_target=0.01))"},
      {{"--learning_rate_schedule=inverse_time", "--decay_steps=7", "--decay_rate=0.25",
        "--staircase"},
       "schedule=inverse_time(decay_steps=7, decay_rate=0.25, staircase=true))"},
      // The rate given is not read, and says so; 0 is no error then.
      {{"--learning_rate=0", "--learning_rate_schedule=piecewise_constant",
        "--piecewise_boundaries=100,200", "--piecewise_values=0.1,0.01,0.001"},
       "schedule=piecewise_constant(boundaries=[100, 200], values=[0.1, 0.01, 0.001]))",
       "--learning_rate is ignored: --learning_rate_schedule=piecewise_constant takes its rates "
       "from --piecewise_values"},
      // Lists for another schedule are not read (nor refused).
      {{"--piecewise_values=abc"},
       "adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07)",
       "--piecewise_values is ignored: only --learning_rate_schedule=piecewise_constant reads "
       "it, and it is constant"},
  };
  for (const Run& run : runs) {
    SCOPED_TRACE(absl::StrJoin(run.flags, " "));
    const std::string text = StartedAndStoppedShardSays(run.flags);
    EXPECT_THAT(text, ::testing::HasSubstr(run.optimizer));
    if (run.warning.empty()) {
      EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("warning")));
    } else {
      EXPECT_THAT(text, ::testing::HasSubstr(run.warning));
    }
  }
}

// SIGTERM lets the calls in progress finish (5 s of grace); a second one
// ends the shard at once, as a second Ctrl-C is meant to (it was ignored).
TEST_F(MultiProcessTest, SecondSignalEndsTheShutdownAtOnce) {
  const std::string log = dir_ + "/ps.log";
  std::string address;
  const pid_t pid = StartLoopbackShard(log, &address);
  ASSERT_GT(pid, 0) << ReadFile(log);
  // A push whose stream stays open: the shutdown waits for it.
  auto stub =
      ParameterServer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext push_context;
  PushResponse response;
  auto push = stub->Push(&push_context, &response);
  bool serving = false;
  for (int i = 0; i < 2000 && !serving; ++i) {
    grpc::ClientContext context;
    StatusResponse status;
    serving =
        stub->GetStatus(&context, StatusRequest(), &status).ok() && status.calls_serving() == 1;
    if (!serving) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(serving) << "the push never reached the shard";
  ::kill(pid, SIGTERM);
  ASSERT_TRUE(WaitForText(log, "shutting down", pid, std::chrono::seconds(20))) << ReadFile(log);
  ::kill(pid, SIGTERM);
  EXPECT_EQ(Reap(pid, std::chrono::seconds(20)), 1) << ReadFile(log);
  EXPECT_THAT(ReadFile(log), ::testing::HasSubstr("received a second SIGTERM, exiting without "
                                                  "waiting"));
  push_context.TryCancel();
}

// A shard whose log reader went away (`ps_server | tee log`, with tee ended
// by the same Ctrl-C) still shuts down gracefully: its next line used to
// kill it with SIGPIPE (exit 141), with no grace for the calls in flight.
TEST_F(MultiProcessTest, ShardOutlivesItsLogReader) {
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    ::close(out[0]);
    ::close(out[1]);
    ::execl(PSFLOW_PS_SERVER_BIN, PSFLOW_PS_SERVER_BIN, "--address=127.0.0.1:0",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  Track(pid);  // stopped by TearDown if this test ends early
  ::close(out[1]);
  std::string seen;
  char buf[512];
  // Reads until the start line, for at most 60 s (a shard that never
  // printed it used to hold the test until ctest's timeout).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!absl::StrContains(seen, "listening on") && std::chrono::steady_clock::now() < give_up) {
    pollfd readable = {out[0], POLLIN, 0};
    if (::poll(&readable, 1, 1000) <= 0) continue;
    const ssize_t n = ::read(out[0], buf, sizeof(buf));
    if (n <= 0) break;
    seen.append(buf, n);
  }
  ::close(out[0]);  // the reader goes away
  ASSERT_THAT(seen, ::testing::HasSubstr("listening on"));
  ::kill(pid, SIGTERM);
  EXPECT_EQ(Reap(pid, std::chrono::seconds(20)), 0) << "141 is 128 + SIGPIPE";
}

// With no call in flight, a shard stops at once on SIGTERM, also right after
// a client went away: it took 9.5 s, gRPC's library shutdown joining a
// poller thread that waited out a timer set while the client was there.
TEST_F(MultiProcessTest, ShardStopsAtOnceAfterItsLastClientLeft) {
  const std::string log = dir_ + "/ps.log";
  std::string address;
  const pid_t pid = StartLoopbackShard(log, &address);
  ASSERT_GT(pid, 0) << ReadFile(log);
  const auto [code, out] = TrainTwoSteps(address);
  ASSERT_EQ(code, 0) << out;
  ::kill(pid, SIGTERM);
  // Well within the 5 s a call in flight would be given.
  EXPECT_EQ(Reap(pid, std::chrono::seconds(3)), 0) << ReadFile(log);
  EXPECT_THAT(ReadFile(log), ::testing::HasSubstr("stopped after 2 pushes"));
}

// A worker sending 1 MiB messages (its default) trains against a shard that
// takes 64 KiB: it asks the shard's limit before registering and sends no
// more (the registration was refused before).
TEST_F(MultiProcessTest, WorkerFitsItsMessagesToTheShardsLimit) {
  const std::string log = dir_ + "/ps.log";
  std::string address;
  const pid_t pid = StartLoopbackShard(log, &address, {"--max_chunk_bytes=65536"});
  ASSERT_GT(pid, 0) << ReadFile(log);
  const auto [code, out] = TrainTwoSteps(address);
  EXPECT_EQ(code, 0) << out;
  ::kill(pid, SIGTERM);
  EXPECT_EQ(Reap(pid, std::chrono::seconds(20)), 0) << ReadFile(log);
  EXPECT_THAT(ReadFile(log), ::testing::HasSubstr("stopped after 2 pushes (0 rejected"));
}

// A second shard given the unix socket of a running one fails, naming it:
// gRPC removed the socket file and listened anew, and the first shard went
// on running where nothing could reach it.
TEST_F(MultiProcessTest, UnixSocketInUseIsRefused) {
  const std::string address = "unix:" + dir_ + "/ps.sock";
  const std::string log = dir_ + "/ps.log";
  const pid_t first = Start({PSFLOW_PS_SERVER_BIN, "--address=" + address}, "", log);
  ASSERT_GT(first, 0);
  ASSERT_TRUE(WaitForText(log, "listening on", first, std::chrono::seconds(20))) << ReadFile(log);
  const auto [code, out] = RunToEnd({PSFLOW_PS_SERVER_BIN, "--address=" + address});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("could not listen on " + address +
                                        ": another process listens there"));
  EXPECT_TRUE(IsRunning(first));
  ::kill(first, SIGTERM);
  EXPECT_EQ(Reap(first, std::chrono::seconds(20)), 0) << ReadFile(log);
}

// --port wins over TF_CONFIG's address, as flags do, but the shard warns
// that the workers, which read TF_CONFIG, will dial the address it lists.
TEST_F(MultiProcessTest, PortFlagAwayFromTfConfigsAddressIsWarnedAbout) {
  LocalCluster cluster(1, 0);
  const std::string tf_config = cluster.TfConfig("ps", 0);
  for (bool away : {false, true}) {
    const std::string log = dir_ + (away ? "/away.log" : "/same.log");
    const std::string port = away ? "0" : cluster.ps[0].substr(cluster.ps[0].rfind(':') + 1);
    const pid_t pid = Start({PSFLOW_PS_SERVER_BIN, "--port=" + port}, tf_config, log);
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(WaitForText(log, "listening on", pid, std::chrono::seconds(20))) << ReadFile(log);
    ::kill(pid, SIGTERM);
    EXPECT_EQ(Reap(pid, std::chrono::seconds(20)), 0) << ReadFile(log);
    EXPECT_EQ(absl::StrContains(ReadFile(log), absl::StrCat("not where TF_CONFIG lists shard 0 (",
                                                            cluster.ps[0], ")")),
              away)
        << ReadFile(log);
  }
}

// The start line says when the shard applies NaN/Inf gradients, so that an
// operator sees it in the log.
TEST_F(MultiProcessTest, StartLineSaysWhatLimitsAndPoliciesAreSet) {
  struct Case {
    std::vector<std::string> flags;
    std::string ending;  // of the start line
  };
  const std::vector<Case> cases = {
      {{}, " MiB\n"},
      {{"--allow_non_finite_gradients"}, " MiB, NaN/Inf gradients applied\n"},
      {{"--threads=3"}, " MiB, at most 3 calls served at once\n"},
      {{"--threads=1"}, " MiB, at most 1 call served at once\n"},
      {{"--threads=3", "--allow_non_finite_gradients"},
       ", at most 3 calls served at once, NaN/Inf gradients applied\n"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string log = absl::StrCat(dir_, "/ps", i, ".log");
    std::vector<std::string> args = {PSFLOW_PS_SERVER_BIN, "--port=0"};
    args.insert(args.end(), cases[i].flags.begin(), cases[i].flags.end());
    const pid_t pid = Start(args, "", log);
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(WaitForText(log, "listening on", pid, std::chrono::seconds(20))) << ReadFile(log);
    ::kill(pid, SIGTERM);
    EXPECT_EQ(Reap(pid, std::chrono::seconds(20)), 0) << ReadFile(log);
    const std::string text = ReadFile(log);
    const size_t at = text.rfind('\n', text.find("listening on"));
    const size_t begin = at == std::string::npos ? 0 : at + 1;
    const std::string start_line = text.substr(begin, text.find('\n', begin) + 1 - begin);
    EXPECT_TRUE(absl::EndsWith(start_line, cases[i].ending))
        << absl::StrJoin(cases[i].flags, " ") << ": " << start_line;
  }
}

// A "unix:path" ps address is listened on as such (it used to become a
// random TCP port, since the port was cut from the address at ':').
TEST_F(MultiProcessTest, UnixPsAddressIsListenedOn) {
  const std::string socket_path = dir_ + "/ps0.sock";
  const std::string log = dir_ + "/ps.log";
  const pid_t pid = Start({PSFLOW_PS_SERVER_BIN, "--ps_hosts=unix:" + socket_path}, "", log);
  ASSERT_GT(pid, 0);
  struct stat st {};
  bool listening = false;
  for (int i = 0; i < 400 && !listening; ++i) {
    listening = ::stat(socket_path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
    if (!listening) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(pid, SIGTERM);
  EXPECT_EQ(Reap(pid, std::chrono::seconds(20)), 0) << ReadFile(log);
  EXPECT_TRUE(listening) << ReadFile(log);
  EXPECT_THAT(ReadFile(log), ::testing::HasSubstr("listening on unix:" + socket_path));
}

}  // namespace
