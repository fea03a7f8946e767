// push_pull_bench: push and pull of a model through the PS client library
// against real ps_server processes on this host, next to the limit measured
// by the same program in the same run: a plain TCP (and unix-socket)
// transfer of the same bytes over loopback.
//
//   build/bench/push_pull_bench [--ps_server=build/ps_server/ps_server] [--iterations=30]
//
// Reports, per configuration, the median and mean time of a push (gradients
// in, Adam applied on the PS) and of a pull, their GB/s, and their ratio to
// the raw socket transfer; then the small-variable overhead (200 small
// variables vs. the same bytes in one) and each shard's resident memory
// against 3.2x its parameter bytes + 64 MiB.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/process_stats.h"
#include "worker/grpc_ps_client.h"

ABSL_FLAG(std::string, ps_server, "", "Path of the ps_server binary (default: next to this one).");
ABSL_FLAG(int, iterations, 30, "Timed iterations per measurement.");
ABSL_FLAG(int, warmup, 5, "Untimed iterations first.");
ABSL_FLAG(int64_t, chunk_bytes, 1 << 20, "Client chunk size.");
ABSL_FLAG(std::string, transports, "tcp,unix", "Which transports to run.");
ABSL_FLAG(std::string, optimizer, "adam", "Optimizer of the ps_server processes (adam|sgd|adagrad).");
ABSL_FLAG(std::vector<std::string>, shards, std::vector<std::string>({"1", "2"}),
          "Shard counts to run, comma-separated.");
ABSL_FLAG(std::vector<std::string>, ps_flags, {},
          "Extra ps_server flags, comma-separated (e.g. --apply_threads=2).");
ABSL_FLAG(bool, small_vars, true, "Also measure the 200-small-variables case.");

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

struct Timing {
  double median_s = 0, mean_s = 0, min_s = 0;
};

Timing Summarize(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  Timing out;
  out.median_s = t[t.size() / 2];
  out.mean_s = std::accumulate(t.begin(), t.end(), 0.0) / t.size();
  out.min_s = t.front();
  return out;
}

template <typename F>
Timing Measure(int warmup, int iterations, F fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  for (int i = 0; i < iterations; ++i) {
    const auto start = Clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  return Summarize(times);
}

void Die(const std::string& what) {
  std::fprintf(stderr, "push_pull_bench: %s\n", what.c_str());
  std::exit(1);
}

// ---- Raw socket limit: send `bytes` one way, wait for a 1-byte ack. ----

void WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, 0);
    if (w <= 0) Die("send failed");
    p += w;
    n -= w;
  }
}
void ReadAll(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) Die("recv failed");
    p += r;
    n -= r;
  }
}

Timing SocketLimit(bool unix_socket, size_t bytes, int warmup, int iterations) {
  int listener;
  sockaddr_storage addr{};
  socklen_t len;
  std::string path;
  if (unix_socket) {
    listener = ::socket(AF_UNIX, SOCK_STREAM, 0);
    path = absl::StrCat("/tmp/psflow_bench_raw_", getpid(), ".sock");
    ::unlink(path.c_str());
    auto* un = reinterpret_cast<sockaddr_un*>(&addr);
    un->sun_family = AF_UNIX;
    std::strncpy(un->sun_path, path.c_str(), sizeof(un->sun_path) - 1);
    len = sizeof(sockaddr_un);
  } else {
    listener = ::socket(AF_INET, SOCK_STREAM, 0);
    auto* in = reinterpret_cast<sockaddr_in*>(&addr);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    in->sin_port = 0;
    len = sizeof(sockaddr_in);
  }
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0) Die("bind failed");
  ::listen(listener, 1);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  const int total = warmup + iterations;
  std::thread receiver([&] {
    int fd = ::accept(listener, nullptr, nullptr);
    std::vector<char> buf(bytes);  // reused, like the PS's buffers
    for (int i = 0; i < total; ++i) {
      ReadAll(fd, buf.data(), bytes);
      char ack = 1;
      WriteAll(fd, &ack, 1);
    }
    ::close(fd);
  });
  int fd = ::socket(unix_socket ? AF_UNIX : AF_INET, SOCK_STREAM, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) Die("connect failed");
  if (!unix_socket) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  std::vector<char> data(bytes, 7);
  Timing t = Measure(warmup, iterations, [&] {
    WriteAll(fd, data.data(), bytes);
    char ack;
    ReadAll(fd, &ack, 1);
  });
  receiver.join();
  ::close(fd);
  ::close(listener);
  if (!path.empty()) ::unlink(path.c_str());
  return t;
}

