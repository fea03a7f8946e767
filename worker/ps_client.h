// PsClient: what a worker needs from the parameter servers, independent of
// the transport. grpc_ps_client.h talks to real shards over gRPC.
#ifndef PSFLOW_WORKER_PS_CLIENT_H_
#define PSFLOW_WORKER_PS_CLIENT_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/partition_plan.h"
#include "psflow.pb.h"

namespace psflow::worker {

struct PullResult {
  int64_t min_version = 0;  // smallest part version read
  int64_t max_version = 0;  // largest part version read
};

// What a registration found, summed over the shards.
struct RegisterResult {
  int parts_created = 0;  // registered now, with the given initial values
  int parts_kept = 0;     // already there (a restarted chief): their values stay
  // Some shard's registration was retried: parts that an attempt whose
  // reply was lost created count as kept.
  bool retried = false;
};

// Push's and PushPull's INTERNAL error "gRPC still holds part of the
// gradient" carries this payload (see Push): the caller must then neither
// free nor change the gradient while the process runs.
inline constexpr char kGradientStillHeldPayload[] = "type.psflow.dev/GradientStillHeld";
inline bool GradientStillHeld(const absl::Status& status) {
  return status.GetPayload(kGradientStillHeldPayload).has_value();
}

struct PushInfo {
  int64_t step = 0;          // the worker's step
  int64_t read_version = 0;  // version the gradient was computed from
};

// Every call works on all shards in parallel and returns when all are done;
// partitioned variables are split and re-assembled here. Thread safety: Pull
// and Push may run concurrently with each other (prefetching the next pull
// while pushing), but not two Pulls or two Pushes at once. Register and
// WaitForVariables run before them (they may fit the client's messages to
// what the shards accept), not while any other call runs.
class PsClient {
 public:
  virtual ~PsClient() = default;
  virtual const PartitionPlan& plan() const = 0;

  // Registers every variable of the plan with its initial values
  // (`initial_values[i]` holds variable i). Idempotent: variables already on
  // the shards keep their values. Done by the chief (or worker 0).
  virtual absl::StatusOr<RegisterResult> Register(
      absl::Span<const float* const> initial_values) = 0;
  // Waits until every part of the plan is registered on its shard (the other
  // workers wait for the chief this way). DEADLINE_EXCEEDED after `timeout`.
  // `waiting`, where given, hears what is still missing about every 10 s
  // of waiting (not at once: the chief usually registers within seconds;
  // GrpcPsClientOptions::waiting_report_interval).
  using WaitingFn = std::function<void(absl::Duration waited, absl::string_view missing)>;
  virtual absl::Status WaitForVariables(absl::Duration timeout,
                                        const WaitingFn& waiting = nullptr) = 0;
  // Reads every variable into `values[i]` (caller-owned, num_elements floats).
  virtual absl::StatusOr<PullResult> Pull(absl::Span<float* const> values) = 0;
  // Sends one gradient of every variable (`grads[i]` for variable i); each
  // shard applies its optimizer. A retry after a transient failure reuses
  // the request id, so the update is applied exactly once. `grads` are
  // read until the call returns and are free after it, whatever it
  // returned, but for an INTERNAL error saying they are still in use (the
  // gRPC client sends them where they lie, without a copy, and waits until
  // gRPC holds none of them before it returns).
  // An error other than a refusal before anything was sent (INVALID_ARGUMENT
  // for a NaN/Inf found by the client, a wrong tensor count) may leave the
  // update applied on some shards, or on part of one: the shards that did
  // not fail applied their share, and a failed shard keeps what reached it
  // (PROTOCOL.md, "Errors"). A new Push of the same gradient would be a
  // second update, not a retry: the caller should treat the step as lost or
  // done, not send it again.
  virtual absl::Status Push(absl::Span<const float* const> grads, const PushInfo& info) = 0;
  // Push followed by a pull in one call per shard: sends `grads` as Push
  // does and fills `values[i]` with every variable's values right after
  // this push was applied to them (each shard answers every message of the
  // push as soon as it has applied it, so the gradient and the new values
  // cross at once). Counts as a Push and a Pull for the rule below. An
  // error leaves the update as a failed Push does, and `values` undefined.
  // `values` and `grads` must not share memory: a retry re-sends `grads`
  // after the first attempt wrote values (INVALID_ARGUMENT where they do).
  virtual absl::StatusOr<PullResult> PushPull(absl::Span<const float* const> grads,
                                              const PushInfo& info,
                                              absl::Span<float* const> values) = 0;
  // Each shard's status, in shard order, with the first page of its parts
  // (StatusRequest: up to 3 MiB of them; num_parts counts them all).
  // Retries as every call does, but starts no attempt after `deadline` and
  // ends each by it (a chief waiting for its shards stops when its own wait
  // is over).
  virtual absl::StatusOr<std::vector<StatusResponse>> GetStatus(absl::Time deadline) = 0;
  absl::StatusOr<std::vector<StatusResponse>> GetStatus() {
    return GetStatus(absl::InfiniteFuture());
  }
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_PS_CLIENT_H_
