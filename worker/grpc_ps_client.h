// The gRPC PsClient: one channel per PS shard (or several, see
// streams_per_shard), every call with a deadline,
// transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, and a CANCELLED that
// the shard caused: FromServerStatus) retried with capped exponential
// backoff and jitter.
#ifndef PSFLOW_WORKER_GRPC_PS_CLIENT_H_
#define PSFLOW_WORKER_GRPC_PS_CLIENT_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/grpc_args.h"
#include "common/retry.h"
#include "common/variable_spec.h"
#include "worker/ps_client.h"

namespace psflow::worker {

// Told of a retry of a call to a shard (GrpcPsClientOptions::retrying):
// the call ("Push", "Pull", ...), the status its last attempt failed with
// (naming the shard), the attempt to come, the most there may be, and the
// wait before it.
using RetryingFn = std::function<void(absl::string_view call, const absl::Status& failed,
                                      int next_attempt, int max_attempts, absl::Duration wait)>;

// What a push's retry window keeps inside request_id_retention less
// rpc_timeout (GrpcPsClientOptions::request_id_retention).
inline constexpr absl::Duration kPushRetryRetentionMargin = absl::Seconds(1);

struct GrpcPsClientOptions {
  std::vector<std::string> ps_addresses;  // shard i at ps_addresses[i]; "host:port" or "unix:path"
  int worker_id = 0;
  int64_t min_split_bytes = 256 * 1024;   // partition plan threshold; same on every process
  // What the model computes (worker/model ModelFingerprint): sent in the
  // registration and compared with the shards' in WaitForVariables, so that
  // a worker whose layers or data differ only where the variables' shapes
  // do not show it is refused. 0: not checked.
  uint64_t model_fingerprint = 0;
  // Bytes per stream message at most, tensor data and framing (a message
  // carries one element at least). A shard whose own limit is smaller
  // (its --max_chunk_bytes, in GetStatus) gets messages of that size once
  // the client has registered or waited for the variables.
  int64_t max_chunk_bytes = 1 << 20;
  absl::Duration rpc_timeout = absl::Seconds(60);  // deadline of each call
  RetryOptions retry;
  // Told of the retries of calls to the shards, so that a user whose shard
  // went away hears of it while the client retries (for about 16 s against
  // a refused connection, at the default retry options) rather than only
  // when it gives up. The first retry of a shard's calls is told, then at
  // most one every retry_report_interval for that shard (0: every one).
  // Not told: GetStatus's retries (WaitForShards' callers say what they
  // wait for). A retry is told before its wait; one whose wait runs past
  // the retry window is then not made, and the call ends with its error.
  // It may be called from several threads at once (one per shard of a
  // call, and a Push and a Pull may run together): it must be thread-safe,
  // and must not call the client.
  RetryingFn retrying;
  absl::Duration retry_report_interval = absl::Seconds(5);
  // How often WaitForVariables tells its `waiting` what is still missing
  // (first after this much waiting).
  absl::Duration waiting_report_interval = absl::Seconds(10);
  // How long the ps shards remember a push's request id (their
  // --request_id_retention_s). A push is retried only while that is sure to
  // hold: no retry starts later than request_id_retention less rpc_timeout
  // (and a second's margin) after the push began (the retry's messages
  // reach the shard within its deadline), so no retried push is applied
  // twice, as long as the shard
  // keeps ids that long (it forgets them early, and says so, only beyond
  // its --request_ledger_bytes: at the defaults, past about 160 pushes a
  // second). With the defaults (15 minutes, 60 s) this never cuts the
  // retries short: ten attempts of a whole deadline each, with their
  // backoff, take about 10.5 minutes. Once the client has heard the shards'
  // own retention (GetStatus, when it registers or waits for the
  // variables), it keeps to the shortest of theirs where that is shorter.
  absl::Duration request_id_retention = absl::Minutes(15);
  // Refuse to push NaN/Inf (before anything is sent), unless every shard
  // holding parts of the model applies them (its --allow_non_finite_gradients,
  // learned from GetStatus when the client registers or waits for the
  // variables, or at the first such gradient).
  bool check_finite = true;
  // Connections per shard that a Push or PushPull is split over: each
  // carries a contiguous share of the shard's messages on its own HTTP/2
  // connection (so the shard receives them on separate threads), all with
  // the same request id. 1 sends each push as one stream; see
  // AutoStreamsPerShard for what the worker picks by default.
  int streams_per_shard = 1;
  // Each connection is pinged every keepalive_time while it has calls and
  // closed when a ping goes keepalive_timeout unanswered; gRPC also sets the
  // socket's TCP_USER_TIMEOUT to keepalive_timeout, so the kernel closes it
  // when its writes make no progress that long (zero window included). Its
  // calls end UNAVAILABLE. A call's deadline does not end a write the
  // socket does not take: without keepalive a push to a shard that stopped
  // reading (a frozen process or machine, whose kernel still acknowledges)
  // hung as long as the shard did. Shards accept a ping every 10 s
  // (PsServerOptions::min_client_ping_interval).
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // The longest a connection that failed waits before gRPC tries again
  // (grpc.max_reconnect_backoff_ms), as TensorFlow sets it: gRPC's own 120 s
  // let a chief whose shard started 90 s after it wait 34 s more for it
  // (the waits grow 1.6x from 1 s), and calls in the meantime fail at once.
  absl::Duration max_reconnect_backoff = absl::Seconds(1);
  // Checks that a shard's host name resolves (HostToResolve) before the
  // client's status checks first use its channel: OK when it does, else why
  // not. gRPC tries a name that did not resolve again only after its own
  // backoff, which grows to 120 s and which no channel argument sets, and a
  // ps pod's name resolves only once the pod runs: a chief whose shard's
  // name resolved 60 s after it started went on 15 s after that. While the
  // name does not resolve, the check fails UNAVAILABLE saying so, and is
  // retried; the channel is first used once it resolves. Empty: getaddrinfo.
  std::function<absl::Status(const std::string& host)> resolve_host;
  // Extra gRPC channel arguments ("grpc.http2.write_buffer_size" and the
  // like; they override the settings above), for tuning experiments; a
  // value that parses as an integer is passed as one, else as a string.
  GrpcArgs grpc_args;
};

// Connections per shard for a worker on a machine with `cores` cores (0:
// unknown): 4 with 8 cores or more, where a shard receiving a push on
// several threads beats one connection (on the 16-core machine 1.13x raw
// TCP against 0.57x, docs/BENCHMARKS.md), else 1 (on 2 cores the client,
// the shards and the kernel's socket copies already share both cores, and
// more connections only add threads).
int AutoStreamsPerShard(int cores);

// The gRPC arguments of the client's channels to the shards: keepalive
// and reconnection from `options`, then its grpc_args, which win.
GrpcArgs ClientChannelArgs(const GrpcPsClientOptions& options);

// The host name of a shard's address that the client resolves before
// using its channel (GrpcPsClientOptions::resolve_host): the host of
// "host:port"; empty for an IPv4 or [IPv6] literal, "unix:path" and other
// gRPC target forms ("dns:///...", "ipv4:...").
std::string HostToResolve(absl::string_view address);

// One status for a call split over a shard's connections: the first error
// that a retry cannot cure, else a timeout (so that the retry loop counts
// the attempt as timed out: it waited a whole deadline for the slowest
// connection, whatever the others got quickly), else the first error, else
// OK.
absl::Status CombineStreamStatuses(absl::Span<const absl::Status> statuses);

// Slices of callers' gradients that gRPC references right now, over every
// gRPC PsClient of this process: 0 once every Push and PushPull has
// returned, whatever they returned, but for one that returned INTERNAL
// saying gRPC still holds its gradient. For tests and diagnostics.
int64_t PushSlicesInFlight();

absl::StatusOr<std::unique_ptr<PsClient>> CreateGrpcPsClient(std::vector<VariableSpec> variables,
                                                             const GrpcPsClientOptions& options);

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_GRPC_PS_CLIENT_H_
