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
// against 3.2x its parameter bytes + 64 MiB. The raw transfer, the push and
// the pull take turns in batches (--batch), so that on a shared machine all
// three see the same conditions, and each is reported with the CPU time it
// cost the client and the shards. Where it was built with ZeroMQ it also
// times the peer, ps-lite, as its transport pushes (with a sum) and
// pulls the same bytes (zmq_push, zmq_pull).
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/flags_usage.h"
#include "common/float_buffer.h"
#include "common/process_stats.h"
#include "common/tensor_checks.h"
#include "ps_server/optimizer.h"
#include "worker/grpc_ps_client.h"

#ifdef PSFLOW_HAVE_ZMQ
#include <zmq.h>
#endif

ABSL_FLAG(std::string, ps_server, "", "Path of the ps_server binary (default: next to this one).");
ABSL_FLAG(int, iterations, 30, "Timed iterations per measurement.");
ABSL_FLAG(int, warmup, 5, "Untimed iterations first.");
ABSL_FLAG(int, batch, 5,
          "Iterations of one operation in a row; the raw transfer, push and pull take turns "
          "in batches of this size.");
ABSL_FLAG(int64_t, chunk_bytes, 1 << 20, "Client chunk size.");
ABSL_FLAG(std::string, transports, "tcp,unix", "Which transports to run.");
ABSL_FLAG(std::string, optimizer, "adam",
          "Optimizer of the ps_server processes and of raw_opt (adam|sgd|adagrad|rmsprop|lion, "
          "with their defaults).");
ABSL_FLAG(std::vector<std::string>, shards, std::vector<std::string>({"1", "2"}),
          "Shard counts to run, comma-separated.");
ABSL_FLAG(std::vector<std::string>, streams, std::vector<std::string>({"1"}),
          "Connections per shard a push is split over (the client's streams_per_shard), each "
          "value measured in turn, e.g. 1,2,4.");
ABSL_FLAG(int, clients, 1,
          "Workers pushing and pulling at once, each with its own client (as the workers of "
          "a job do); an operation is done when all of them are, and moves clients x the "
          "model.");
ABSL_FLAG(std::vector<std::string>, client_grpc_arg, {},
          "Extra gRPC channel arguments of the client, name=value[,name=value...].");
ABSL_FLAG(std::vector<std::string>, ps_flags, {},
          "Extra ps_server flags, comma-separated (e.g. --apply_threads=2).");
ABSL_FLAG(std::string, ops, "push,pull,pushpull",
          "Operations to time, comma-separated: push, pull, pushpull (both in one call); e.g. "
          "push alone while profiling the shards.");
ABSL_FLAG(std::string, netns, "",
          "Run the ps_server processes and the raw receiver in this network namespace (made "
          "with `ip netns add`), reached at --netns_ip over a veth link whose rate may be "
          "limited with tc: an emulated network between client and shards. tcp only.");
ABSL_FLAG(std::string, netns_ip, "", "The address of the namespace's end of the link.");
ABSL_FLAG(bool, small_vars, true, "Also measure the 200-small-variables case.");
ABSL_FLAG(bool, raw_opt, true,
          "Also time raw_opt: the raw transfer with the push's work done on the plain socket "
          "(the sender scans the gradient for NaN/Inf first; the receiver scans each chunk "
          "and applies --optimizer to it as soon as it has arrived), and raw_pipe: the same "
          "with the receiver only reading and a second thread scanning and applying, as a "
          "shard with applier threads does.");
ABSL_FLAG(bool, raw_conns, true,
          "When the push uses more than one connection (2 shards, or --streams above 1), also "
          "time raw_conns: the same bytes split evenly over as many plain sockets, sent by as "
          "many threads at once, so that the push and pull have a like-for-like reference.");
ABSL_FLAG(bool, zmq, true,
          "Also time zmq_push and zmq_pull: the issue's peer, ps-lite, as its ZeroMQ transport "
          "pushes (a sum on the servers) and pulls the same bytes, with as many servers as "
          "shards (only where this program was built with ZeroMQ, Debian's libzmq3-dev).");

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

// Wall times of one operation and the CPU time it cost, gathered over
// several batches.
// CPU seconds per thread name ("grpcpp_sync_ser", "ps_apply", ...), summed
// over the threads of one or more processes.
using ThreadCpu = std::map<std::string, double>;

struct OpStats {
  std::vector<double> times;  // seconds, one per timed iteration
  double self_cpu_s = 0;      // this process (client or raw sender + receiver)
  double server_cpu_s = 0;    // the ps_server processes
  ThreadCpu self_threads, server_threads;  // the same, by thread name
  double machine_busy_s = 0;  // every core's non-idle time (/proc/stat), summed
  double wall_s = 0;          // the batches' wall time, for machine_busy_s
};

struct Timing {
  double median_s = 0, mean_s = 0;
  double self_cpu_s = 0, server_cpu_s = 0;  // per iteration
  ThreadCpu self_threads, server_threads;   // per iteration
  double busy_cores = 0;  // the machine's busy cores while it ran (all processes)
};

Timing Summarize(const OpStats& s) {
  Timing out;
  if (s.times.empty()) return out;
  std::vector<double> t = s.times;
  std::sort(t.begin(), t.end());
  // Of an even count, the mean of the two middle times.
  out.median_s = t.size() % 2 == 1 ? t[t.size() / 2] : (t[t.size() / 2 - 1] + t[t.size() / 2]) / 2;
  out.mean_s = std::accumulate(t.begin(), t.end(), 0.0) / t.size();
  out.self_cpu_s = s.self_cpu_s / t.size();
  out.server_cpu_s = s.server_cpu_s / t.size();
  for (const auto& [name, cpu] : s.self_threads) out.self_threads[name] = cpu / t.size();
  for (const auto& [name, cpu] : s.server_threads) out.server_threads[name] = cpu / t.size();
  if (s.wall_s > 0) out.busy_cores = s.machine_busy_s / s.wall_s;
  return out;
}

// On-CPU seconds of every thread of `pids`, by thread name, from
// /proc/PID/task/TID/schedstat (nanoseconds); empty where the kernel has no
// schedstat.
ThreadCpu ThreadCpuByName(const std::vector<pid_t>& pids) {
  ThreadCpu out;
  for (pid_t pid : pids) {
    const std::string dir = absl::StrCat("/proc/", pid, "/task");
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) continue;
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream comm(absl::StrCat(dir, "/", e->d_name, "/comm"));
      std::ifstream stat(absl::StrCat(dir, "/", e->d_name, "/schedstat"));
      std::string name;
      double ns = 0;
      if (std::getline(comm, name) && (stat >> ns)) out[name] += ns * 1e-9;
    }
    ::closedir(d);
  }
  return out;
}

