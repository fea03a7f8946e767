#include "ps_server/grpc_ps_server.h"

#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <iterator>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_args.h"
#include "common/grpc_log.h"
#include "common/grpc_status.h"
#include "common/grpc_wire.h"
#include "common/process_stats.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/codegen/method_handler.h"
#include "grpcpp/impl/codegen/rpc_service_method.h"
#include "psflow.grpc.pb.h"

namespace psflow::server {
namespace {

constexpr int64_t kDefaultPullChunkBytes = 1 << 20;
// A pulled piece of at least this many bytes is sent from the parameters
// themselves (VariableStore::Pin) instead of a copy: below it the copy
// costs less than a slice of its own.
constexpr int64_t kPinnedPieceBytes = 64 << 10;
// The most part definitions (in wire bytes) one registration's header may
// hold over all its messages: about a million parts.
constexpr int64_t kMaxRegisterHeaderBytes = 64 << 20;
// GetStatus lists at most this many bytes of parts (and the next page's
// token) in one answer, so that the answer stays under gRPC's default 4 MiB
// receive limit (names are at most VariableStore::kMaxVariableNameBytes).
constexpr size_t kStatusPageBytes = 3 << 20;

absl::Status SegmentSize(const Segment& segment, int64_t* count) {
  if (segment.data().size() % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment of '", segment.variable(), "' has ", segment.data().size(),
        " bytes of data; expected a multiple of 4 (float32 values)"));
  }
  *count = static_cast<int64_t>(segment.data().size() / 4);
  return absl::OkStatus();
}

PartDefinition FromProto(const PartDef& def) {
  PartDefinition out;
  out.variable = def.variable();
  out.variable_shape.assign(def.variable_shape().begin(), def.variable_shape().end());
  out.row_begin = def.row_begin();
  out.row_end = def.row_end();
  return out;
}

void ToProto(const PartDefinition& def, PartDef* out) {
  out->set_variable(def.variable);
  for (int64_t d : def.variable_shape) out->add_variable_shape(d);
  out->set_row_begin(def.row_begin);
  out->set_row_end(def.row_end);
}

// gRPC removes the file at a unix socket's path before it listens there,
// so a shard given the path of a running one took it over, and the first
// went on running where no one could reach it. UNAVAILABLE when something
// accepts connections at `address` ("unix:path"); a socket file that
// nothing listens on (left by a process that died) is fine.
absl::Status CheckUnixSocketFree(const std::string& address, int shard_index) {
  const std::string path = address.substr(5);
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return absl::OkStatus();  // gRPC says why
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  // Without blocking: a listener whose queue is full (a process that hangs
  // and accepts nothing) made a blocking connect wait for ever, with the
  // shutdown signals already blocked. Full (EAGAIN) means someone listens.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::OkStatus();
  const bool live =
      ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0 || errno == EAGAIN;
  ::close(fd);
  if (!live) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("ps shard ", shard_index, " could not listen on ",
                                             address, ": another process listens there"));
}

// Why gRPC could not listen on `address` (it says so only in its own log):
// the same bind, done here, with its errno and what that usually means.
// "" when the bind works now.
std::string ListenFailureReason(const std::string& address) {
  if (absl::StartsWith(address, "unix-abstract:")) return "";  // gRPC's log says why
  auto with_hint = [](int error, absl::string_view hint) {
    return absl::StrCat(std::strerror(error), hint.empty() ? "" : " (", hint,
                        hint.empty() ? "" : ")");
  };
  if (absl::StartsWith(address, "unix:")) {
    const std::string path = address.substr(5);
    sockaddr_un addr{};
    if (path.size() >= sizeof(addr.sun_path)) {
      return absl::StrCat("the path is ", path.size(),
                          " bytes; a unix socket's path takes at most ", sizeof(addr.sun_path) - 1);
    }
    const std::string dir = path.find('/') == std::string::npos
                                ? "."
                                : path.substr(0, std::max<size_t>(path.rfind('/'), 1));
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      return with_hint(errno, absl::StrCat("the socket's directory ", dir, " must exist"));
    }
    if (!S_ISDIR(st.st_mode)) return with_hint(ENOTDIR, absl::StrCat(dir, " is not a directory"));
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      return with_hint(errno, absl::StrCat("the shard must be able to create files in ", dir));
    }
    if (::lstat(path.c_str(), &st) == 0 && !S_ISSOCK(st.st_mode)) {
      return absl::StrCat(path, " exists and is not a socket (the shard replaces only a socket)");
    }
    return "";
  }
  // host:port or [ipv6]:port, as gRPC reads it.
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return "expected host:port, [ipv6]:port or unix:path";
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int e =
          ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
      e != 0) {
    return absl::StrCat("cannot resolve ", host.empty() ? address : host, ": ", ::gai_strerror(e));
  }
  // gRPC fails only where every address fails; a port in use, the likely
  // cause, is named before any other address's error.
  int first_error = 0;
  bool in_use = false;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC does
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
      if (errno == EADDRINUSE) in_use = true;
      if (first_error == 0) first_error = errno;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  const int error = in_use ? EADDRINUSE : first_error;
  if (error == 0) return "";
  return with_hint(error, error == EADDRINUSE      ? "another process listens on that port"
                          : error == EADDRNOTAVAIL ? "not an address of this machine"
                          : error == EACCES        ? "ports below 1024 need privileges"
                                                   : "");
}

}  // namespace

// Buffers for pull responses, reused across calls so the
// hot path touches no fresh memory. A buffer handed to gRPC as a slice comes
// back through the slice's destroy callback, from whatever thread drops the
// last reference; each buffer keeps the pool alive until then.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  struct Buffer {
    std::unique_ptr<char[]> data;
    size_t capacity = 0;
    std::shared_ptr<BufferPool> pool;
  };

  // A buffer of at least `bytes`.
  Buffer* Get(size_t bytes) {
    std::unique_ptr<Buffer> found;
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i]->capacity >= bytes) {
          found = std::move(free_[i]);
          free_[i] = std::move(free_.back());
          free_.pop_back();
          break;
        }
      }
    }
    if (found == nullptr) {
      found = std::make_unique<Buffer>();
      found->capacity = bytes;
      found->data.reset(new char[bytes]);
    }
    found->pool = shared_from_this();
    return found.release();
  }

  // Takes a buffer back (also the destroy callback of a slice over it).
  static void Return(void* b) {
    std::unique_ptr<Buffer> buffer(static_cast<Buffer*>(b));
    std::shared_ptr<BufferPool> pool = std::move(buffer->pool);
    absl::MutexLock lock(&pool->mu_);
    if (pool->free_.size() < kMaxFree) {
      pool->free_.push_back(std::move(buffer));
    } else {
      // Keep the larger ones: replace the smallest if this one is bigger.
      auto smallest = std::min_element(
          pool->free_.begin(), pool->free_.end(),
          [](const auto& a, const auto& b) { return a->capacity < b->capacity; });
      if ((*smallest)->capacity < buffer->capacity) *smallest = std::move(buffer);
    }
  }

 private:
  static constexpr size_t kMaxFree = 6;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Buffer>> free_ ABSL_GUARDED_BY(mu_);
};

