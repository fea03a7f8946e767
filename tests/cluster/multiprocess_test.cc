// Multi-process test of the real binaries: 2 ps_server + 2 worker processes
// configured only through TF_CONFIG (as Kubeflow's TFJob does), training the
// seed model on Debian's Fashion-MNIST for a few hundred steps.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace {

int FreePort() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&in), sizeof(in));
  socklen_t len = sizeof(in);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&in), &len);
  const int port = ntohs(in.sin_port);
  ::close(s);
  return port;
}

// Starts `argv` with TF_CONFIG set and stdout/stderr to `log`.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& tf_config,
            const std::string& log) {
  std::vector<std::string> env_strings = {"TF_CONFIG=" + tf_config};
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string(*e).rfind("TF_CONFIG=", 0) != 0) env_strings.push_back(*e);
  }
  std::vector<char*> envp, args;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& a : argv_copy) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

// Waits up to `timeout` for `pid`; returns its exit code, or -1 (and kills
// it) on timeout or abnormal end.
int WaitFor(pid_t pid, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return -1;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

double JsonNumber(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\": ";
  const size_t at = json.find(needle);
  if (at == std::string::npos) return -1e300;
  return std::strtod(json.c_str() + at + needle.size(), nullptr);
}

TEST(MultiProcessTest, TwoPsTwoWorkersThroughTfConfig) {
  struct stat st;
  ASSERT_EQ(::stat("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", &st), 0)
      << "Fashion-MNIST is missing: install Debian's dataset-fashion-mnist (deploy/setup.sh)";
  char tmpl[] = "/tmp/psflow_mp_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);

  std::vector<std::string> ps, workers;
  for (int i = 0; i < 2; ++i) ps.push_back(absl::StrCat("\"localhost:", FreePort(), "\""));
  for (int i = 0; i < 2; ++i) workers.push_back(absl::StrCat("\"localhost:", FreePort(), "\""));
  const std::string cluster = absl::StrCat("{\"ps\": [", absl::StrJoin(ps, ", "),
                                           "], \"worker\": [", absl::StrJoin(workers, ", "), "]}");
  auto tf_config = [&](const char* type, int index) {
    return absl::StrCat("{\"cluster\": ", cluster, ", \"task\": {\"type\": \"", type,
                        "\", \"index\": ", index, "}, \"environment\": \"cloud\"}");
  };

  std::vector<pid_t> ps_pids;
  for (int i = 0; i < 2; ++i) {
    ps_pids.push_back(Spawn({PSFLOW_PS_SERVER_BIN}, tf_config("ps", i),
                            absl::StrCat(dir, "/ps-", i, ".log")));
    ASSERT_GT(ps_pids.back(), 0);
  }
  std::vector<pid_t> worker_pids;
  for (int i = 0; i < 2; ++i) {
    worker_pids.push_back(Spawn({PSFLOW_WORKER_BIN, "--train_steps=150", "--epochs=1",
                                 "--threads=1", "--device=cpu",
                                 absl::StrCat("--summary_json=", dir, "/worker-", i, ".json")},
                                tf_config("worker", i), absl::StrCat(dir, "/worker-", i, ".log")));
    ASSERT_GT(worker_pids.back(), 0);
  }
  std::vector<int> codes;
  for (pid_t p : worker_pids) codes.push_back(WaitFor(p, std::chrono::seconds(240)));
  for (pid_t p : ps_pids) ::kill(p, SIGTERM);
  std::vector<int> ps_codes;
  for (pid_t p : ps_pids) ps_codes.push_back(WaitFor(p, std::chrono::seconds(20)));

  for (int i = 0; i < 2; ++i) {
    const std::string log = ReadFile(absl::StrCat(dir, "/worker-", i, ".log"));
    EXPECT_EQ(codes[i], 0) << "worker " << i << " log:\n" << log;
    const std::string json = ReadFile(absl::StrCat(dir, "/worker-", i, ".json"));
    ASSERT_FALSE(json.empty()) << "worker " << i << " wrote no summary; log:\n" << log;
    for (const char* key : {"test_accuracy", "test_loss", "steps", "examples_per_sec",
                            "wall_seconds", "compute_s", "push_s", "pull_s", "push_pull_s",
                            "resident_bytes"}) {
      EXPECT_GT(JsonNumber(json, key), -1e299) << key << " missing in " << json;
    }
    EXPECT_EQ(JsonNumber(json, "steps"), 150);
    // 150 steps of Adam on the seed model are far above chance (0.1).
    EXPECT_GT(JsonNumber(json, "test_accuracy"), 0.6) << json;
  }
  EXPECT_THAT(ReadFile(dir + "/worker-0.log"), ::testing::HasSubstr("(chief)"));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(ps_codes[i], 0) << ReadFile(absl::StrCat(dir, "/ps-", i, ".log"));
    EXPECT_THAT(ReadFile(absl::StrCat(dir, "/ps-", i, ".log")),
                ::testing::HasSubstr(absl::StrCat("shard ", i, " of 2")));
  }
}