// ---- ps_server processes ----

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

struct Cluster {
  std::vector<pid_t> pids;
  std::vector<std::string> addresses;
  ~Cluster() {
    for (pid_t p : pids) ::kill(p, SIGTERM);
    for (pid_t p : pids) ::waitpid(p, nullptr, 0);
  }
};

void StartCluster(const std::string& binary, int shards, bool unix_socket, Cluster* c) {
  for (int s = 0; s < shards; ++s) {
    std::string listen, dial;
    if (unix_socket) {
      listen = absl::StrCat("unix:/tmp/psflow_bench_", getpid(), "_", s, ".sock");
      dial = listen;
    } else {
      const int port = FreePort();
      listen = absl::StrCat("127.0.0.1:", port);
      dial = listen;
    }
    std::vector<std::string> args = {binary, absl::StrCat("--address=", listen),
                                     absl::StrCat("--shard_index=", s),
                                     absl::StrCat("--num_shards=", shards),
                                     absl::StrCat("--optimizer=", absl::GetFlag(FLAGS_optimizer))};
    for (const std::string& f : absl::GetFlag(FLAGS_ps_flags)) args.push_back(f);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    if (posix_spawn(&pid, binary.c_str(), &actions, nullptr, argv.data(), environ) != 0) {
      Die("cannot start " + binary);
    }
    posix_spawn_file_actions_destroy(&actions);
    c->pids.push_back(pid);
    c->addresses.push_back(dial);
  }
}

std::vector<psflow::VariableSpec> SeedModel() {
  return {{"conv2d/kernel", {3, 3, 1, 32}}, {"conv2d/bias", {32}},
          {"dense/kernel", {21632, 128}},   {"dense/bias", {128}},
          {"dense_1/kernel", {128, 10}},     {"dense_1/bias", {10}}};
}

int64_t TotalElements(const std::vector<psflow::VariableSpec>& vars) {
  int64_t n = 0;
  for (const auto& v : vars) n += v.num_elements();
  return n;
}

struct Run {
  Timing push, pull;
  std::vector<psflow::StatusResponse> status;
};

