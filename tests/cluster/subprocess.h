// Helpers of the tests that start the real ps_server and worker binaries
// (multiprocess_test, fault_test): free loopback ports, a cluster's
// TF_CONFIG, spawning with the output to a log, waiting with a bound.
#ifndef PSFLOW_TESTS_CLUSTER_SUBPROCESS_H_
#define PSFLOW_TESTS_CLUSTER_SUBPROCESS_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

extern char** environ;

namespace psflow::test_support {

// A loopback port that was free a moment ago.
inline int FreePort() {
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

// A fresh directory for one test's logs.
inline std::string TempDir() {
  char tmpl[] = "/tmp/psflow_mp_XXXXXX";
  return ::mkdtemp(tmpl);
}

// A cluster of `num_ps` shards and `num_workers` workers on free loopback
// ports, and the TF_CONFIG of each of its tasks.
struct LocalCluster {
  LocalCluster(int num_ps, int num_workers) {
    for (int i = 0; i < num_ps; ++i) ps.push_back(absl::StrCat("localhost:", FreePort()));
    for (int i = 0; i < num_workers; ++i) {
      workers.push_back(absl::StrCat("localhost:", FreePort()));
    }
  }
  std::string TfConfig(const char* type, int index) const {
    auto quoted = [](const std::vector<std::string>& v) {
      return absl::StrCat("[\"", absl::StrJoin(v, "\", \""), "\"]");
    };
    return absl::StrCat("{\"cluster\": {\"ps\": ", quoted(ps), ", \"worker\": ", quoted(workers),
                        "}, \"task\": {\"type\": \"", type, "\", \"index\": ", index,
                        "}, \"environment\": \"cloud\"}");
  }
  std::vector<std::string> ps, workers;
};

// Starts `argv` with TF_CONFIG set to `tf_config` and stdout and stderr
// written to `log`; returns its pid, or -1.
inline pid_t Spawn(const std::vector<std::string>& argv, const std::string& tf_config,
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
inline int WaitFor(pid_t pid, std::chrono::seconds timeout) {
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

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Waits up to `timeout` for `text` to appear in the file at `path`.
inline bool WaitForText(const std::string& path, const std::string& text,
                        std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (ReadFile(path).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// The number after "key": in a flat JSON object, or -1e300 without one.
inline double JsonNumber(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\": ";
  const size_t at = json.find(needle);
  if (at == std::string::npos) return -1e300;
  return std::strtod(json.c_str() + at + needle.size(), nullptr);
}

}  // namespace psflow::test_support

#endif  // PSFLOW_TESTS_CLUSTER_SUBPROCESS_H_
