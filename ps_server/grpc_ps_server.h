// PsServer: one PS shard served over gRPC, with the standard health service
// (for Kubernetes probes) and server reflection. Used by ps_server's main and,
// in-process on an ephemeral port, by the tests and benchmarks.
#ifndef PSFLOW_PS_SERVER_GRPC_PS_SERVER_H_
#define PSFLOW_PS_SERVER_GRPC_PS_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/grpc_args.h"
#include "ps_server/variable_store.h"

namespace grpc {
class Server;
namespace experimental {
class ServerInterceptorFactoryInterface;
}  // namespace experimental
}  // namespace grpc

namespace psflow::server {

struct PsServerOptions {
  // "host:port" (port 0 picks a free one) or "unix:/path/to/socket".
  std::string address = "0.0.0.0:0";
  VariableStoreOptions store;
  // Most calls that read or change variables (RegisterVariables, Pull,
  // Push, PushPull) served at once, each on a gRPC thread of its own; the
  // others wait their turn in arrival order until their deadline (never
  // refused for it). 0: no limit. GetStatus, health and reflection calls
  // are never held.
  int threads = 0;
  // Threads that apply pushed gradients while the next chunks are read;
  // 0 applies on the thread that reads (no pipeline); -1 picks one per core
  // (at most 16) on machines with 4 or more cores, else 0.
  int apply_threads = -1;
  // With applier threads: messages of one push applied at once (each on its
  // own element range); 1 applies them one after another, in order.
  int apply_window = 4;
  // A peer that vanishes without closing its connection (its machine or
  // network gone) would hold its calls, and what they reserved, until their
  // deadlines, or for ever without one: every connection is pinged each
  // keepalive_time, also while a call is stalled, and dropped when a ping
  // goes keepalive_timeout unanswered (its calls end as broken streams).
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  // The clients ping too (GrpcPsClientOptions::keepalive_time, 30 s by
  // default), also during a push that the shard does not answer for a
  // while. A shard accepts a ping this long after the previous one; with
  // gRPC's default (5 minutes) the third ping closer than that, with
  // nothing sent by the shard in between, would get GOAWAY
  // "too_many_pings".
  absl::Duration min_client_ping_interval = absl::Seconds(10);
  // Extra gRPC channel arguments of the server ("grpc.http2.lookahead_bytes"
  // and the like), for tuning experiments; a value that parses as an
  // integer is passed as one, else as a string.
  GrpcArgs grpc_args;
  // gRPC server interceptors, made afresh by each Start (where token checks
  // and metrics will attach; tests use one to lose a reply).
  std::function<
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>()>
      interceptors;
};

// Thread-safe.
class PsServer {
 public:
  static absl::StatusOr<std::unique_ptr<PsServer>> Start(const PsServerOptions& options);
  ~PsServer();  // shuts down if still running

  // The bound port (0 for a unix socket).
  int port() const { return port_; }
  // An address clients on this host can dial: "localhost:PORT" or the unix one.
  std::string client_address() const;
  VariableStore& store() { return *store_; }

  // Stops accepting calls, lets calls in flight finish for up to `grace`,
  // then cancels them. Idempotent: a call from another thread meanwhile (or
  // the destructor) waits for the first one to finish.
  void Shutdown(absl::Duration grace = absl::Seconds(5));
  // Blocks until the server has shut down.
  void Wait();

 private:
  class Service;
  PsServer() = default;
  PsServerOptions options_;
  std::unique_ptr<VariableStore> store_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  absl::once_flag shutdown_once_;
};

}  // namespace psflow::server

#endif  // PSFLOW_PS_SERVER_GRPC_PS_SERVER_H_