// after - before, added to `into`. What threads that ended in between used
// (gRPC's thread pools come and go, and so do the client's per-call
// threads) is `total` less the rest, under "(ended threads)".
void AddDelta(const ThreadCpu& before, const ThreadCpu& after, double total, ThreadCpu* into) {
  if (after.empty()) return;  // no schedstat here
  double live = 0;
  for (const auto& [name, cpu] : after) {
    auto it = before.find(name);
    const double delta = std::max(0.0, cpu - (it == before.end() ? 0.0 : it->second));
    (*into)[name] += delta;
    live += delta;
  }
  if (total > live) (*into)["(ended threads)"] += total - live;
}

// "name 1.23, name 0.45" in ms, largest first, those under 0.05 ms left out.
std::string FormatThreadCpu(const ThreadCpu& cpu) {
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [name, s] : cpu) {
    if (s * 1e3 >= 0.05) rows.emplace_back(s, name);
  }
  std::sort(rows.rbegin(), rows.rend());
  std::string out;
  for (const auto& [s, name] : rows) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", name, " ", absl::StrFormat("%.2f", s * 1e3));
  }
  return out.empty() ? "-" : out;
}

// Non-idle seconds of all the machine's cores together since boot, from
// /proc/stat (user, nice, system, irq, softirq, steal: everything but idle
// and iowait). Unlike the processes' CPU clocks it includes the interrupt
// and softirq time the kernel spends on loopback TCP, which, with IRQ time
// accounting, is charged to no process. Jiffy resolution (10 ms): summed
// over many batches it tells whether the cores were saturated. 0 if unknown.
double MachineBusySeconds() {
  std::ifstream stat("/proc/stat");
  std::string cpu;
  double v[8] = {};
  if (!(stat >> cpu) || cpu != "cpu") return 0;
  for (double& x : v) stat >> x;
  const double busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7];  // not idle (3), iowait (4)
  return busy / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// CPU seconds (user + system, all threads) that process `pid` has used,