Run RunModel(const std::string& binary, int shards, bool unix_socket,
             const std::vector<psflow::VariableSpec>& vars, int warmup, int iterations) {
  Cluster cluster;
  StartCluster(binary, shards, unix_socket, &cluster);
  psflow::worker::GrpcPsClientOptions options;
  options.ps_addresses = cluster.addresses;
  options.max_chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  auto client = psflow::worker::CreateGrpcPsClient(vars, options);
  if (!client.ok()) Die(std::string(client.status().message()));
  std::vector<std::vector<float>> values, grads;
  std::vector<float*> vp;
  std::vector<const float*> gp;
  for (const auto& v : vars) {
    values.emplace_back(v.num_elements(), 0.01f);
    grads.emplace_back(v.num_elements(), 0.001f);
  }
  for (auto& v : values) vp.push_back(v.data());
  for (auto& g : grads) gp.push_back(g.data());
  std::vector<const float*> init(vp.begin(), vp.end());
  absl::Status st = (*client)->Register(init);
  if (!st.ok()) Die(std::string(st.message()));
  Run run;
  int64_t step = 0;
  run.push = Measure(warmup, iterations, [&] {
    absl::Status s = (*client)->Push(gp, {++step, 0});
    if (!s.ok()) Die(std::string(s.message()));
  });
  run.pull = Measure(warmup, iterations, [&] {
    auto r = (*client)->Pull(vp);
    if (!r.ok()) Die(std::string(r.status().message()));
  });
  auto status = (*client)->GetStatus();
  if (status.ok()) run.status = *status;
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  psflow::TuneAllocatorForLargeMessages();
  std::string binary = absl::GetFlag(FLAGS_ps_server);
  if (binary.empty()) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    self[n > 0 ? n : 0] = 0;
    std::string dir(self);
    dir = dir.substr(0, dir.rfind('/'));
    binary = dir + "/../ps_server/ps_server";
  }
  if (access(binary.c_str(), X_OK) != 0) Die("no ps_server at " + binary + " (--ps_server)");
  const int warmup = absl::GetFlag(FLAGS_warmup), iterations = absl::GetFlag(FLAGS_iterations);
  const auto vars = SeedModel();
  const int64_t elements = TotalElements(vars);
  const double bytes = elements * 4.0;
  std::printf("model: seed CNN, %lld parameters (%.1f MB); %d iterations after %d warm-up; "
              "client chunk %lld bytes; optimizer on the PS: %s\n",
              static_cast<long long>(elements), bytes / 1e6, iterations, warmup,
              static_cast<long long>(absl::GetFlag(FLAGS_chunk_bytes)),
              absl::GetFlag(FLAGS_optimizer).c_str());
  std::printf("%-6s %-7s %-5s %10s %10s %9s %8s\n", "xport", "shards", "op", "median_ms",
              "mean_ms", "GB/s", "vs_raw");
  const std::string transports = absl::GetFlag(FLAGS_transports);
  for (bool unix_socket : {false, true}) {
    const char* name = unix_socket ? "unix" : "tcp";
    if (transports.find(name) == std::string::npos) continue;
    const Timing raw = SocketLimit(unix_socket, static_cast<size_t>(bytes), warmup, iterations);
    const double raw_gbs = bytes / raw.median_s / 1e9;
    std::printf("%-6s %-7s %-5s %10.2f %10.2f %9.2f %8s\n", name, "-", "raw", raw.median_s * 1e3,
                raw.mean_s * 1e3, raw_gbs, "1.00");
    for (const std::string& shard_flag : absl::GetFlag(FLAGS_shards)) {
      int shards = 0;
      if (!absl::SimpleAtoi(shard_flag, &shards) || shards < 1) Die("bad --shards " + shard_flag);
      Run run = RunModel(binary, shards, unix_socket, vars, warmup, iterations);
      for (int op = 0; op < 2; ++op) {
        const Timing& t = op == 0 ? run.push : run.pull;
        const double gbs = bytes / t.median_s / 1e9;
        std::printf("%-6s %-7d %-5s %10.2f %10.2f %9.2f %8.2f\n", name, shards,
                    op == 0 ? "push" : "pull", t.median_s * 1e3, t.mean_s * 1e3, gbs,
                    gbs / raw_gbs);
        std::printf("JSON {\"transport\":\"%s\",\"shards\":%d,\"op\":\"%s\",\"median_ms\":%.3f,"
                    "\"mean_ms\":%.3f,\"gbps\":%.3f,\"raw_gbps\":%.3f,\"ratio\":%.3f}\n",
                    name, shards, op == 0 ? "push" : "pull", t.median_s * 1e3, t.mean_s * 1e3,
                    gbs, raw_gbs, gbs / raw_gbs);
      }
      for (const auto& s : run.status) {
        const double limit = 3.2 * s.parameter_bytes() + 64.0 * (1 << 20);
        std::printf("       memory: shard %d resident %.1f MB, parameters %.1f MB, bound "
                    "3.2x+64MiB = %.1f MB -> %s\n",
                    s.shard_index(), s.resident_bytes() / 1e6, s.parameter_bytes() / 1e6,
                    limit / 1e6, s.resident_bytes() <= limit ? "within" : "OVER");
      }
    }
  }

  if (!absl::GetFlag(FLAGS_small_vars)) return 0;
  // Small-variable overhead: 200 variables vs. the same bytes in one.
  std::vector<psflow::VariableSpec> many, one;
  const int64_t per = elements / 200;
  for (int i = 0; i < 200; ++i) many.push_back({absl::StrCat("v", i), {per}});
  one.push_back({"all", {per * 200}});
  std::printf("\nsmall variables (tcp, 2 shards): 200 x %lld floats vs 1 x %lld floats\n",
              static_cast<long long>(per), static_cast<long long>(per * 200));
  Run r_many = RunModel(binary, 2, false, many, warmup, iterations);
  Run r_one = RunModel(binary, 2, false, one, warmup, iterations);
  const double t_many = r_many.push.median_s + r_many.pull.median_s;
  const double t_one = r_one.push.median_s + r_one.pull.median_s;
  std::printf("  push+pull median: 200 vars %.2f ms, 1 var %.2f ms, ratio %.2f (target <= 2)\n",
              t_many * 1e3, t_one * 1e3, t_many / t_one);
  std::printf("JSON {\"small_vars_ms\":%.3f,\"one_var_ms\":%.3f,\"ratio\":%.3f}\n", t_many * 1e3,
              t_one * 1e3, t_many / t_one);
  return 0;
}