// Threads that apply push messages while the handler threads read the next
// ones from gRPC. Run() queues a task and returns a ticket to wait on; a
// push has up to its window of messages in flight (see DoPush).
class ApplierPool {
 public:
  class Ticket {
   public:
    absl::Status Wait() {
      state_->done.WaitForNotification();
      return std::move(state_->status);
    }

   private:
    friend class ApplierPool;
    struct State {
      absl::Notification done;
      absl::Status status;
    };
    std::shared_ptr<State> state_ = std::make_shared<State>();
  };

  // Starts up to `threads` threads: fewer where no more can be started (a
  // pid or memory limit), which it says on stderr; see size().
  explicit ApplierPool(int threads) {
    for (int i = 0; i < threads; ++i) {
      try {
        threads_.emplace_back([this] {
          pthread_setname_np(pthread_self(), "ps_apply");  // for profiles and the benchmark
          Loop();
        });
      } catch (const std::system_error& e) {
        std::fprintf(stderr, "ps_server: started %d of %d applier threads (%s)\n", i, threads,
                     e.what());
        break;
      }
    }
  }
  int size() const { return static_cast<int>(threads_.size()); }
  ~ApplierPool() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }

  Ticket Run(absl::AnyInvocable<absl::Status() &&> task) {
    Ticket ticket;
    absl::MutexLock lock(&mu_);
    queue_.push_back({std::move(task), ticket.state_});
    return ticket;
  }

 private:
  struct Task {
    absl::AnyInvocable<absl::Status() &&> fn;
    std::shared_ptr<Ticket::State> state;
  };

  void Loop() {
    while (true) {
      Task task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](ApplierPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
              return p->stopping_ || !p->queue_.empty();
            },
            this));
        if (queue_.empty()) return;  // stopping, and nothing left to do
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      // An exception (an allocation of the ledger's failing) must not end
      // the server, as it would from this thread: the push is refused.
      try {
        task.state->status = std::move(task.fn)();
      } catch (const std::bad_alloc&) {
        task.state->status = absl::ResourceExhaustedError(
            "the shard ran out of memory while applying a push message");
      } catch (const std::exception& e) {
        task.state->status =
            absl::InternalError(absl::StrCat("applying a push message failed: ", e.what()));
      }
      task.state->done.Notify();
    }
  }

  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// Writes a call's response messages on a thread of its own, in order, so that
// the handler goes on reading and applying the next request message while
// the previous response is being sent (a synchronous Write returns only once
// gRPC has taken the whole message).
class ResponseWriter {
 public:
  explicit ResponseWriter(grpc::internal::WriterInterface<grpc::ByteBuffer>* stream)
      : stream_(stream), thread_([this] {
          pthread_setname_np(pthread_self(), "ps_respond");
          Loop();
        }) {}
  ~ResponseWriter() { Close(); }

  // Queues a message, first waiting while kMaxQueued are queued, so that a
  // client that stops reading stops the handler (and through HTTP/2 flow
  // control, its own writes) instead of the responses piling up here; false
  // once a write has failed (the client is gone).
  bool Send(grpc::ByteBuffer message) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](ResponseWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
          return w->failed_ || w->queue_.size() < kMaxQueued;
        },
        this));
    if (failed_) return false;
    queue_.push_back(std::move(message));
    return true;
  }
  // Sends what is queued, stops the thread; false if any write failed.
  bool Close() {
    {
      absl::MutexLock lock(&mu_);
      closing_ = true;
    }
    if (thread_.joinable()) thread_.join();
    absl::MutexLock lock(&mu_);
    return !failed_;
  }

 private:
  void Loop() {
    while (true) {
      grpc::ByteBuffer message;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](ResponseWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
              return w->closing_ || !w->queue_.empty();
            },
            this));
        if (queue_.empty()) return;  // closing, all sent
        message = std::move(queue_.front());
        queue_.pop_front();
      }
      if (!stream_->Write(message)) {
        absl::MutexLock lock(&mu_);
        failed_ = true;
        queue_.clear();
        return;
      }
    }
  }

  // Responses waiting besides the one being written: enough to keep the
  // writer busy while the handler applies the next message.
  static constexpr size_t kMaxQueued = 2;

  grpc::internal::WriterInterface<grpc::ByteBuffer>* const stream_;
  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// The ParameterServer service over a VariableStore. Handlers never throw or
// crash on a request: every problem becomes a status naming the variable.
//
// Push and Pull move tensor bytes, so they are registered as raw methods
// (grpc::ByteBuffer in or out) and use the hand-written codec of
// common/grpc_wire.h: a push is parsed straight from gRPC's slices, a pull
// response is encoded into a pooled buffer that gRPC sends without a copy.
// The method table is written here (as the generated Service constructor
// does) because gRPC generates no synchronous raw methods; the wire bytes
// are those of proto/psflow.proto.
// Admits at most `limit` calls that read or change variables
// (RegisterVariables, Pull, Push, PushPull) at once (--threads), in the
// order they arrive; the others wait, each on its gRPC thread, until one
// ends or until they are cancelled (their deadline passed, the client went
// away, or the server is shutting down). GetStatus, the health service and
// reflection are never held. gRPC's own limit (ResourceQuota's
// SetMaxThreads), used before, refused every call beyond it with
// RESOURCE_EXHAUSTED "Server Threadpool Exhausted", which no client
// retries: eight workers against shards with --threads=8 stopped, and a
// busy shard failed its health checks.
class CallGate {
 public:
  explicit CallGate(int limit) : limit_(limit) {}

  // A place among the admitted calls, held until destroyed.
  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& other) noexcept : gate_(std::exchange(other.gate_, nullptr)) {}
    Slot& operator=(Slot&&) = delete;
    ~Slot() {
      if (gate_ != nullptr) gate_->Leave();
    }

   private:
    friend class CallGate;
    explicit Slot(CallGate* gate) : gate_(gate) {}
    CallGate* gate_ = nullptr;
  };

  // A slot for the call of `context` once it is its turn; CANCELLED or
  // DEADLINE_EXCEEDED, naming `method`, if the call ends while it waits.
  absl::StatusOr<Slot> Enter(grpc::ServerContext* context, absl::string_view method) {
    absl::MutexLock lock(&mu_);
    if (limit_ <= 0 || (active_ < limit_ && waiting_.empty())) {
      ++active_;
      return Slot(this);
    }
    const uint64_t ticket = next_ticket_++;
    waiting_.push_back(ticket);
    ++calls_waited_;
    const absl::Time deadline = absl::FromChrono(context->deadline());
    auto my_turn = [this, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return active_ < limit_ && waiting_.front() == ticket;
    };
    // Cancellation is polled: gRPC's sync API has no wake-up for it.
    while (!mu_.AwaitWithTimeout(absl::Condition(&my_turn), kCancelPoll)) {
      const bool cancelled = context->IsCancelled();
      if (!cancelled && absl::Now() < deadline) continue;
      waiting_.erase(std::find(waiting_.begin(), waiting_.end(), ticket));
      const std::string why = absl::StrCat(
          method, ": the call ended while it waited for one of the ", limit_,
          " calls this shard serves at once (--threads) to finish; nothing was applied");
      return cancelled ? absl::CancelledError(why) : absl::DeadlineExceededError(why);
    }
    waiting_.pop_front();
    ++active_;
    return Slot(this);
  }

  struct Counts {
    int serving = 0;     // calls admitted now
    int waiting = 0;     // calls waiting for a slot now
    int64_t waited = 0;  // calls that had to wait, since the start
  };
  Counts counts() const {
    absl::MutexLock lock(&mu_);
    return {active_, static_cast<int>(waiting_.size()), calls_waited_};
  }

 private:
  static constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

  void Leave() {
    absl::MutexLock lock(&mu_);
    --active_;
  }

  const int limit_;  // 0: no limit
  mutable absl::Mutex mu_;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<uint64_t> waiting_ ABSL_GUARDED_BY(mu_);  // tickets, in arrival order
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t calls_waited_ ABSL_GUARDED_BY(mu_) = 0;
};