// from its CPU-time clock (nanosecond resolution); 0 if unknown.
double CpuSeconds(pid_t pid) {
  clockid_t clock;
  timespec ts;
  if (clock_getcpuclockid(pid, &clock) != 0 || clock_gettime(clock, &ts) != 0) return 0;
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double CpuSeconds(const std::vector<pid_t>& pids) {
  double total = 0;
  for (pid_t p : pids) total += CpuSeconds(p);
  return total;
}

// Times `count` calls of fn into `stats`, with the CPU time they took here
// and in `servers`.
template <typename F>
void TimeBatch(int count, F fn, const std::vector<pid_t>& servers, OpStats* stats) {
  const ThreadCpu self_threads0 = ThreadCpuByName({getpid()});
  const ThreadCpu server_threads0 = ThreadCpuByName(servers);
  const double self0 = CpuSeconds(getpid()), server0 = CpuSeconds(servers);
  const double busy0 = MachineBusySeconds();
  const auto batch_start = Clock::now();
  for (int i = 0; i < count; ++i) {
    const auto start = Clock::now();
    fn();
    stats->times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  stats->wall_s += std::chrono::duration<double>(Clock::now() - batch_start).count();
  stats->machine_busy_s += MachineBusySeconds() - busy0;
  const double self_cpu = CpuSeconds(getpid()) - self0;
  const double server_cpu = CpuSeconds(servers) - server0;
  stats->self_cpu_s += self_cpu;
  stats->server_cpu_s += server_cpu;
  AddDelta(self_threads0, ThreadCpuByName({getpid()}), self_cpu, &stats->self_threads);
  AddDelta(server_threads0, ThreadCpuByName(servers), server_cpu, &stats->server_threads);
}

// The ps_server processes running now, so that an error exit or a signal
// does not leave them behind (posix_spawn cannot ask for a parent-death
// signal). Slots hold 0 when free; a signal handler may read them.
constexpr int kMaxChildren = 64;
std::atomic<pid_t> g_children[kMaxChildren];

void AddChild(pid_t pid) {
  for (auto& slot : g_children) {
    pid_t free = 0;
    if (slot.compare_exchange_strong(free, pid)) return;
  }
}
void RemoveChild(pid_t pid) {
  for (auto& slot : g_children) {
    pid_t p = pid;
    if (slot.compare_exchange_strong(p, 0)) return;
  }
}
void KillChildren() {  // async-signal-safe
  for (auto& slot : g_children) {
    const pid_t p = slot.load();
    if (p > 0) ::kill(p, SIGTERM);
  }
}
void OnSignal(int sig) {
  KillChildren();
  ::_exit(128 + sig);
}

void Die(const std::string& what) {
  std::fprintf(stderr, "push_pull_bench: %s\n", what.c_str());
  KillChildren();
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

// A socket created in network namespace `netns` (this one when empty). A
// socket keeps the namespace it was made in, so a short-lived thread enters
// the namespace (setns affects only the calling thread) and makes it there.
int SocketIn(const std::string& netns, int domain) {
  if (netns.empty()) return ::socket(domain, SOCK_STREAM, 0);
  int fd = -1;
  std::thread([&] {
    const int ns = ::open(absl::StrCat("/var/run/netns/", netns).c_str(), O_RDONLY);
    if (ns < 0 || ::setns(ns, CLONE_NEWNET) != 0) Die("cannot enter network namespace " + netns);
    ::close(ns);
    fd = ::socket(domain, SOCK_STREAM, 0);
  }).join();
  return fd;
}

// A connected socket pair over loopback (TCP with TCP_NODELAY, or a unix
// socket): Transfer() sends `bytes` one way into a reused buffer on a
// receiver thread and waits for its 1-byte acknowledgement.
//
// With an optimizer it also does a push's work, as a hand-written protocol
// with no RPC layer would: the sender scans the whole gradient for NaN/Inf
// before sending (as the client does), and the receiver, on the thread that
// reads the socket, scans each `chunk` bytes as soon as they have arrived
// and applies the optimizer to them (as the shard does per message). What
// is left between this and the push is what gRPC's structure costs.
//
// With `pipelined` (raw_pipe) the receiving thread only reads, and a second
// thread scans and applies each chunk once it has arrived, while the next
// bytes are read: the structure of a shard with applier threads, without
// gRPC.
class RawLink {
 public:
  RawLink(bool unix_socket, size_t bytes, const psflow::server::Optimizer* optimizer = nullptr,
          size_t chunk = 0, bool pipelined = false)
      : bytes_(bytes), data_(bytes), optimizer_(optimizer) {
    // The bytes of float 0.001, as the push sends (and no denormals for the
    // optimizer of raw_opt).
    const float grad = 0.001f;
    for (size_t i = 0; i < bytes_; ++i) data_[i] = reinterpret_cast<const char*>(&grad)[i % 4];
    sockaddr_storage addr{};
    socklen_t len;
    if (unix_socket) {
      listener_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
      static std::atomic<int> links{0};  // one socket file per link
      path_ = absl::StrCat("/tmp/psflow_bench_raw_", getpid(), "_", links++, ".sock");
      ::unlink(path_.c_str());
      auto* un = reinterpret_cast<sockaddr_un*>(&addr);
      un->sun_family = AF_UNIX;
      std::strncpy(un->sun_path, path_.c_str(), sizeof(un->sun_path) - 1);
      len = sizeof(sockaddr_un);
    } else {
      const std::string netns = absl::GetFlag(FLAGS_netns);
      listener_ = SocketIn(netns, AF_INET);
      auto* in = reinterpret_cast<sockaddr_in*>(&addr);
      in->sin_family = AF_INET;
      in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (!netns.empty() && ::inet_pton(AF_INET, absl::GetFlag(FLAGS_netns_ip).c_str(),
                                        &in->sin_addr) != 1) {
        Die("--netns_ip must be an IPv4 address");
      }
      in->sin_port = 0;
      len = sizeof(sockaddr_in);
    }
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&addr), len) != 0) Die("bind failed");
    ::listen(listener_, 1);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    // Whole float32 values per chunk, at least one.
    chunk = std::max<size_t>(4, chunk / 4 * 4);
    receiver_ = std::thread([this, chunk, pipelined] {
      int fd = ::accept(listener_, nullptr, nullptr);
      std::vector<char> buf(bytes_);  // reused, like the PS's buffers
      // The optimizer's state, as on a shard.
      const int64_t elements = static_cast<int64_t>(bytes_ / 4);
      psflow::FloatBuffer params, slots[2];  // at most 2: raw_opt never sets --amsgrad
      if (optimizer_ != nullptr) {
        params = psflow::FloatBuffer(elements, 0.01f);
        for (int i = 0; i < optimizer_->num_slots(); ++i) {
          slots[i] = psflow::FloatBuffer(elements, optimizer_->slot_initial_value(i));
        }
      }
      // Scans and applies bytes [from, to) of the buffer, chunk by chunk.
      auto apply = [&](size_t from, size_t to, int64_t step) {
        for (size_t done = from; done < to;) {
          const size_t n = std::min(chunk, to - done);
          const int64_t first = static_cast<int64_t>(done / 4), count = static_cast<int64_t>(n / 4);
          if (psflow::FirstNonFinite(buf.data() + done, count) >= 0) Die("raw_opt: NaN/Inf");
          float* at[2] = {};
          for (int i = 0; i < optimizer_->num_slots(); ++i) at[i] = slots[i].data() + first;
          optimizer_->Apply(step, params.data() + first, at, buf.data() + done, count);
          done += n;
        }
      };
      int64_t step = 0;
      if (pipelined && optimizer_ != nullptr) {
        // The reader publishes how far the bytes have arrived; the applier
        // takes every whole chunk up to there (and the rest at the end).
        absl::Mutex mu;
        size_t got_shared = 0, applied = 0;
        int64_t step_shared = 0;
        bool stop = false;
        const auto work_ready = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {  // mu held
          return stop || got_shared - applied >= chunk ||
                 (got_shared == bytes_ && applied < bytes_);
        };
        const auto all_applied = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return applied == bytes_; };
        std::thread applier([&] {
          while (true) {
            size_t from, ready;
            int64_t this_step;
            {
              absl::MutexLock lock(&mu);
              mu.Await(absl::Condition(&work_ready));
              if (stop) return;
              from = applied;
              ready = got_shared == bytes_ ? bytes_ : got_shared - (got_shared - from) % chunk;
              this_step = step_shared;
            }
            apply(from, ready, this_step);
            absl::MutexLock lock(&mu);
            applied = ready;
          }
        });
        while (true) {
          size_t got = 0;
          {
            absl::MutexLock lock(&mu);
            got_shared = applied = 0;
            step_shared = ++step;
          }
          while (got < bytes_) {
            const ssize_t r = ::recv(fd, buf.data() + got, bytes_ - got, 0);
            if (r <= 0) break;
            got += r;
            absl::MutexLock lock(&mu);
            got_shared = got;
          }
          if (got < bytes_) break;  // the sender closed: done
          {
            absl::MutexLock lock(&mu);
            mu.Await(absl::Condition(&all_applied));
          }
          char ack = 1;
          WriteAll(fd, &ack, 1);
        }
        {
          absl::MutexLock lock(&mu);
          stop = true;
        }
        applier.join();
        ::close(fd);
        return;
      }
      while (true) {
        size_t got = 0, done = 0;  // done: bytes scanned and applied
        ++step;
        while (got < bytes_) {
          const ssize_t r = ::recv(fd, buf.data() + got, bytes_ - got, 0);
          if (r <= 0) break;
          got += r;
          if (optimizer_ == nullptr) continue;
          // Every whole chunk that has arrived, and at the end the rest
          // (whole floats: chunk and done are multiples of 4).
          const size_t ready = got == bytes_ ? got / 4 * 4 : got - (got - done) % chunk;
          apply(done, ready, step);
          done = ready;
        }
        if (got < bytes_) break;  // the sender closed: done
        char ack = 1;
        WriteAll(fd, &ack, 1);
      }
      ::close(fd);
    });
    fd_ = ::socket(unix_socket ? AF_UNIX : AF_INET, SOCK_STREAM, 0);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) Die("connect failed");
    if (!unix_socket) {
      int one = 1;
      ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
  }
  ~RawLink() {
    ::close(fd_);
    receiver_.join();
    ::close(listener_);
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  void Transfer() {
    if (optimizer_ != nullptr && psflow::FirstNonFinite(data_.data(), bytes_ / 4) >= 0) {
      Die("raw_opt: NaN/Inf in the gradient");
    }
    WriteAll(fd_, data_.data(), bytes_);
    char ack;
    ReadAll(fd_, &ack, 1);
  }

 private:
  const size_t bytes_;
  std::vector<char> data_;  // float 0.001 over and over
  const psflow::server::Optimizer* const optimizer_;
  int listener_ = -1, fd_ = -1;
  std::string path_;
  std::thread receiver_;
};