// A malformed TF_CONFIG is refused with a message naming the key; nothing runs.
TEST(MultiProcessTest, MalformedTfConfigIsAClearError) {
  char tmpl[] = "/tmp/psflow_mp_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string log = dir + "/ps.log";
  pid_t pid = Spawn({PSFLOW_PS_SERVER_BIN},
                    "{\"cluster\": {\"ps\": [\"localhost:1\"]}, \"task\": {\"type\": \"ps\", "
                    "\"index\": 4}}",
                    log);
  ASSERT_GT(pid, 0);
  EXPECT_EQ(WaitFor(pid, std::chrono::seconds(20)), 1);
  EXPECT_THAT(ReadFile(log), ::testing::HasSubstr("task.index"));
}

TEST(MultiProcessTest, MalformedGrpcArgIsAClearError) {
  char tmpl[] = "/tmp/psflow_mp_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string log = dir + "/ps.log";
  pid_t pid = Spawn({PSFLOW_PS_SERVER_BIN, "--port=0", "--grpc_arg=grpc.http2.lookahead_bytes"},
                    "", log);
  ASSERT_GT(pid, 0);
  EXPECT_EQ(WaitFor(pid, std::chrono::seconds(20)), 1);
  EXPECT_THAT(ReadFile(log),
              ::testing::HasSubstr("'grpc.http2.lookahead_bytes' is not name=value"));
}

// Runs `argv` (with `tf_config`, none by default) and returns its exit code
// and output.
std::pair<int, std::string> RunToEnd(const std::vector<std::string>& argv,
                                     const std::string& tf_config = "") {
  char tmpl[] = "/tmp/psflow_mp_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string log = dir + "/out.log";
  const pid_t pid = Spawn(argv, tf_config, log);
  if (pid <= 0) return {-2, "spawn failed"};
  const int code = WaitFor(pid, std::chrono::seconds(20));
  return {code, ReadFile(log)};
}

// Flags that contradict each other or make no sense are refused, naming the
// flags; before, negative values were ignored, --num_shards could disagree
// with --ps_hosts, and errors named the worker's --task_type/--task_index.
TEST(MultiProcessTest, ContradictoryPsServerFlagsAreRefused) {
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
      {{ps, "--port=0", "--address=127.0.0.1:0"}, "--port and --address were both given"},
  };
  for (const auto& [argv, want] : cases) {
    const auto [code, out] = RunToEnd(argv);
    EXPECT_EQ(code, 1) << absl::StrJoin(argv, " ") << "\n" << out;
    EXPECT_THAT(out, ::testing::HasSubstr(want)) << absl::StrJoin(argv, " ");
    EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("--task_"))) << absl::StrJoin(argv, " ");
  }
  // TF_CONFIG says this is a worker: --shard_index must not turn it into a
  // shard on the worker's host.
  const auto [code, out] = RunToEnd(
      {ps, "--shard_index=0"},
      R"({"cluster":{"ps":["127.0.0.1:1"],"worker":["127.0.0.1:2"]},"task":{"type":"worker"}})");
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("--shard_index=0 but TF_CONFIG's task is \"worker\""));

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
       "parameters, which need about"},
      {{worker, hosts[0], hosts[1], "--summary_json=/nonexistent/dir/x.json"},
       "--summary_json=/nonexistent/dir/x.json cannot be written"},
  };
  for (const auto& [argv, want] : worker_cases) {
    const auto [code, out] = RunToEnd(argv);
    EXPECT_EQ(code, 1) << absl::StrJoin(argv, " ") << "\n" << out;
    EXPECT_THAT(out, ::testing::HasSubstr(want)) << absl::StrJoin(argv, " ");
  }
}

// A "unix:path" ps address is listened on as such (it used to become a
// random TCP port, since the port was cut from the address at ':').
TEST(MultiProcessTest, UnixPsAddressIsListenedOn) {
  char tmpl[] = "/tmp/psflow_mp_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string socket_path = dir + "/ps0.sock";
  const std::string log = dir + "/ps.log";
  const pid_t pid = Spawn({PSFLOW_PS_SERVER_BIN, "--ps_hosts=unix:" + socket_path}, "", log);
  ASSERT_GT(pid, 0);
  struct stat st {};
  bool listening = false;
  for (int i = 0; i < 400 && !listening; ++i) {
    listening = ::stat(socket_path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
    if (!listening) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(pid, SIGTERM);
  EXPECT_EQ(WaitFor(pid, std::chrono::seconds(20)), 0) << ReadFile(log);
  EXPECT_TRUE(listening) << ReadFile(log);
  EXPECT_THAT(ReadFile(log), ::testing::HasSubstr("listening on unix:" + socket_path));
}

}  // namespace
