// Helpers of the tests that start the real ps_server and worker binaries
// (multiprocess_test, fault_test): reserved loopback ports, a cluster's
// TF_CONFIG, a fixture that starts processes and always stops them, bounded
// waits, and a check that a process's log holds no sanitizer report.
#ifndef PSFLOW_TESTS_CLUSTER_SUBPROCESS_H_
#define PSFLOW_TESTS_CLUSTER_SUBPROCESS_H_

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace psflow::test_support {

// A TCP port held for this object's lifetime by a socket bound to it with
// SO_REUSEADDR and not listening. gRPC's servers set SO_REUSEADDR too, and
// Linux lets such a socket bind beside one that is not listening, so a
// ps_server can listen on the port. Other sockets cannot take it: the kernel
// hands out no port with a socket bound to it to one asking for a free
// port, so not another test's server before ours starts, nor one after ours
// was killed, while the workers still dial it; and ps_server does not set
// SO_REUSEPORT, so no second server listens beside ours.
class ReservedPort {
 public:
  ReservedPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    sockaddr_in in{};
    in.sin_family = AF_INET;
    in.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof(in);
    if (fd_ < 0 || ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
        ::bind(fd_, reinterpret_cast<sockaddr*>(&in), sizeof(in)) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&in), &len) != 0) {
      std::perror("psflow test: reserving a port");
      std::abort();
    }
    port_ = ntohs(in.sin_port);
  }
  ~ReservedPort() { ::close(fd_); }
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;

  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A cluster of `num_ps` shards and `num_workers` workers on reserved
// loopback ports, and the TF_CONFIG of each of its tasks.
class LocalCluster {
 public:
  LocalCluster(int num_ps, int num_workers) {
    for (int i = 0; i < num_ps + num_workers; ++i) {
      ports_.push_back(std::make_unique<ReservedPort>());
      (i < num_ps ? ps : workers).push_back(absl::StrCat("localhost:", ports_.back()->port()));
    }
  }
  std::string TfConfig(const char* type, int index) const {
    auto quoted = [](const std::vector<std::string>& v) {
      return v.empty() ? std::string("[]") : absl::StrCat("[\"", absl::StrJoin(v, "\", \""), "\"]");
    };
    return absl::StrCat("{\"cluster\": {\"ps\": ", quoted(ps), ", \"worker\": ", quoted(workers),
                        "}, \"task\": {\"type\": \"", type, "\", \"index\": ", index,
                        "}, \"environment\": \"cloud\"}");
  }

  std::vector<std::string> ps, workers;  // "localhost:PORT"

 private:
  std::vector<std::unique_ptr<ReservedPort>> ports_;
};

// Starts `argv` with TF_CONFIG set to `tf_config` (unset when empty) and
// stdout and stderr written to `log`; returns its pid, or -1.
inline pid_t Spawn(const std::vector<std::string>& argv, const std::string& tf_config,
                   const std::string& log) {
  std::vector<std::string> env_strings;
  if (!tf_config.empty()) env_strings.push_back("TF_CONFIG=" + tf_config);
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

// What WaitFor returns when the process did not end in time.
constexpr int kTimedOut = -1;

// Waits up to `timeout` for child `pid` and reaps it. Returns its exit code,
// 128 + the signal that ended it, or kTimedOut (after killing it).
inline int WaitFor(pid_t pid, std::chrono::seconds timeout) {
  if (pid <= 0) return kTimedOut;  // never wait for, or kill, "any child"
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() >= deadline) {
      ::kill(pid, SIGCONT);
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      return kTimedOut;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Whether child `pid` is still running (it is not reaped either way).
inline bool IsRunning(pid_t pid) {
  siginfo_t info{};
  return pid > 0 && ::waitid(P_PID, pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
         info.si_pid == 0;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Waits up to `timeout` for `text` to appear in the log at `path` of child
// `pid`; false if it did not, or the process ended first without it.
inline bool WaitForText(const std::string& path, const std::string& text, pid_t pid,
                        std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const bool running = IsRunning(pid);
    if (ReadFile(path).find(text) != std::string::npos) return true;
    if (!running || std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The number after "key": in a flat JSON object, or -1e300 without one.
inline double JsonNumber(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\": ";
  const size_t at = json.find(needle);
  if (at == std::string::npos) return -1e300;
  return std::strtod(json.c_str() + at + needle.size(), nullptr);
}

// Under AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer a
// finding ends the process with exit code 1, the code a binary also returns
// for a clear error; a test that expects that code must also look for the
// report itself.
inline ::testing::AssertionResult NoSanitizerReport(const std::string& log) {
  if (::testing::Matches(::testing::ContainsRegex("ERROR: [A-Za-z]+Sanitizer|runtime error:"))(
          log)) {
    return ::testing::AssertionFailure() << "a sanitizer reported in this log:\n" << log;
  }
  return ::testing::AssertionSuccess();
}

// A test that starts processes. Whatever happens, each is stopped (thawed
// first, in case the test froze it) and reaped when the test ends, and the
// test's directory of logs is removed if the test passed (kept, and named,
// if it failed).
class ProcessTest : public ::testing::Test {
 protected:
  ProcessTest() {
    char tmpl[] = "/tmp/psflow_mp_XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      std::perror("psflow test: mkdtemp");
      std::abort();
    }
    dir_ = tmpl;
  }

  void TearDown() override {
    for (pid_t p : pids_) {
      ::kill(p, SIGCONT);
      ::kill(p, SIGKILL);
      ::waitpid(p, nullptr, 0);
    }
    pids_.clear();
    if (HasFailure()) {
      std::fprintf(stderr, "logs kept in %s\n", dir_.c_str());
    } else {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
    }
  }

  // Starts `argv` (see Spawn) and remembers it; -1 (and a test failure) if
  // it could not be started.
  pid_t Start(const std::vector<std::string>& argv, const std::string& tf_config,
              const std::string& log) {
    const pid_t pid = Spawn(argv, tf_config, log);
    if (pid <= 0) {
      ADD_FAILURE() << "could not start " << argv[0];
      return -1;
    }
    pids_.push_back(pid);
    return pid;
  }

  // Remembers a process the test started itself (fork), so that TearDown
  // stops it if the test ends early.
  void Track(pid_t pid) { pids_.push_back(pid); }

  // WaitFor a process that Start (or Track) took, and forget it.
  int Reap(pid_t pid, std::chrono::seconds timeout) {
    const int code = WaitFor(pid, timeout);
    std::erase(pids_, pid);
    return code;
  }

  std::string dir_;

 private:
  std::vector<pid_t> pids_;  // started and not reaped yet
};

}  // namespace psflow::test_support

#endif  // PSFLOW_TESTS_CLUSTER_SUBPROCESS_H_