// The same bytes split over `connections` plain sockets (raw_conns): each
// gets an even share (whole floats; the last one takes the rest), and
// Transfer() sends on all of them at once, one thread per connection, as
// the client sends to several shards or over several streams. It is the
// reference for a push that uses that many connections; a single stream
// (`raw`) is the issue's.
class RawLinks {
 public:
  RawLinks(bool unix_socket, size_t bytes, int connections) {
    const size_t share = bytes / 4 / connections * 4;
    for (int i = 0; i < connections; ++i) {
      const size_t mine = i + 1 < connections ? share : bytes - share * (connections - 1);
      links_.push_back(std::make_unique<RawLink>(unix_socket, mine));
    }
  }
  void Transfer() {
    std::vector<std::thread> threads;
    for (size_t i = 1; i < links_.size(); ++i) {
      threads.emplace_back([this, i] { links_[i]->Transfer(); });
    }
    links_[0]->Transfer();
    for (auto& t : threads) t.join();
  }

 private:
  std::vector<std::unique_ptr<RawLink>> links_;
};

#ifdef PSFLOW_HAVE_ZMQ
// The peer, dmlc/ps-lite, as its ZeroMQ transport moves a push and
// a pull to `servers` servers (zmq_push, zmq_pull): a reference measured in
// the same run, next to raw, and an upper bound on ps-lite's own speed.
// Each server has its own ZeroMQ context (one I/O thread, as dmlc's ZMQVan
// sets; with one connection only one would work anyway) and a thread that
// receives on a ROUTER socket; the worker has one context and a DEALER
// socket per server. The bytes are split evenly over the servers (whole
// floats): an ideal split, where ps-lite places each key whole on one
// server. As ps-lite's ZMQVan and KVWorker move them, to a server handle
// that sums one large key's values (as MXNet's kvstore server registers;
// ps-lite's own KVServerDefaultHandle keeps one float per key in a hash
// map, and would take 2.77M keys and map updates per push):
// - push: to every server a small header frame, then its share of the
//   gradient as one frame that ZeroMQ sends from the caller's memory
//   (zmq_msg_init_data, no copy); each server receives it whole into a
//   message ZeroMQ allocates, adds it to its store (a sum, no NaN/Inf
//   checks) and answers with a 1-byte frame; the push ends with the last
//   answer;
// - pull: each server copies its store into a freshly allocated response
//   buffer, which ZeroMQ sends and frees; the worker copies each received
//   frame into its own array.
// What it leaves out of ps-lite could only slow it: the meta-data's
// protobuf encoding and the keys' frames; the hops from ps-lite's
// receiving thread to its customer thread, on the server (the sum runs on
// the receiving thread) and on the worker (answers are read on the calling
// thread); the zeroing of a pull's response buffer (SArray::resize); and,
// in newer ps-lite, receiving threads that poll their sockets. It also
// shares this program's allocator tuning (large blocks reused, not mmapped
// afresh). Over unix sockets it uses ZeroMQ's ipc transport (ps-lite's
// DMLC_LOCAL).
class ZmqLink {
 public:
  ZmqLink(bool unix_socket, size_t bytes, int servers)
      : grad_(bytes / 4, 0.001f), values_(bytes / 4, 0.0f) {
    const size_t elements = bytes / 4, share = elements / servers;
    client_context_ = zmq_ctx_new();
    for (int i = 0; i < servers; ++i) {
      auto server = std::make_unique<Server>();
      server->offset = share * i;
      server->count = i + 1 < servers ? share : elements - share * (servers - 1);
      server->context = zmq_ctx_new();
      server->router = zmq_socket(server->context, ZMQ_ROUTER);
      static std::atomic<int> links{0};  // one socket file per server
      const std::string bind_to =
          unix_socket ? absl::StrCat("ipc:///tmp/psflow_bench_zmq_", getpid(), "_", links++)
                      : std::string("tcp://127.0.0.1:*");
      if (server->router == nullptr || zmq_bind(server->router, bind_to.c_str()) != 0) {
        Die(absl::StrCat("zmq: cannot bind ", bind_to, ": ", zmq_strerror(zmq_errno())));
      }
      char endpoint[512] = {};
      size_t size = sizeof(endpoint);
      zmq_getsockopt(server->router, ZMQ_LAST_ENDPOINT, endpoint, &size);
      server->endpoint = endpoint;
      // The socket moves to the server's thread; starting a thread is the
      // full memory barrier ZeroMQ asks for when a socket changes threads.
      server->thread = std::thread([s = server.get()] { Serve(s); });
      void* dealer = zmq_socket(client_context_, ZMQ_DEALER);
      if (dealer == nullptr || zmq_connect(dealer, server->endpoint.c_str()) != 0) {
        Die(absl::StrCat("zmq: cannot connect to ", server->endpoint, ": ",
                         zmq_strerror(zmq_errno())));
      }
      dealers_.push_back(dealer);
      servers_.push_back(std::move(server));
    }
  }
  ~ZmqLink() {
    const int linger = 0;  // nothing is pending; never wait at zmq_ctx_term
    for (size_t i = 0; i < servers_.size(); ++i) {
      Send(dealers_[i], "Q", 0);
      servers_[i]->thread.join();
      zmq_setsockopt(dealers_[i], ZMQ_LINGER, &linger, sizeof(linger));
      zmq_setsockopt(servers_[i]->router, ZMQ_LINGER, &linger, sizeof(linger));
      zmq_close(dealers_[i]);
      zmq_close(servers_[i]->router);
      zmq_ctx_term(servers_[i]->context);
      if (absl::StartsWith(servers_[i]->endpoint, "ipc://")) {
        ::unlink(servers_[i]->endpoint.c_str() + 6);
      }
    }
    zmq_ctx_term(client_context_);
  }

  void Push() {
    for (size_t i = 0; i < servers_.size(); ++i) {
      Send(dealers_[i], "P", ZMQ_SNDMORE);
      zmq_msg_t data;
      // No copy: ZeroMQ sends from grad_, which stays as it is.
      zmq_msg_init_data(&data, grad_.data() + servers_[i]->offset, servers_[i]->count * 4, nullptr,
                        nullptr);
      SendMsg(dealers_[i], &data, 0);
    }
    for (void* dealer : dealers_) {
      zmq_msg_t ack;
      zmq_msg_init(&ack);
      RecvMsg(dealer, &ack);
      zmq_msg_close(&ack);
    }
  }