class PsServer::Service final : public grpc::Service {
 public:
  Service(VariableStore* store, int max_calls, int apply_threads, int apply_window)
      : store_(store),
        gate_(max_calls),
        pool_(std::make_shared<BufferPool>()),
        appliers_(MakeAppliers(apply_threads)),
        apply_window_(std::max(apply_window, 1)),
        incarnation_(DrawIncarnation()) {
    using grpc::internal::RpcMethod;
    using grpc::internal::RpcServiceMethod;
    AddMethod(new RpcServiceMethod(
        "/psflow.ParameterServer/RegisterVariables", RpcMethod::CLIENT_STREAMING,
        new grpc::internal::ClientStreamingHandler<Service, grpc::ByteBuffer, RegisterResponse>(
            [](Service* s, grpc::ServerContext* ctx, grpc::ServerReader<grpc::ByteBuffer>* reader,
               RegisterResponse* response) {
              auto slot = s->gate_.Enter(ctx, "RegisterVariables");
              if (!slot.ok()) return ToGrpcStatus(slot.status());
              return ToGrpcStatus(s->DoRegister(ctx, reader, response));
            },
            this)));
    AddMethod(new RpcServiceMethod(
        "/psflow.ParameterServer/Pull", RpcMethod::SERVER_STREAMING,
        new grpc::internal::ServerStreamingHandler<Service, grpc::ByteBuffer, grpc::ByteBuffer>(
            [](Service* s, grpc::ServerContext* ctx, const grpc::ByteBuffer* bytes,
               grpc::ServerWriter<grpc::ByteBuffer>* writer) {
              auto slot = s->gate_.Enter(ctx, "Pull");
              if (!slot.ok()) return ToGrpcStatus(slot.status());
              // Read in place (common/grpc_wire.h): a request costs its
              // own bytes, once, however many ranges it names.
              std::vector<grpc::Slice> slices;
              std::vector<absl::string_view> pieces;
              std::string joined;
              wire::PullRequestView request;
              absl::Status parsed = wire::DumpPieces(*bytes, &slices, &pieces);
              if (parsed.ok()) {
                absl::string_view all = pieces.size() == 1 ? pieces[0] : absl::string_view();
                if (pieces.size() > 1) {
                  for (absl::string_view piece : pieces) joined.append(piece.data(), piece.size());
                  all = joined;
                  slices.clear();
                }
                parsed = request.Parse(all);
              }
              if (!parsed.ok()) {
                return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
                    "Pull: the request is not a valid PullRequest: ", parsed.message())));
              }
              return ToGrpcStatus(s->DoPull(ctx, request, writer));
            },
            this)));
    AddMethod(new RpcServiceMethod(
        "/psflow.ParameterServer/Push", RpcMethod::CLIENT_STREAMING,
        new grpc::internal::ClientStreamingHandler<Service, grpc::ByteBuffer, PushResponse>(
            [](Service* s, grpc::ServerContext* ctx, grpc::ServerReader<grpc::ByteBuffer>* reader,
               PushResponse* response) {
              auto slot = s->gate_.Enter(ctx, "Push");
              if (!slot.ok()) return ToGrpcStatus(slot.status());
              return ToGrpcStatus(s->DoPush(ctx, reader, response));
            },
            this)));
    AddMethod(new RpcServiceMethod(
        "/psflow.ParameterServer/PushPull", RpcMethod::BIDI_STREAMING,
        new grpc::internal::BidiStreamingHandler<Service, grpc::ByteBuffer, grpc::ByteBuffer>(
            [](Service* s, grpc::ServerContext* ctx,
               grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* stream) {
              auto slot = s->gate_.Enter(ctx, "PushPull");
              if (!slot.ok()) return ToGrpcStatus(slot.status());
              return ToGrpcStatus(s->DoPushPull(ctx, stream));
            },
            this)));
    AddMethod(new RpcServiceMethod(
        "/psflow.ParameterServer/GetStatus", RpcMethod::NORMAL_RPC,
        new grpc::internal::RpcMethodHandler<Service, grpc::ByteBuffer, StatusResponse,
                                             grpc::ByteBuffer, grpc::protobuf::MessageLite>(
            [](Service* s, grpc::ServerContext*, const grpc::ByteBuffer* bytes,
               StatusResponse* response) {
              StatusRequest request;
              absl::Status parsed = ParseRequest(*bytes, "GetStatus: the request", &request);
              if (!parsed.ok()) return ToGrpcStatus(parsed);
              return ToGrpcStatus(s->DoGetStatus(request, response));
            },
            this)));
  }

 private:
  absl::Status DoGetStatus(const StatusRequest& request, StatusResponse* response) {
    if (request.page_size() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("GetStatus: page_size is ", request.page_size(),
                       "; expected 0 (as many parts as fit in one answer) or more"));
    }
    const VariableStoreOptions& o = store_->options();
    response->set_shard_index(o.shard_index);
    response->set_num_shards(o.num_shards);
    response->set_optimizer(store_->optimizer().DebugString());
    response->set_plan_fingerprint(store_->plan_fingerprint());
    response->set_incarnation(incarnation_);
    response->set_model_fingerprint(model_fingerprint_.load());
    ListPartsPage(request, response);
    const StoreStats stats = store_->stats();
    response->set_pushes(stats.pushes);
    response->set_duplicate_elements(stats.duplicate_elements);
    response->set_rejected_requests(stats.rejected_requests);
    response->set_parameter_bytes(stats.parameter_bytes);
    response->set_request_id_retention_ms(
        absl::ToInt64Milliseconds(store_->options().request_id_retention));
    response->set_ledger_ids(stats.ledger_ids);
    response->set_ledger_ids_forgotten_early(stats.ledger_ids_forgotten_early);
    response->set_stripes_copied_on_write(stats.stripes_copied_on_write);
    response->set_allows_non_finite_gradients(o.allow_non_finite_gradients);
    response->set_pushes_checked_by_client(stats.pushes_checked_by_client);
    response->set_max_chunk_bytes(store_->options().max_chunk_bytes);
    const CallGate::Counts calls = gate_.counts();
    response->set_calls_serving(calls.serving);
    response->set_calls_waiting(calls.waiting);
    response->set_calls_waited(calls.waited);
    response->set_bytes_received(bytes_received_);
    response->set_bytes_sent(bytes_sent_);
    response->set_resident_bytes(ResidentBytes());
    return absl::OkStatus();
  }

  // The parts whose names sort after the request's page_token, at most its
  // page_size and at most kStatusPageBytes of them (but at least one, so
  // that a pager always gets on), and the token that goes on after them.
  void ListPartsPage(const StatusRequest& request, StatusResponse* response) {
    // Only as many parts as the page can take are copied: an entry and its
    // token take at least kMinEntryBytes of it.
    constexpr size_t kMinEntryBytes = 12;
    constexpr size_t kMostEntries = kStatusPageBytes / kMinEntryBytes + 1;
    const size_t limit = request.page_size() > 0
                             ? std::min(static_cast<size_t>(request.page_size()), kMostEntries)
                             : kMostEntries;
    int64_t total = 0, remaining = 0;
    const std::vector<PartSnapshot> parts =  // sorted by name
        store_->ListParts(request.page_token(), limit, &total, &remaining);
    response->set_num_parts(total);
    auto it = parts.begin();
    size_t bytes = 0;
    for (int listed = 0; it != parts.end(); ++it, ++listed) {
      if (request.page_size() > 0 && listed == request.page_size()) break;
      PartStatus entry;
      ToProto(it->def, entry.mutable_def());
      entry.set_num_elements(it->num_elements);
      entry.set_version(it->version);
      // The entry with its tag and length, and the next_page_token its
      // name may become.
      const size_t entry_bytes = entry.ByteSizeLong() + 6;
      const size_t token_bytes = it->def.variable.size() + 6;
      if (listed > 0 && bytes + entry_bytes + token_bytes > kStatusPageBytes) break;
      bytes += entry_bytes;
      *response->add_parts() = std::move(entry);
    }
    const int64_t listed = it - parts.begin();
    if (listed < remaining) response->set_next_page_token(std::prev(it)->def.variable);
  }

  // Every method receives bytes and parses them here: gRPC's typed handlers
  // answer bytes that do not parse with INTERNAL, and its typed stream
  // reader reports them as the end of the stream (a registration would go
  // on without the message). `what` names the message for the error.
  template <typename T>
  static absl::Status ParseRequest(grpc::ByteBuffer buffer, absl::string_view what, T* out) {
    // Deserialize consumes its buffer; the copy shares the slices.
    if (!grpc::SerializationTraits<T>::Deserialize(&buffer, out).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " is not a valid ", T::descriptor()->name()));
    }
    return absl::OkStatus();
  }

  // Reads the next registration message; false at the end of the stream.
  static absl::StatusOr<bool> ReadRegister(grpc::ServerReader<grpc::ByteBuffer>* reader,
                                           int index, RegisterRequest* msg) {
    grpc::ByteBuffer buffer;
    if (!reader->Read(&buffer)) return false;
    PSFLOW_RETURN_IF_ERROR(ParseRequest(
        std::move(buffer), absl::StrCat("RegisterVariables: message ", index, " of the stream"),
        msg));
    return true;
  }

  absl::Status DoRegister(grpc::ServerContext* context,
                          grpc::ServerReader<grpc::ByteBuffer>* reader,
                          RegisterResponse* response) {
    RegisterRequest msg;
    int index = 0;
    PSFLOW_ASSIGN_OR_RETURN(bool got, ReadRegister(reader, index, &msg));
    if (!got || !msg.has_header()) {
      return absl::InvalidArgumentError(
          "RegisterVariables: the first message must carry the header");
    }
    // The header may go on in the messages that follow, as long as no
    // values came before: their parts are added to the first's (a client
    // sends a header of many thousand parts so). All of it counts against
    // kMaxRegisterHeaderBytes.
    RegisterHeader h = std::move(*msg.mutable_header());
    msg.clear_header();
    int64_t header_bytes = static_cast<int64_t>(h.ByteSizeLong());
    auto too_long = [&] {
      return absl::ResourceExhaustedError(
          absl::StrCat("RegisterVariables: the header goes on past ", kMaxRegisterHeaderBytes,
                       " bytes (message ", index,
                       "); a shard takes at most that much of part definitions at once"));
    };
    if (header_bytes > kMaxRegisterHeaderBytes) return too_long();
    // Each part is checked as it is read: a part of 2 bytes on the wire
    // takes about 80 in memory, so a header of malformed parts must be
    // refused at the first, not held whole (valid parts take 10 or more).
    std::vector<PartDefinition> parts;
    auto add_parts = [&](const RegisterHeader& header) -> absl::Status {
      for (int i = 0; i < header.parts_size(); ++i) {
        parts.push_back(FromProto(header.parts(i)));
        absl::Status valid = VariableStore::ValidateDefinition(parts.back());
        if (!valid.ok()) {
          return absl::Status(valid.code(),
                              absl::StrCat("RegisterVariables: message ", index, ", its part ", i,
                                           " (from 0): ", valid.message(), "; nothing registered"));
        }
      }
      return absl::OkStatus();
    };
    PSFLOW_RETURN_IF_ERROR(add_parts(h));
    got = true;
    while (msg.segments().empty()) {
      PSFLOW_ASSIGN_OR_RETURN(got, ReadRegister(reader, ++index, &msg));
      if (!got) break;
      if (!msg.has_header()) continue;  // values follow, or an empty message
      const RegisterHeader& more = msg.header();
      if (more.plan_fingerprint() != h.plan_fingerprint() || more.num_shards() != h.num_shards() ||
          more.shard_index() != h.shard_index()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "RegisterVariables: message ", index, "'s header is for plan ", more.plan_fingerprint(),
            ", shard ", more.shard_index(), " of ", more.num_shards(),
            "; the first message's was for plan ", h.plan_fingerprint(), ", shard ",
            h.shard_index(), " of ", h.num_shards(), " (a header that goes on must repeat them)"));
      }
      header_bytes += static_cast<int64_t>(more.ByteSizeLong());
      if (header_bytes > kMaxRegisterHeaderBytes) return too_long();
      PSFLOW_RETURN_IF_ERROR(add_parts(more));
      msg.clear_header();
    }
    PSFLOW_RETURN_IF_ERROR(CheckIncarnation(h.shard_incarnation(), "RegisterVariables"));
    PSFLOW_ASSIGN_OR_RETURN(auto registration,
                            store_->BeginRegistration(h.plan_fingerprint(), h.num_shards(),
                                                      h.shard_index(), std::move(parts)));
    // The same network on the same data: the plan's fingerprint (checked by
    // BeginRegistration, whose message names the variable) covers the
    // variables' names and shapes, not the activations or the data set.
    if (const uint64_t have = model_fingerprint_.load();
        h.model_fingerprint() != 0 && have != 0 && h.model_fingerprint() != have) {
      // Where the plans differ too (other parts on this shard, none of the
      // same name), that is what to say, as a waiting worker hears it.
      if (const uint64_t plan = store_->plan_fingerprint();
          plan != 0 && plan != h.plan_fingerprint()) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "RegisterVariables: this shard holds variables of another partition plan "
            "(fingerprint %016x, the registration's is %016x): every process must use the same "
            "model and number of ps shards",
            plan, h.plan_fingerprint()));
      }
      return absl::FailedPreconditionError(absl::StrFormat(
          "RegisterVariables: this shard holds a model of fingerprint %016x, and the "
          "registration's is %016x: the layers' settings (activations, padding, strides) or "
          "the data set differ; every process must use the same --model and --dataset",
          have, h.model_fingerprint()));
    }
    while (got) {
      if (msg.has_header()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "RegisterVariables: message ", index,
            " carries a header after the initial values began; a header goes only in the "
            "messages before the first values"));
      }
      for (const Segment& segment : msg.segments()) {
        int64_t count = 0;
        PSFLOW_RETURN_IF_ERROR(SegmentSize(segment, &count));
        PSFLOW_RETURN_IF_ERROR(registration->AddValues(segment.variable(), segment.offset(),
                                                       segment.data().data(), count));
        bytes_received_ += static_cast<int64_t>(segment.data().size());
      }
      PSFLOW_ASSIGN_OR_RETURN(got, ReadRegister(reader, ++index, &msg));
    }
    if (context->IsCancelled()) {
      return absl::CancelledError("RegisterVariables: the client went away; nothing registered");
    }
    PSFLOW_ASSIGN_OR_RETURN(RegisterResult result, registration->Commit());
    if (result.parts_created > 0) model_fingerprint_ = h.model_fingerprint();
    response->set_parts_created(result.parts_created);
    response->set_parts_kept(result.parts_kept);
    return absl::OkStatus();
  }

  // One received push message: its slices (references, no copy) and the
  // decoded segments pointing into them.
  struct PushMessage {
    grpc::ByteBuffer buffer;
    std::vector<grpc::Slice> slices;
    std::vector<absl::string_view> pieces;
    wire::DecodedMessage msg;
  };

  // Reads and decodes message `index` (from 1) of a `method` ("Push" or
  // "PushPull") stream; false at the end of the stream.
  absl::StatusOr<bool> ReadPush(grpc::internal::ReaderInterface<grpc::ByteBuffer>* reader,
                                absl::string_view method, size_t index, PushMessage* m) {
    if (!reader->Read(&m->buffer)) return false;
    PSFLOW_RETURN_IF_ERROR(wire::DumpPieces(m->buffer, &m->slices, &m->pieces));
    absl::Status s = wire::Decode(wire::MessageKind::kPushRequest, m->pieces, &m->msg);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(method, ": message ", index, " of the stream: ", s.message()));
    }
    return true;
  }

  // A run of whole float32 values of one segment: elements
  // [offset, offset + count) of its variable, at any byte alignment.
  struct GradPiece {
    const char* data;
    int64_t offset;
    int64_t count;
  };

  // Splits a message's segments into runs of whole float32 values and
  // validates every segment (nothing of a message that fails validation is
  // applied). The optimizer later reads each segment where gRPC received it,
  // run by run (a run is one slice's share of the segment); only a value
  // split across two slices is first put together in `stitched`, 4 bytes at
  // a time.
  struct PreparedPush {
    std::vector<GradPiece> pieces;
    std::vector<float> stitched;       // pieces point into it
    std::vector<size_t> first_piece;   // per segment, and the end
  };
  absl::Status PreparePush(const wire::DecodedMessage& msg, VariableStore::PushSession* session,
                           PreparedPush* prepared) {
    std::vector<GradPiece>* pieces = &prepared->pieces;
    std::vector<float>* stitched = &prepared->stitched;
    std::vector<size_t>& first_piece = prepared->first_piece;
    pieces->clear();
    stitched->clear();
    size_t runs = 0;
    for (size_t i = 0; i < msg.num_segments; ++i) runs += msg.segments[i].num_runs;
    stitched->reserve(runs);  // pieces point into it: it must not reallocate
    first_piece.assign(msg.num_segments + 1, 0);
    for (size_t i = 0; i < msg.num_segments; ++i) {
      const wire::DecodedSegment& seg = msg.segments[i];
      first_piece[i] = pieces->size();
      if (seg.data_bytes % 4 != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("segment of '", seg.variable, "' has ", seg.data_bytes,
                         " bytes of data; expected a multiple of 4 (float32 values)"));
      }
      // Before any arithmetic on the offset, which the client chose.
      PSFLOW_RETURN_IF_ERROR(session->ValidateRange(seg.variable, seg.offset, seg.data_bytes / 4));
      int64_t element = seg.offset;
      char carry[4];
      size_t carried = 0;
      for (size_t r = seg.first_run; r < seg.first_run + seg.num_runs; ++r) {
        const char* p = msg.data_runs[r].data();
        size_t left = msg.data_runs[r].size();
        if (carried > 0) {  // finish the value the previous run began
          const size_t take = std::min(left, 4 - carried);
          std::memcpy(carry + carried, p, take);
          carried += take;
          p += take;
          left -= take;
          if (carried < 4) continue;
          float v;
          std::memcpy(&v, carry, 4);
          stitched->push_back(v);
          pieces->push_back({reinterpret_cast<const char*>(&stitched->back()), element, 1});
          ++element;
          carried = 0;
        }
        const int64_t whole = static_cast<int64_t>(left / 4);
        if (whole > 0) pieces->push_back({p, element, whole});
        element += whole;
        carried = left % 4;
        std::memcpy(carry, p + 4 * whole, carried);
      }
    }
    first_piece[msg.num_segments] = pieces->size();
    for (size_t i = 0; i < msg.num_segments; ++i) {
      const wire::DecodedSegment& seg = msg.segments[i];
      for (size_t k = first_piece[i]; k < first_piece[i + 1]; ++k) {
        const GradPiece& piece = (*pieces)[k];
        PSFLOW_RETURN_IF_ERROR(
            session->Validate(seg.variable, piece.offset, piece.data, piece.count));
      }
    }
    return absl::OkStatus();
  }

  // Applies a message PreparePush has validated. With `read_back`, segment
  // i's values after the update are copied to read_back[i] and its part's
  // version to versions[i].
  absl::Status ApplyPrepared(const wire::DecodedMessage& msg, const PreparedPush& prepared,
                             VariableStore::PushSession* session,
                             char* const* read_back = nullptr, int64_t* versions = nullptr) {
    for (size_t i = 0; i < msg.num_segments; ++i) {
      const wire::DecodedSegment& seg = msg.segments[i];
      if (versions != nullptr && prepared.first_piece[i] == prepared.first_piece[i + 1]) {
        // An empty segment changes nothing but is still answered with its
        // part's version.
        PSFLOW_RETURN_IF_ERROR(session->Apply(seg.variable, seg.offset, nullptr, 0,
                                              /*values_checked=*/true, nullptr,
                                              &versions[i]));
      }
      for (size_t k = prepared.first_piece[i]; k < prepared.first_piece[i + 1]; ++k) {
        const GradPiece& piece = prepared.pieces[k];
        char* out = read_back == nullptr ? nullptr
                                         : read_back[i] + 4 * (piece.offset - seg.offset);
        PSFLOW_RETURN_IF_ERROR(session->Apply(seg.variable, piece.offset, piece.data, piece.count,
                                              /*values_checked=*/true, out,
                                              versions == nullptr ? nullptr : &versions[i]));
      }
      bytes_received_ += seg.data_bytes;
    }
    return absl::OkStatus();
  }

  // A push is a pipeline: this handler thread reads, decodes and validates
  // the messages in order, and hands each valid one to the applier pool,
  // with up to `apply_window_` messages of the push being applied at once
  // (on different element ranges: the store locks a part per stripe). So
  // the optimizer runs while the next bytes arrive, on as many cores as the
  // stream needs, instead of stalling the stream (and, through HTTP/2 flow
  // control, the sender). A message that fails validation is not applied
  // and ends the push: the ones before it are applied (as for a broken
  // stream), none after it is read.
  absl::Status DoPush(grpc::ServerContext* context, grpc::ServerReader<grpc::ByteBuffer>* reader,
                      PushResponse* response) {
    const int window = appliers_ == nullptr ? 1 : apply_window_;
    struct Slot {
      PushMessage message;
      PreparedPush prepared;
    };
    // Message n lives in slots[n % (window + 1)]: up to `window` being
    // applied, one more being read.
    std::vector<Slot> slots(window + 1);
    PSFLOW_ASSIGN_OR_RETURN(bool got, ReadPush(reader, "Push", 1, &slots[0].message));
    if (!got || !slots[0].message.msg.has_header) {
      return absl::InvalidArgumentError("Push: the first message must carry the header");
    }
    const wire::PushHeaderFields& h = slots[0].message.msg.header;
    if (absl::Status s = CheckIncarnation(h.shard_incarnation, "Push"); !s.ok()) {
      store_->CountRejectedPush();
      return s;
    }
    auto session =
        store_->BeginPush({h.worker_id, h.step, h.read_version, h.request_id, h.gradient_checked});
    std::deque<ApplierPool::Ticket> applying;  // oldest first
    absl::Status status;
    for (size_t n = 0;; ++n) {
      Slot& slot = slots[n % slots.size()];
      status = PreparePush(slot.message.msg, session.get(), &slot.prepared);
      if (!status.ok()) break;
      if (appliers_ == nullptr) {  // one stage: apply, then read the next message
        status = ApplyPrepared(slot.message.msg, slot.prepared, session.get());
      } else {
        applying.push_back(appliers_->Run([this, &slot, &session] {
          return ApplyPrepared(slot.message.msg, slot.prepared, session.get());
        }));
        // Message n-window's slot is the one message n+1 is read into:
        // wait for it, so that `window` messages are applied while the next
        // one is read.
        if (static_cast<int>(applying.size()) > window) {
          status = applying.front().Wait();
          applying.pop_front();
        }
      }
      if (!status.ok()) break;
      absl::StatusOr<bool> more =
          ReadPush(reader, "Push", n + 2, &slots[(n + 1) % slots.size()].message);
      if (!more.ok()) status = more.status();
      if (!status.ok() || !*more) break;
    }
    // Every message handed to the pool finishes before the slots go away.
    for (ApplierPool::Ticket& ticket : applying) {
      absl::Status s = ticket.Wait();
      if (status.ok()) status = std::move(s);
    }
    if (status.ok() && context->IsCancelled()) {
      status = absl::CancelledError("Push: the stream broke before it was complete");
    }
    session->Finish(status);
    PSFLOW_RETURN_IF_ERROR(status);
    response->set_elements_applied(session->elements_applied());
    response->set_elements_skipped(session->elements_skipped());
    return absl::OkStatus();
  }

  // A push whose every message is answered, once applied, by a PullResponse
  // message holding the same segments' values right after the update: the
  // gradient streams in while the fresh values stream out, in one call. The
  // values are copied out under the part's lock right after the optimizer
  // wrote them, while they are still in cache.
  absl::Status DoPushPull(grpc::ServerContext* context,
                          grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* stream) {
    PushMessage m;
    size_t index = 1;  // of the message in `m`
    PSFLOW_ASSIGN_OR_RETURN(bool got, ReadPush(stream, "PushPull", index, &m));
    if (!got || !m.msg.has_header) {
      return absl::InvalidArgumentError("PushPull: the first message must carry the header");
    }
    const wire::PushHeaderFields& h = m.msg.header;
    if (absl::Status s = CheckIncarnation(h.shard_incarnation, "PushPull"); !s.ok()) {
      store_->CountRejectedPush();
      return s;
    }
    auto session =
        store_->BeginPush({h.worker_id, h.step, h.read_version, h.request_id, h.gradient_checked});
    PreparedPush prepared;
    std::vector<char*> read_back;
    std::vector<int64_t> versions;
    std::string tail;
    absl::Status status;
    ResponseWriter writer(stream);
    while (status.ok()) {
      const wire::DecodedMessage& msg = m.msg;
      if (msg.num_segments > 0) {
        // The response: each segment's prefix, then room for its values
        // (the versions follow in a slice of their own). Sized exactly, so
        // that the answer to a message is no larger than the message.
        size_t bytes = 0;
        for (size_t i = 0; i < msg.num_segments; ++i) {
          const wire::DecodedSegment& seg = msg.segments[i];
          const size_t data = static_cast<size_t>(std::max<int64_t>(seg.data_bytes, 0));
          bytes += wire::SegmentPrefixSize(1, seg.variable, seg.offset, data) + data;
        }
        BufferPool::Buffer* buf = pool_->Get(bytes);
        char* p = buf->data.get();
        size_t len = 0;
        read_back.resize(msg.num_segments);
        versions.assign(msg.num_segments, 0);
        for (size_t i = 0; i < msg.num_segments; ++i) {
          const wire::DecodedSegment& seg = msg.segments[i];
          len += wire::WriteSegmentPrefix(p + len, 1, seg.variable, seg.offset,
                                          static_cast<size_t>(std::max<int64_t>(seg.data_bytes, 0)));
          read_back[i] = p + len;
          len += static_cast<size_t>(std::max<int64_t>(seg.data_bytes, 0));
        }
        status = PreparePush(msg, session.get(), &prepared);
        if (status.ok()) {
          status = ApplyPrepared(msg, prepared, session.get(), read_back.data(), versions.data());
        }
        if (!status.ok()) {
          BufferPool::Return(buf);
          break;
        }
        tail.clear();
        wire::AppendPackedInt64(&tail, 2, versions);
        grpc::Slice slices[2] = {grpc::Slice(buf->data.get(), len, &BufferPool::Return, buf),
                                 grpc::Slice(tail)};
        if (!writer.Send(grpc::ByteBuffer(slices, 2))) {
          status = absl::CancelledError("PushPull: the client went away");
          break;
        }
        for (size_t i = 0; i < msg.num_segments; ++i) bytes_sent_ += msg.segments[i].data_bytes;
      } else {
        // A message without segments is answered too (by an empty
        // PullResponse), so that the n-th answer is always the n-th message's.
        grpc::Slice empty;
        if (!writer.Send(grpc::ByteBuffer(&empty, 1))) {
          status = absl::CancelledError("PushPull: the client went away");
          break;
        }
      }
      absl::StatusOr<bool> more = ReadPush(stream, "PushPull", ++index, &m);
      if (!more.ok()) status = more.status();
      if (!status.ok() || !*more) break;
    }
    if (!writer.Close() && status.ok()) {
      status = absl::CancelledError("PushPull: the client went away");
    }
    if (status.ok() && context->IsCancelled()) {
      status = absl::CancelledError("PushPull: the stream broke before it was complete");
    }
    session->Finish(status);
    return status;
  }

  absl::Status DoPull(grpc::ServerContext* context, const wire::PullRequestView& request,
                      grpc::ServerWriter<grpc::ByteBuffer>* writer) {
    PSFLOW_RETURN_IF_ERROR(CheckIncarnation(request.shard_incarnation(), "Pull"));
    // What to read: elements [begin, end) of each part, in order, taken one
    // span at a time from the request (or from `all`) while the messages
    // are cut, so that the memory a request costs is bounded by its size,
    // not by the number of ranges or the element counts it names. The names
    // point into the request or into `all`.
    struct Span {
      absl::string_view variable;
      int64_t begin, end;
    };
    std::vector<PartSnapshot> all;  // an empty request's parts
    size_t next_part = 0;
    wire::PullRequestView::Walker walker = request.Walk();
    // The next span of the request, checked (always, so that the second
    // walk below meets no surprise); false after the last.
    auto next_span = [&](Span* span) -> absl::StatusOr<bool> {
      if (request.num_ranges() > 0) {
        wire::PullRangeFields range;
        if (!walker.NextRange(&range)) return false;
        PSFLOW_RETURN_IF_ERROR(
            store_->CheckRange(range.variable, range.offset, range.count, "Pull: range"));
        *span = {range.variable, range.offset, range.offset + range.count};
        return true;
      }
      if (request.num_variables() > 0) {
        absl::string_view name;
        if (!walker.NextVariable(&name)) return false;
        PSFLOW_ASSIGN_OR_RETURN(const int64_t elements, store_->PartElements(name));
        *span = {name, 0, elements};
        return true;
      }
      if (next_part == all.size()) return false;
      const PartSnapshot& part = all[next_part++];
      *span = {part.def.variable, 0, part.num_elements};
      return true;
    };
    if (request.num_ranges() == 0 && request.num_variables() == 0) all = store_->ListParts();
    // Every name and range is checked before anything is sent, as a whole
    // request is refused or served.
    Span span;
    for (bool more = true; more;) {
      PSFLOW_ASSIGN_OR_RETURN(more, next_span(&span));
    }
    walker = request.Walk();
    next_part = 0;
    int64_t chunk_bytes = request.max_chunk_bytes() > 0 ? request.max_chunk_bytes()
                                                        : kDefaultPullChunkBytes;
    chunk_bytes = std::max<int64_t>(4, std::min(chunk_bytes, store_->options().max_chunk_bytes));

    // Each message: runs of (variable, offset, count) taken from the spans
    // in order (empty spans send nothing), as many as fit in chunk_bytes
    // with their framing: a segment's prefix (tag, length, name, offset,
    // the data's tag and length), its version (at most 10 bytes) and the
    // versions field's tag and length (at most 6). A message carries at
    // least one element, so a budget smaller than one segment's framing
    // gives one-element messages a little over it.
    constexpr int64_t kVersionsFieldBytes = 6, kVersionBytes = 10;
    struct Piece {
      absl::string_view variable;
      int64_t offset, count;
    };
    std::vector<Piece> pieces;
    std::vector<grpc::Slice> slices;
    std::vector<PinnedValues> pinned;
    std::vector<int64_t> versions;
    std::string tail;
    // `span` is the one being sent, from element `at`, while `have`.
    PSFLOW_ASSIGN_OR_RETURN(bool have, next_span(&span));
    int64_t at = have ? span.begin : 0;
    auto skip_sent = [&]() -> absl::Status {
      while (have && at >= span.end) {
        PSFLOW_ASSIGN_OR_RETURN(have, next_span(&span));
        if (have) at = span.begin;
      }
      return absl::OkStatus();
    };
    PSFLOW_RETURN_IF_ERROR(skip_sent());
    while (have) {
      // Large pieces are sent from where the values lie, pinned until gRPC
      // has written them (a push meanwhile writes a copy); the segments'
      // prefixes and small pieces are copied into one pooled buffer.
      pieces.clear();
      size_t copied = 0;
      for (int64_t message_bytes = kVersionsFieldBytes; have;) {
        const int64_t left = span.end - at;
        // The prefix grows with the data's length, so the longest this
        // segment could be gives an upper bound.
        const int64_t framing =
            wire::SegmentPrefixSize(1, span.variable, at, std::min(left * 4, chunk_bytes)) +
            kVersionBytes;
        const int64_t room = (chunk_bytes - message_bytes - framing) / 4;
        if (room < 1 && !pieces.empty()) break;
        const int64_t take = std::min(left, std::max<int64_t>(1, room));
        pieces.push_back({span.variable, at, take});
        copied += wire::SegmentPrefixSize(1, span.variable, at, take * 4) +
                  (take * 4 >= kPinnedPieceBytes ? 0 : take * 4);
        at += take;
        message_bytes += framing + take * 4;
        PSFLOW_RETURN_IF_ERROR(skip_sent());
      }
      BufferPool::Buffer* buf = pool_->Get(copied);
      const grpc::Slice copies(buf->data.get(), copied, &BufferPool::Return, buf);
      char* p = buf->data.get();
      size_t len = 0, flushed = 0;
      slices.clear();
      auto flush = [&] {
        if (len > flushed) slices.push_back(copies.sub(flushed, len));
        flushed = len;
      };
      versions.clear();
      int64_t data_bytes = 0;
      for (const Piece& piece : pieces) {
        len += wire::WriteSegmentPrefix(p + len, 1, piece.variable, piece.offset, piece.count * 4);
        absl::StatusOr<int64_t> version;
        if (piece.count * 4 >= kPinnedPieceBytes) {
          flush();
          pinned.clear();
          // Room for a slice per stripe first, so that every pin finds its owner.
          slices.reserve(slices.size() + piece.count / VariableStore::kLockStripeElements + 4);
          version = store_->Pin(piece.variable, piece.offset, piece.count, &pinned);
          for (const PinnedValues& v : pinned) {
            slices.emplace_back(const_cast<void*>(v.data), static_cast<size_t>(v.bytes),
                                &VariableStore::Unpin, v.pin);
          }
        } else {
          version = store_->Read(piece.variable, piece.offset, piece.count, p + len);
          len += piece.count * 4;
        }
        if (!version.ok()) return version.status();  // `slices` releases what it holds
        versions.push_back(*version);
        data_bytes += piece.count * 4;
      }
      flush();
      tail.clear();
      wire::AppendPackedInt64(&tail, 2, versions);
      slices.emplace_back(tail);
      grpc::ByteBuffer message(slices.data(), slices.size());
      slices.clear();  // the message holds its own references
      if (!writer->Write(message)) return absl::CancelledError("Pull: the client went away");
      bytes_sent_ += data_bytes;
      if (context->IsCancelled()) return absl::CancelledError("Pull: cancelled");
    }
    return absl::OkStatus();
  }

  VariableStore* const store_;
  CallGate gate_;  // --threads
  const std::shared_ptr<BufferPool> pool_;
  // Null when there are none: the handler threads apply.
  static std::unique_ptr<ApplierPool> MakeAppliers(int threads) {
    if (threads <= 0) return nullptr;
    auto pool = std::make_unique<ApplierPool>(threads);
    return pool->size() > 0 ? std::move(pool) : nullptr;
  }

  const std::unique_ptr<ApplierPool> appliers_;  // null: apply on the handler thread
  const int apply_window_;  // messages of one push applied at once

  // A random non-zero number for this start of the shard (StatusResponse
  // .incarnation): a client that learned another one is talking to a shard
  // that restarted since, and lost what it held.
  static uint64_t DrawIncarnation() {
    std::random_device device;
    uint64_t value = 0;
    while (value == 0) value = (uint64_t{device()} << 32) ^ device();
    return value;
  }
  // OK, or FAILED_PRECONDITION when a call names an incarnation other than
  // this one (0: the client does not check).
  absl::Status CheckIncarnation(uint64_t expected, const char* call) const {
    if (expected == 0 || expected == incarnation_) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: this shard started after the client learned of it (incarnation %016x, the client "
        "knew %016x): it restarted and lost the variables it held; restart every ps shard, then "
        "the workers (psflow keeps no checkpoints yet)",
        call, incarnation_, expected));
  }
  const uint64_t incarnation_;
  // RegisterHeader.model_fingerprint of the latest registration that
  // created parts.
  std::atomic<uint64_t> model_fingerprint_{0};
  std::atomic<int64_t> bytes_received_{0};
  std::atomic<int64_t> bytes_sent_{0};
};