  void Pull() {
    for (void* dealer : dealers_) Send(dealer, "L", 0);
    for (size_t i = 0; i < servers_.size(); ++i) {
      zmq_msg_t data;
      zmq_msg_init(&data);
      RecvMsg(dealers_[i], &data);
      if (zmq_msg_size(&data) != servers_[i]->count * 4) Die("zmq: a pull of the wrong size");
      std::memcpy(values_.data() + servers_[i]->offset, zmq_msg_data(&data), zmq_msg_size(&data));
      zmq_msg_close(&data);
    }
  }

 private:
  struct Server {
    size_t offset = 0, count = 0;  // its share, in floats
    void* context = nullptr;
    void* router = nullptr;
    std::string endpoint;
    std::thread thread;
  };

  // A one-byte frame.
  static void Send(void* socket, const char* byte, int flags) {
    zmq_msg_t msg;
    zmq_msg_init_size(&msg, 1);
    *static_cast<char*>(zmq_msg_data(&msg)) = *byte;
    SendMsg(socket, &msg, flags);
  }
  static void SendMsg(void* socket, zmq_msg_t* msg, int flags) {
    while (zmq_msg_send(msg, socket, flags) < 0) {
      if (zmq_errno() != EINTR) Die(absl::StrCat("zmq: send: ", zmq_strerror(zmq_errno())));
    }
  }
  static void RecvMsg(void* socket, zmq_msg_t* msg) {
    while (zmq_msg_recv(msg, socket, 0) < 0) {
      if (zmq_errno() != EINTR) Die(absl::StrCat("zmq: recv: ", zmq_strerror(zmq_errno())));
    }
  }

  // A server: [identity][op] or [identity]["P"][gradient] in, and the
  // answer out to the same identity.
  static void Serve(Server* server) {
    void* router = server->router;
    const size_t bytes = server->count * 4;
    std::vector<float> store(server->count, 0.01f);
    while (true) {
      zmq_msg_t identity, op;
      zmq_msg_init(&identity);
      zmq_msg_init(&op);
      RecvMsg(router, &identity);
      RecvMsg(router, &op);
      const char what = zmq_msg_size(&op) == 1 ? *static_cast<char*>(zmq_msg_data(&op)) : 0;
      zmq_msg_close(&op);
      if (what == 'Q') {
        zmq_msg_close(&identity);
        return;
      }
      if (what == 'P') {
        zmq_msg_t data;
        zmq_msg_init(&data);
        RecvMsg(router, &data);
        if (zmq_msg_size(&data) != bytes) Die("zmq: a push of the wrong size");
        const float* g = static_cast<const float*>(zmq_msg_data(&data));
        float* s = store.data();
        for (size_t i = 0, n = store.size(); i < n; ++i) s[i] += g[i];
        zmq_msg_close(&data);
        SendMsg(router, &identity, ZMQ_SNDMORE);
        Send(router, "A", 0);
      } else if (what == 'L') {
        void* copy = std::malloc(bytes);
        if (copy == nullptr) Die("zmq: out of memory");
        std::memcpy(copy, store.data(), bytes);
        zmq_msg_t data;
        zmq_msg_init_data(
            &data, copy, bytes, [](void* p, void*) { std::free(p); }, nullptr);
        SendMsg(router, &identity, ZMQ_SNDMORE);
        SendMsg(router, &data, 0);
      } else {
        Die("zmq: an unknown request");
      }
    }
  }

  std::vector<float> grad_, values_;
  void* client_context_ = nullptr;
  std::vector<void*> dealers_;  // one per server
  std::vector<std::unique_ptr<Server>> servers_;
};
#endif  // PSFLOW_HAVE_ZMQ

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
    for (pid_t p : pids) {
      ::waitpid(p, nullptr, 0);
      RemoveChild(p);
    }
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
      const std::string ip = absl::GetFlag(FLAGS_netns).empty() ? "127.0.0.1"
                                                                : absl::GetFlag(FLAGS_netns_ip);
      listen = absl::StrCat(ip, ":", port);
      dial = listen;
    }
    std::vector<std::string> args;
    if (!absl::GetFlag(FLAGS_netns).empty()) {  // ip netns exec execs: the pid stays the server's
      args = {"ip", "netns", "exec", absl::GetFlag(FLAGS_netns)};
    }
    args.push_back(binary);
    args.push_back(absl::StrCat("--address=", listen));
    args.push_back(absl::StrCat("--shard_index=", s));
    args.push_back(absl::StrCat("--num_shards=", shards));
    args.push_back(absl::StrCat("--optimizer=", absl::GetFlag(FLAGS_optimizer)));
    for (const std::string& f : absl::GetFlag(FLAGS_ps_flags)) args.push_back(f);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    if (posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ) != 0) {
      Die("cannot start " + binary);
    }
    posix_spawn_file_actions_destroy(&actions);
    AddChild(pid);
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
  Timing raw, raw_opt, raw_pipe, raw_conns, zmq_push, zmq_pull, push, pull, push_pull;
  std::vector<psflow::StatusResponse> status;
};

#ifndef PSFLOW_HAVE_ZMQ
class ZmqLink;  // built without ZeroMQ: never made
#endif

// The references timed in the same rounds as the push and pull; each one
// that is null is not timed.
struct References {
  RawLink* raw = nullptr;
  RawLink* raw_opt = nullptr;
  RawLink* raw_pipe = nullptr;
  RawLinks* raw_conns = nullptr;
  ZmqLink* zmq = nullptr;
};

// Starts `shards` ps_server processes, registers `vars`, and times the
// operations of --ops, and the references in `refs`. Each round runs a
// batch of every operation in turn, so all of them see the same state of
// this shared machine; their ratios are what the run reports.
Run RunModel(const std::string& binary, int shards, bool unix_socket,
             const std::vector<psflow::VariableSpec>& vars, References refs, int streams = 1) {
  const int warmup = absl::GetFlag(FLAGS_warmup), iterations = absl::GetFlag(FLAGS_iterations);
  const int batch = std::max(1, std::min(absl::GetFlag(FLAGS_batch), iterations));
  const std::string ops = absl::GetFlag(FLAGS_ops);
  const bool do_push = absl::StrContains(absl::StrCat(",", ops, ","), ",push,");
  const bool do_pull = absl::StrContains(absl::StrCat(",", ops, ","), ",pull,");
  const bool do_push_pull = ops.find("pushpull") != std::string::npos;
  if (!do_push && !do_push_pull) refs.raw_opt = refs.raw_pipe = nullptr;  // nothing to compare
  RawLink *raw = refs.raw, *raw_opt = refs.raw_opt, *raw_pipe = refs.raw_pipe;
  RawLinks* raw_conns = refs.raw_conns;
  // ps-lite's push and pull, each where psflow's is timed.
  std::function<void()> zmq_push, zmq_pull;
#ifdef PSFLOW_HAVE_ZMQ
  if (refs.zmq != nullptr && (do_push || do_push_pull)) zmq_push = [&] { refs.zmq->Push(); };
  if (refs.zmq != nullptr && do_pull) zmq_pull = [&] { refs.zmq->Pull(); };
#endif
  Cluster cluster;
  StartCluster(binary, shards, unix_socket, &cluster);
  psflow::worker::GrpcPsClientOptions options;
  options.ps_addresses = cluster.addresses;
  options.max_chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  options.streams_per_shard = streams;
  auto grpc_args =
      psflow::ParseNameValues("client_grpc_arg", absl::GetFlag(FLAGS_client_grpc_arg));
  if (!grpc_args.ok()) Die(std::string(grpc_args.status().message()));
  options.grpc_args = std::move(*grpc_args);
  // One client (and one set of buffers) per simulated worker.
  const int num_clients = std::max(1, absl::GetFlag(FLAGS_clients));
  struct Worker {
    std::unique_ptr<psflow::worker::PsClient> client;
    std::vector<std::vector<float>> values, grads;
    std::vector<float*> vp;
    std::vector<const float*> gp;
  };
  std::vector<Worker> workers(num_clients);
  for (int w = 0; w < num_clients; ++w) {
    options.worker_id = w;
    auto client = psflow::worker::CreateGrpcPsClient(vars, options);
    if (!client.ok()) Die(std::string(client.status().message()));
    Worker& k = workers[w];
    k.client = std::move(*client);
    for (const auto& v : vars) {
      k.values.emplace_back(v.num_elements(), 0.01f);
      k.grads.emplace_back(v.num_elements(), 0.001f);
    }
    for (auto& v : k.values) k.vp.push_back(v.data());
    for (auto& g : k.grads) k.gp.push_back(g.data());
  }
  auto& client = workers[0].client;
  std::vector<const float*> init(workers[0].vp.begin(), workers[0].vp.end());
  absl::Status st = client->Register(init).status();
  if (!st.ok()) Die(std::string(st.message()));
  // The others learn what the shards accept, as a worker does.
  for (int w = 1; w < num_clients; ++w) {
    st = workers[w].client->WaitForVariables(absl::Seconds(60));
    if (!st.ok()) Die(std::string(st.message()));
  }
  // Runs op(worker) on every worker at once; returns when all are done.
  auto all = [&](auto op) {
    std::vector<std::thread> threads;
    for (int w = 1; w < num_clients; ++w) threads.emplace_back([&, w] { op(workers[w]); });
    op(workers[0]);
    for (auto& t : threads) t.join();
  };
  std::atomic<int64_t> step{0};
  auto push = [&] {
    all([&](Worker& k) {
      absl::Status s = k.client->Push(k.gp, {++step, 0});
      if (!s.ok()) Die(std::string(s.message()));
    });
  };
  auto pull = [&] {
    all([&](Worker& k) {
      auto r = k.client->Pull(k.vp);
      if (!r.ok()) Die(std::string(r.status().message()));
    });
  };
  auto push_pull = [&] {
    all([&](Worker& k) {
      auto r = k.client->PushPull(k.gp, {++step, 0}, k.vp);
      if (!r.ok()) Die(std::string(r.status().message()));
    });
  };
  for (int i = 0; i < warmup; ++i) {
    if (raw != nullptr) raw->Transfer();
    if (raw_opt != nullptr) raw_opt->Transfer();
    if (raw_pipe != nullptr) raw_pipe->Transfer();
    if (raw_conns != nullptr) raw_conns->Transfer();
    if (zmq_push) zmq_push();
    if (zmq_pull) zmq_pull();
    if (do_push) push();
    if (do_pull) pull();
    if (do_push_pull) push_pull();
  }
  OpStats raw_stats, raw_opt_stats, raw_pipe_stats, raw_conns_stats, zmq_push_stats, zmq_pull_stats,
      push_stats, pull_stats, push_pull_stats;
  for (int done = 0; done < iterations; done += batch) {
    const int n = std::min(batch, iterations - done);
    if (raw != nullptr) TimeBatch(n, [&] { raw->Transfer(); }, {}, &raw_stats);
    if (raw_opt != nullptr) TimeBatch(n, [&] { raw_opt->Transfer(); }, {}, &raw_opt_stats);
    if (raw_pipe != nullptr)
      TimeBatch(
          n, [&] { raw_pipe->Transfer(); }, {}, &raw_pipe_stats);
    if (raw_conns != nullptr)
      TimeBatch(
          n, [&] { raw_conns->Transfer(); }, {}, &raw_conns_stats);
    if (zmq_push) TimeBatch(n, zmq_push, {}, &zmq_push_stats);
    if (zmq_pull) TimeBatch(n, zmq_pull, {}, &zmq_pull_stats);
    if (do_push) TimeBatch(n, push, cluster.pids, &push_stats);
    if (do_pull) TimeBatch(n, pull, cluster.pids, &pull_stats);
    if (do_push_pull) TimeBatch(n, push_pull, cluster.pids, &push_pull_stats);
  }
  Run run;
  run.raw = Summarize(raw_stats);
  run.raw_opt = Summarize(raw_opt_stats);
  run.raw_pipe = Summarize(raw_pipe_stats);
  run.raw_conns = Summarize(raw_conns_stats);
  run.zmq_push = Summarize(zmq_push_stats);
  run.zmq_pull = Summarize(zmq_pull_stats);
  run.push = Summarize(push_stats);
  run.pull = Summarize(pull_stats);
  run.push_pull = Summarize(push_pull_stats);
  auto status = client->GetStatus();
  if (status.ok()) run.status = *status;
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
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
  if (absl::GetFlag(FLAGS_clients) > 1) {
    std::printf("%d clients push and pull at once; GB/s and vs_raw count all of their bytes\n",
                absl::GetFlag(FLAGS_clients));
  }
  std::printf("model: seed CNN, %lld parameters (%.1f MB); %d iterations after %d warm-up; "
              "client chunk %lld bytes; optimizer on the PS: %s\n",
              static_cast<long long>(elements), bytes / 1e6, iterations, warmup,
              static_cast<long long>(absl::GetFlag(FLAGS_chunk_bytes)),
              absl::GetFlag(FLAGS_optimizer).c_str());
  // cpu_ms: CPU time per operation, user + system: the client (or, for
  // raw, the sender and receiver threads) and the ps_server processes.
  std::printf("%-6s %-7s %-9s %10s %10s %9s %8s %13s %13s\n", "xport", "shards", "op", "median_ms",
              "mean_ms", "GB/s", "vs_raw", "client_cpu_ms", "server_cpu_ms");
  const std::string transports = absl::GetFlag(FLAGS_transports);
  // The shards' optimizer, for raw_opt.
  psflow::server::OptimizerOptions optimizer_options;
  auto kind = psflow::server::ParseOptimizerKind(absl::GetFlag(FLAGS_optimizer));
  if (!kind.ok()) Die(std::string(kind.status().message()));
  optimizer_options.kind = *kind;
  optimizer_options.learning_rate = psflow::server::DefaultLearningRate(*kind);  // as ps_server
  optimizer_options.beta_2 = psflow::server::DefaultBeta2(*kind);
  auto optimizer = psflow::server::Optimizer::Create(optimizer_options);
  if (!optimizer.ok()) Die(std::string(optimizer.status().message()));
  auto print = [&](const char* xport, const std::string& shards, const char* op,
                   const Timing& t, const Timing& raw) {
    if (t.median_s == 0) return;  // not run (--ops)
    // The references (raw*, zmq_*) run in this process only.
    const bool raw_like = absl::StartsWith(op, "raw") || absl::StartsWith(op, "zmq");
    // With --clients=N an operation moves the model N times; a PushPull
    // moves it both ways.
    const double moved = raw_like ? bytes
                                  : bytes * std::max(1, absl::GetFlag(FLAGS_clients)) *
                                        (std::string_view(op) == "pushpull" ? 2 : 1);
    const double gbs = moved / t.median_s / 1e9, raw_gbs = bytes / raw.median_s / 1e9;
    std::printf("%-6s %-7s %-9s %10.2f %10.2f %9.2f %8.2f %13.2f %13s\n", xport, shards.c_str(), op,
                t.median_s * 1e3, t.mean_s * 1e3, gbs, gbs / raw_gbs, t.self_cpu_s * 1e3,
                raw_like ? "-" : absl::StrFormat("%.2f", t.server_cpu_s * 1e3).c_str());
    // How busy the whole machine was meanwhile (jiffies, so a coarse mean).
    // (Clamped: with short batches the 10 ms ticks can overshoot.)
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    std::printf("       %s: machine busy %.2f of %ld cores\n", op,
                std::min(t.busy_cores, static_cast<double>(cores)), cores);
    if (raw_like) return;
    // Where the CPU time went, by thread name (gRPC names its threads; ours
    // are ps_apply and ps_respond on the shard).
    std::printf("       %s CPU ms by thread: client %s; shards %s\n", op,
                FormatThreadCpu(t.self_threads).c_str(), FormatThreadCpu(t.server_threads).c_str());
    // With client and shards on this machine's cores, an operation takes at
    // least its CPU time over the cores (as a mean): the best vs_raw that
    // its CPU cost leaves, per byte moved, before any scheduling loss.
    // (Softirq time charged to other processes is not counted, and the
    // cores are all the machine's online ones, whatever the affinity, so
    // the true bound is lower still.)
    const double cpu_floor_s = (t.self_cpu_s + t.server_cpu_s) / static_cast<double>(cores);
    const double cpu_bound = cpu_floor_s > 0 ? (moved / bytes) * raw.median_s / cpu_floor_s : 0;
    std::printf("       %s: its CPU (%.2f ms) over %ld cores allows at best %.2f of raw\n", op,
                (t.self_cpu_s + t.server_cpu_s) * 1e3, cores, cpu_bound);
    std::printf(
        "JSON {\"transport\":\"%s\",\"shards\":\"%s\",\"op\":\"%s\",\"median_ms\":%.3f,"
        "\"mean_ms\":%.3f,\"gbps\":%.3f,\"raw_gbps\":%.3f,\"ratio\":%.3f,"
        "\"client_cpu_ms\":%.3f,\"server_cpu_ms\":%.3f,\"raw_cpu_ms\":%.3f,"
        "\"busy_cores\":%.2f,\"cpu_bound_ratio\":%.3f}\n",
        xport, shards.c_str(), op, t.median_s * 1e3, t.mean_s * 1e3, gbs, raw_gbs, gbs / raw_gbs,
        t.self_cpu_s * 1e3, t.server_cpu_s * 1e3, raw.self_cpu_s * 1e3, t.busy_cores, cpu_bound);
  };
  for (bool unix_socket : {false, true}) {
    const char* name = unix_socket ? "unix" : "tcp";
    if (transports.find(name) == std::string::npos) continue;
    if (unix_socket && !absl::GetFlag(FLAGS_netns).empty()) {
      std::printf("(unix sockets skipped: --netns measures a network link)\n");
      continue;
    }
    RawLink raw(unix_socket, static_cast<size_t>(bytes));
    std::unique_ptr<RawLink> raw_opt, raw_pipe;
    if (absl::GetFlag(FLAGS_raw_opt)) {
      const size_t chunk = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_bytes));
      raw_opt = std::make_unique<RawLink>(unix_socket, static_cast<size_t>(bytes), optimizer->get(),
                                          chunk);
      raw_pipe = std::make_unique<RawLink>(unix_socket, static_cast<size_t>(bytes),
                                           optimizer->get(), chunk, /*pipelined=*/true);
    }
    for (const std::string& shards_text : absl::GetFlag(FLAGS_shards)) {
      for (const std::string& streams_text : absl::GetFlag(FLAGS_streams)) {
        int shards = 0, streams = 0;
        if (!absl::SimpleAtoi(shards_text, &shards) || shards < 1) {
          Die("bad --shards " + shards_text);
        }
        if (!absl::SimpleAtoi(streams_text, &streams) || streams < 1) {
          Die("bad --streams " + streams_text);
        }
        // The shards column: "2" for 2 shards, "2x4" for 2 shards with pushes
        // split over 4 connections each.
        const std::string shard_flag =
            streams == 1 ? shards_text : absl::StrCat(shards, "x", streams);
        // As many plain connections as the push uses (each shard's streams).
        std::unique_ptr<RawLinks> raw_conns;
        if (absl::GetFlag(FLAGS_raw_conns) && shards * streams > 1) {
          raw_conns =
              std::make_unique<RawLinks>(unix_socket, static_cast<size_t>(bytes), shards * streams);
        }
        References refs{.raw = &raw,
                        .raw_opt = raw_opt.get(),
                        .raw_pipe = raw_pipe.get(),
                        .raw_conns = raw_conns.get()};
#ifdef PSFLOW_HAVE_ZMQ
        // The peer with as many servers as shards. (Not with --netns: it
        // would run on this namespace's loopback.)
        std::unique_ptr<ZmqLink> zmq;
        if (absl::GetFlag(FLAGS_zmq) && absl::GetFlag(FLAGS_netns).empty()) {
          zmq = std::make_unique<ZmqLink>(unix_socket, static_cast<size_t>(bytes), shards);
        }
        refs.zmq = zmq.get();
#endif
        Run run = RunModel(binary, shards, unix_socket, vars, refs, streams);
        print(name, shard_flag, "raw", run.raw, run.raw);
        print(name, shard_flag, "raw_opt", run.raw_opt, run.raw);
        print(name, shard_flag, "raw_pipe", run.raw_pipe, run.raw);
        print(name, shard_flag, "raw_conns", run.raw_conns, run.raw);
        print(name, shard_flag, "zmq_push", run.zmq_push, run.raw);
        print(name, shard_flag, "zmq_pull", run.zmq_pull, run.raw);
        for (const auto& [reference, timing] :
             {std::pair{"raw_opt", &run.raw_opt}, std::pair{"raw_pipe", &run.raw_pipe}}) {
          if (timing->median_s == 0 || run.push.median_s == 0) continue;
          // The push against the same work on a plain socket.
          // Per byte: with --clients=N a push moves the model N times.
          std::printf(
              "       push vs %s: %.2f\n", reference,
              std::max(1, absl::GetFlag(FLAGS_clients)) * timing->median_s / run.push.median_s);
        }
        print(name, shard_flag, "push", run.push, run.raw);
        print(name, shard_flag, "pull", run.pull, run.raw);
        print(name, shard_flag, "pushpull", run.push_pull, run.raw);
        // psflow against the peer, per byte (with --clients=N psflow moves
        // the model N times), on the same machine in the same rounds.
        for (const auto& [op, timing, peer] : {std::tuple{"push", &run.push, &run.zmq_push},
                                               std::tuple{"pull", &run.pull, &run.zmq_pull}}) {
          if (timing->median_s == 0 || peer->median_s == 0) continue;
          const double ratio =
              std::max(1, absl::GetFlag(FLAGS_clients)) * peer->median_s / timing->median_s;
          std::printf("       %s vs zmq_%s (ps-lite's transport, %d server%s): %.2f\n", op, op,
                      shards, shards == 1 ? "" : "s", ratio);
          std::printf(
              "JSON {\"transport\":\"%s\",\"shards\":\"%s\",\"op\":\"%s\","
              "\"zmq_ms\":%.3f,\"vs_zmq\":%.3f}\n",
              name, shard_flag.c_str(), op, peer->median_s * 1e3, ratio);
        }
        if (run.raw_conns.median_s > 0) {
          // Per byte, as above: the push and pull against as many plain
          // connections as they use.
          const int clients = std::max(1, absl::GetFlag(FLAGS_clients));
          for (const auto& [op, timing] :
               {std::pair{"push", &run.push}, std::pair{"pull", &run.pull}}) {
            if (timing->median_s == 0) continue;
            const double ratio = clients * run.raw_conns.median_s / timing->median_s;
            std::printf("       %s vs raw_conns (%d connections): %.2f\n", op, shards * streams,
                        ratio);
            std::printf(
                "JSON {\"transport\":\"%s\",\"shards\":\"%s\",\"op\":\"%s\","
                "\"connections\":%d,\"raw_conns_ms\":%.3f,\"vs_raw_conns\":%.3f}\n",
                name, shard_flag.c_str(), op, shards * streams, run.raw_conns.median_s * 1e3,
                ratio);
          }
        }
        if (run.push_pull.median_s > 0 && run.push.median_s > 0 && run.pull.median_s > 0) {
          // PushPull moves the bytes both ways: compare it with the two calls.
          const double apart = run.push.median_s + run.pull.median_s;
          std::printf("       pushpull %.2f ms vs push + pull %.2f ms: %.2fx\n",
                      run.push_pull.median_s * 1e3, apart * 1e3, apart / run.push_pull.median_s);
          std::printf("JSON {\"transport\":\"%s\",\"shards\":\"%s\",\"pushpull_ms\":%.3f,"
                      "\"push_plus_pull_ms\":%.3f,\"speedup\":%.3f}\n",
                      name, shard_flag.c_str(), run.push_pull.median_s * 1e3, apart * 1e3,
                      apart / run.push_pull.median_s);
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
  }

  if (!absl::GetFlag(FLAGS_small_vars)) return 0;
  // Small-variable overhead: 200 variables vs. the same bytes in one.
  std::vector<psflow::VariableSpec> many, one;
  const int64_t per = elements / 200;
  for (int i = 0; i < 200; ++i) many.push_back({absl::StrCat("v", i), {per}});
  one.push_back({"all", {per * 200}});
  std::printf("\nsmall variables (tcp, 2 shards): 200 x %lld floats vs 1 x %lld floats\n",
              static_cast<long long>(per), static_cast<long long>(per * 200));
  Run r_many = RunModel(binary, 2, false, many, {});
  Run r_one = RunModel(binary, 2, false, one, {});
  const double t_many = r_many.push.median_s + r_many.pull.median_s;
  const double t_one = r_one.push.median_s + r_one.pull.median_s;
  std::printf("  push+pull median: 200 vars %.2f ms, 1 var %.2f ms, ratio %.2f (target <= 2)\n",
              t_many * 1e3, t_one * 1e3, t_many / t_one);
  std::printf("JSON {\"small_vars_ms\":%.3f,\"one_var_ms\":%.3f,\"ratio\":%.3f}\n", t_many * 1e3,
              t_one * 1e3, t_many / t_one);
  return 0;
}