absl::StatusOr<std::unique_ptr<PsServer>> PsServer::Start(const PsServerOptions& options) {
  auto server = std::unique_ptr<PsServer>(new PsServer());
  server->options_ = options;
  PSFLOW_ASSIGN_OR_RETURN(server->store_, VariableStore::Create(options.store));
  // By default the pipeline runs where there are cores to spare for it; on
  // 1-3 cores the hand-off between threads costs more than the overlap gains.
  const int cores = UsableCores();
  const int apply_threads =
      options.apply_threads >= 0 ? options.apply_threads : (cores >= 4 ? std::min(cores, 16) : 0);
  server->service_ = std::make_unique<Service>(server->store_.get(), options.threads, apply_threads,
                                               options.apply_window);

  if (absl::StartsWith(options.address, "unix:")) {
    PSFLOW_RETURN_IF_ERROR(CheckUnixSocketFree(options.address, options.store.shard_index));
  }
  grpc::EnableDefaultHealthCheckService(true);
  // Links the health API's descriptors into the binary (from a static
  // library, an object file nothing refers to is left out), so that
  // reflection describes the health service gRPC serves.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.address, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(server->service_.get());
  // Room for one full chunk plus names and framing.
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(options.store.max_chunk_bytes + (1 << 20), INT32_MAX)));
  builder.SetMaxSendMessageSize(-1);
  // Keepalive (see PsServerOptions), also while a call sends no data, and
  // the clients' keepalive pings allowed; --grpc_arg overrides each.
  GrpcArgs defaults = KeepaliveGrpcArgs(options.keepalive_time, options.keepalive_timeout);
  defaults.emplace_back(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                        absl::StrCat(absl::ToInt64Milliseconds(options.min_client_ping_interval)));
  // Also on a connection without calls (a worker evaluating, a client
  // between steps): without this gRPC allows one ping in 2 hours there, and
  // a client pinging every 11 s while idle was sent GOAWAY too_many_pings.
  defaults.emplace_back(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, "1");
  // gRPC sets SO_REUSEPORT on its listening sockets by default, so a second
  // shard started on a port in use listened beside the first, and the
  // kernel split the workers' connections between the two. Off: it fails.
  defaults.emplace_back(GRPC_ARG_ALLOW_REUSEPORT, "0");
  const GrpcArgs args = OverrideGrpcArgs(std::move(defaults), options.grpc_args);
  builder.SetOption(GrpcArgsOption(args));
  if (options.interceptors) builder.experimental().SetInterceptorCreators(options.interceptors());
  const bool is_unix = absl::StartsWith(options.address, "unix:");
  std::string failure;  // why the shard could not listen
  {
    // gRPC's HTTP/2 server logs a failed bind as a kilobyte of nested
    // errors; where the shard finds the reason itself, its one line
    // replaces that.
    GrpcLogHold hold;
    server->server_ = builder.BuildAndStart();
    if (server->server_ == nullptr || (!is_unix && port == 0)) {
      failure = ListenFailureReason(options.address);
      if (!failure.empty()) {
        hold.DropHeldLines();
      } else {
        failure = server->server_ == nullptr ? "gRPC refused it (its log above says why)"
                                             : "gRPC bound no port";
      }
    }
  }
  if (!failure.empty()) {
    return absl::UnavailableError(absl::StrCat("ps shard ", options.store.shard_index,
                                               " could not listen on ", options.address, ": ",
                                               failure));
  }
  server->port_ = is_unix ? 0 : port;
  if (auto* health = server->server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
  }
  return server;
}

PsServer::~PsServer() { Shutdown(absl::Seconds(1)); }

std::string PsServer::client_address() const {
  if (absl::StartsWith(options_.address, "unix:")) return options_.address;
  return absl::StrCat("localhost:", port_);
}

void PsServer::Shutdown(absl::Duration grace) {
  if (server_ == nullptr) return;
  // Another caller waits here until the first has shut the server down: it
  // used to return at once, and a destructor then freed the server under
  // the first caller's feet.
  absl::call_once(shutdown_once_, [&] {
    if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(false);
    // In nanoseconds: whole seconds made a grace under 1 s none.
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(
                          absl::ToChronoNanoseconds(grace)));
    server_->Wait();
  });
}

void PsServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace psflow::server
