#include "worker/grpc_ps_client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <system_error>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/random/random.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_args.h"
#include "common/grpc_status.h"
#include "common/grpc_wire.h"
#include "common/parallel_for.h"
#include "common/process_stats.h"
#include "common/status_macros.h"
#include "common/tensor_checks.h"
#include "grpc/support/time.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "psflow.grpc.pb.h"

namespace psflow::worker {
namespace {

// A registration header up to this size travels with the first values;
// a larger one is sent alone, in pieces of at most kHeaderPieceBytes
// (both well within the 1 MiB a shard accepts beyond --max_chunk_bytes,
// which a message's segment framing also uses).
constexpr size_t kHeaderWithValuesBytes = 256 << 10;
constexpr size_t kHeaderPieceBytes = 512 << 10;
// A pull request names at most about this much (BuildPullRequest).
constexpr size_t kPullRequestBytes = 512 << 10;

void AppendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Slices of callers' gradients that gRPC references now, in every client of
// the process (PushSlicesInFlight).
std::atomic<int64_t> g_push_slices{0};

// Counts the references gRPC holds to the gradient slices of one Push or
// PushPull (every shard, stream and attempt), so that it returns only once
// gRPC is done with the caller's memory. Created with one reference, its
// owner's; each slice adds one, dropped when gRPC lets go of the slice. `alive_` keeps the object
// until both the owner and every slice are done with it, so that an owner
// that gave up waiting leaves nothing dangling.
class GradientRefs {
 public:
  static GradientRefs* Create() { return new GradientRefs; }
  // A counted slice over `bytes` of the caller's memory at `data`.
  grpc::Slice Wrap(const float* data, size_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      g_push_slices.fetch_add(1, std::memory_order_relaxed);
      ++held_;
    }
    alive_.fetch_add(1, std::memory_order_relaxed);
    return grpc::Slice(const_cast<float*>(data), bytes, &GradientRefs::SliceDone, this);
  }
  // True once gRPC holds no slice, waiting up to `timeout` for it.
  bool AwaitNoSlices(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&GradientRefs::NoneHeld, &held_), timeout);
  }
  // Drops the owner's reference; the object must not be used after.
  void Release() { Unref(); }

 private:
  GradientRefs() = default;
  static bool NoneHeld(int* held) { return *held == 0; }
  static void SliceDone(void* self) {
    auto* refs = static_cast<GradientRefs*>(self);
    {
      absl::MutexLock lock(&refs->mu_);
      // Before the owner can see held_ at 0: PushSlicesInFlight() is 0 as
      // soon as the last push has returned.
      g_push_slices.fetch_sub(1, std::memory_order_relaxed);
      --refs->held_;
    }
    refs->Unref();  // after the last use of mu_
  }
  void Unref() {
    if (alive_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  absl::Mutex mu_;
  int held_ ABSL_GUARDED_BY(mu_) = 0;  // slices gRPC still references
  std::atomic<int> alive_{1};          // held_ + the owner's reference
};

// Builds PushRequest messages in protobuf's wire format as grpc::ByteBuffers
// whose data slices point at the caller's floats, so the gradient is not
// copied on the client (the generated code copies it into a string, then
// again into gRPC's slices). The slices are counted (GradientRefs) and a
// push returns only once gRPC has let go of all of them (ReleaseGradient),
// so the caller's gradient is free after the call whatever it returned.
// gRPC lets go of them when their bytes are written or the connection
// fails; a connection whose peer stopped reading fails by keepalive (see
// GrpcPsClientOptions::keepalive_time), since the call's deadline alone
// does not end a write the socket does not take. The bytes are exactly
// those the generated PushRequest would write; ps_cluster_test checks the
// server reads them.
class PushEncoder {
 public:
  explicit PushEncoder(GradientRefs* refs) : refs_(refs) {}
  void SetHeader(const PushHeader& header) {
    PushRequest only_header;
    *only_header.mutable_header() = header;
    meta_ = only_header.SerializeAsString();  // field 1, first in the message
  }
  void AddSegment(const std::string& variable, int64_t offset, const float* data, int64_t count) {
    Segment prefix;  // variable and offset; the data field is appended by hand
    prefix.set_variable(variable);
    prefix.set_offset(offset);
    std::string inner = prefix.SerializeAsString();
    const uint64_t bytes = static_cast<uint64_t>(count) * 4;
    inner.push_back(0x1a);  // Segment.data: field 3, length-delimited
    AppendVarint(&inner, bytes);
    meta_.push_back(0x12);  // PushRequest.segments: field 2, length-delimited
    AppendVarint(&meta_, inner.size() + bytes);
    meta_ += inner;
    slices_.emplace_back(meta_);
    meta_.clear();
    slices_.push_back(refs_->Wrap(data, bytes));
  }
  bool empty() const { return slices_.empty() && meta_.empty(); }
  // Moves what was added into `out` and starts a new message.
  void Take(grpc::ByteBuffer* out) {
    if (!meta_.empty()) slices_.emplace_back(meta_);
    grpc::ByteBuffer buffer(slices_.data(), slices_.size());
    out->Swap(&buffer);
    slices_.clear();
    meta_.clear();
  }

 private:
  GradientRefs* const refs_;         // counts the data slices
  std::string meta_;                 // encoded bytes not yet in a slice
  std::vector<grpc::Slice> slices_;  // the message so far
};

// What every call of one push sends in its header besides the worker id.
struct PushCall {
  PushInfo info;
  uint64_t request_id = 0;        // one per logical push and shard, kept across retries
  bool gradient_checked = false;  // the whole gradient was found finite (CheckFinite)
};

// Runs fn(i) for i in [0, n) in parallel (ParallelFor) and returns their
// statuses.
std::vector<absl::Status> RunInParallel(int n, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> results(n);
  ParallelFor(n, [&](int i) { results[i] = fn(i); });
  return results;
}

// Runs fn(shard) for every shard, in parallel, and returns the first error.
absl::Status ForEachShard(int num_shards, const std::function<absl::Status(int)>& fn) {
  for (const absl::Status& status : RunInParallel(num_shards, fn)) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

class GrpcPsClient final : public PsClient {
 public:
  GrpcPsClient(PartitionPlan plan, const GrpcPsClientOptions& options)
      : plan_(std::move(plan)),
        options_(options),
        scan_threads_(std::clamp<int>(UsableCores(), 1, kMaxScanThreads)),
        push_retry_(std::make_shared<const RetryOptions>(
            PushRetryOptions(options, options.request_id_retention, ""))),
        shards_(plan_.num_shards()),
        last_retry_report_(plan_.num_shards()) {
    for (int s = 0; s < plan_.num_shards(); ++s) {
      Shard& shard = shards_[s];
      shard.name = absl::StrCat("ps shard ", s, " (", options_.ps_addresses[s], ")");
      shard.host = HostToResolve(options_.ps_addresses[s]);
      shard.conns.resize(options_.streams_per_shard);  // 1 to 64, checked at creation
      for (size_t k = 0; k < shard.conns.size(); ++k) {
        Connection& c = shard.conns[k];
        grpc::ChannelArguments args;
        args.SetMaxReceiveMessageSize(-1);
        args.SetMaxSendMessageSize(-1);
        AddGrpcArgs(ClientChannelArgs(options_), &args);
        if (shard.conns.size() > 1) {
          // A subchannel pool of its own, so that each channel opens its own
          // connection instead of sharing one with the shard's other channels.
          args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
          args.SetInt("psflow.connection_index", static_cast<int>(k));
        }
        c.channel = grpc::CreateCustomChannel(options_.ps_addresses[s],
                                              grpc::InsecureChannelCredentials(), args);
        c.push_method = std::make_unique<grpc::internal::RpcMethod>(
            "/psflow.ParameterServer/Push", grpc::internal::RpcMethod::CLIENT_STREAMING,
            c.channel);
        c.push_pull_method = std::make_unique<grpc::internal::RpcMethod>(
            "/psflow.ParameterServer/PushPull", grpc::internal::RpcMethod::BIDI_STREAMING,
            c.channel);
        c.pull_method = std::make_unique<grpc::internal::RpcMethod>(
            "/psflow.ParameterServer/Pull", grpc::internal::RpcMethod::SERVER_STREAMING,
            c.channel);
      }
      shard.channel = shard.conns[0].channel;
      shard.stub = ParameterServer::NewStub(shard.channel);
      shard.parts = plan_.PartsOnShard(s);
      for (int p : shard.parts) {
        const Part& part = plan_.parts()[p];
        shard.by_name.emplace(plan_.variables()[part.variable_index].name, p);
      }
      PlanShardMessages(s, options_.max_chunk_bytes);
    }
  }

  // Cuts shard s's registration and push into messages of at most
  // `chunk_bytes` each, framing included, and its pulls over several
  // connections into the same shares.
  void PlanShardMessages(int s, int64_t chunk_bytes) {
    Shard& shard = shards_[s];
    shard.chunk_bytes = chunk_bytes;
    shard.messages = PlanMessages(shard.parts, chunk_bytes);
    for (int k = 0; k < NumStreams(s); ++k) BuildPullRequest(s, k);
  }

  // Sends shard s messages no larger than it accepts (its --max_chunk_bytes,
  // which `status` reports), where that is less than this client's own
  // limit, instead of having them refused. Called by Register and
  // WaitForVariables, which run before any Push or Pull (PsClient), so no
  // call uses the plan while it changes.
  void FitMessagesToShard(int s, const StatusResponse& status) {
    int64_t chunk = options_.max_chunk_bytes;
    shards_[s].told_chunk_limit = status.max_chunk_bytes() > 0;  // 0: a shard that does not say
    if (shards_[s].told_chunk_limit) {
      chunk = std::min(chunk, std::max<int64_t>(4, status.max_chunk_bytes() / 4 * 4));
    }
    if (chunk != shards_[s].chunk_bytes) PlanShardMessages(s, chunk);
  }

  // Connection k's pull of shard s: every part on one connection, else the
  // elements of its share of the shard's messages, as ranges. A share that
  // names more than kPullRequestBytes' worth (some thousands of parts) is
  // asked for in several requests, one after another, as a shard takes a
  // request of at most 1 MiB beyond its --max_chunk_bytes.
  void BuildPullRequest(int s, int k) {
    Shard& shard = shards_[s];
    Connection& conn = shard.conns[k];
    conn.pull_requests.clear();
    conn.pull_elements = 0;
    size_t bytes = 0;  // in the last request
    // The request to add an entry of about `entry_bytes` to.
    auto request_for = [&](size_t entry_bytes) -> PullRequest& {
      if (conn.pull_requests.empty() || (bytes > 0 && bytes + entry_bytes > kPullRequestBytes)) {
        PullRequest& request = conn.pull_requests.emplace_back();
        request.set_worker_id(options_.worker_id);
        request.set_max_chunk_bytes(shard.chunk_bytes);
        request.set_shard_incarnation(shard.incarnation);
        bytes = 0;
      }
      bytes += entry_bytes;
      return conn.pull_requests.back();
    };
    if (NumStreams(s) == 1) {
      // Every part by name (not the empty list, which means all the shard
      // holds): a shard that lost a part answers NOT_FOUND naming it, and
      // the parts of another model on the same shard are not sent.
      for (int p : shard.parts) {
        const std::string& name = plan_.variables()[plan_.parts()[p].variable_index].name;
        request_for(name.size() + 6).add_variables(name);  // tag, length (<= 5), name
      }
      conn.pull_elements = ShardElements(s);
      return;
    }
    const auto [begin, end] = StreamShare(s, k);
    for (size_t i = begin; i < end; ++i) {
      for (const SegmentRef& seg : shard.messages[i]) {
        const std::string& name = plan_.variables()[plan_.parts()[seg.part].variable_index].name;
        PullRange* last = conn.pull_requests.empty() || conn.pull_requests.back().ranges().empty()
                              ? nullptr
                              : conn.pull_requests.back().mutable_ranges(
                                    conn.pull_requests.back().ranges_size() - 1);
        if (last != nullptr && last->variable() == name &&
            last->offset() + last->count() == seg.offset) {
          last->set_count(last->count() + seg.count);  // the same part, continued
        } else {
          // Tag and length, the name's, two int64 fields: at most 34 and the name.
          PullRange* range = request_for(name.size() + 34).add_ranges();
          range->set_variable(name);
          range->set_offset(seg.offset);
          range->set_count(seg.count);
        }
        conn.pull_elements += seg.count;
      }
    }
  }

  const PartitionPlan& plan() const override { return plan_; }

  absl::StatusOr<RegisterResult> Register(absl::Span<const float* const> initial_values) override {
    PSFLOW_RETURN_IF_ERROR(CheckTensors(initial_values, "Register", "initial values"));
    std::vector<RegisterResponse> responses(plan_.num_shards());
    std::vector<StatusResponse> statuses(plan_.num_shards());
    std::atomic<bool> retried{false};
    // A shard that restarts while the model is registered (found by a retry
    // here, or refused by the shard, whose incarnation the registration
    // names) makes the whole registration start again, from every shard's
    // state: the check below must see it. A few times at most.
    for (int round = 1;; ++round) {
      // Every shard's state first: what it holds, how large a message it
      // takes, and which start of it this is.
      const absl::Status answered = ForEachShard(plan_.num_shards(), [&](int s) {
        return RetryOnShard(s, "GetStatus", options_.retry,
                            [&] { return StatusOnce(s, &statuses[s]); });
      });
      if (!answered.ok()) return FirstIdentityProblem(statuses, answered);
      PSFLOW_RETURN_IF_ERROR(CheckShardIdentities(statuses));
      PSFLOW_RETURN_IF_ERROR(CheckNoShardLostTrainedModel(statuses));
      LearnIncarnations(statuses);
      const absl::Status registered = ForEachShard(plan_.num_shards(), [&](int s) {
        int sent = 0;  // registrations sent to the shard
        return RetryOnShard(s, "RegisterVariables", options_.retry, [&] {
          // How large a message the shard takes, before sending it any
          // (again on a retry), and whether it is still the one checked.
          if (sent > 0) {
            PSFLOW_RETURN_IF_ERROR(StatusOnce(s, &statuses[s]));
            if (statuses[s].incarnation() != shards_[s].incarnation) {
              return absl::AbortedError(
                  absl::StrCat(shards_[s].name, " restarted while the model was registered"));
            }
          }
          FitMessagesToShard(s, statuses[s]);
          if (++sent > 1) retried = true;
          return RegisterOnce(s, initial_values, &responses[s]);
        });
      });
      if (registered.ok()) break;
      // Did a shard restart meanwhile? Then look at every shard again.
      auto now = GetStatusOnce(absl::Now() + options_.rpc_timeout);
      bool restarted = false;
      for (int s = 0; now.ok() && s < plan_.num_shards(); ++s) {
        restarted |= (*now)[s].incarnation() != shards_[s].incarnation;
      }
      if (!restarted || round == 3) return registered;
    }
    // What the shards accept, from the same answers: a registered model
    // always leaves the client knowing how long its pushes may be retried.
    // (A status call of its own after the registration could fail, and the
    // client then retried pushes on its own retention, past a shorter one
    // of a shard, which applied them twice.)
    LearnShardPolicies(statuses);
    RegisterResult result;
    result.retried = retried;
    for (const RegisterResponse& r : responses) {
      result.parts_created += r.parts_created();
      result.parts_kept += r.parts_kept();
    }
    return result;
  }

  absl::Status WaitForVariables(absl::Duration timeout,
                                const WaitingFn& waiting = nullptr) override {
    const absl::Time start = absl::Now(), deadline = start + timeout;
    absl::Time next_report = start + options_.waiting_report_interval;
    Backoff backoff(options_.retry);
    absl::Status previous;  // what the attempt before this one found missing
    std::vector<StatusResponse> earlier;  // the last round's answers, where all came
    while (true) {
      absl::Status missing = absl::OkStatus();
      // At least one check, with a second to answer, however short the wait.
      auto statuses = GetStatusOnce(std::max(deadline, absl::Now() + absl::Seconds(1)));
      if (!statuses.ok()) {
        missing = statuses.status();
      } else {
        PSFLOW_RETURN_IF_ERROR(CheckShardIdentities(*statuses));
        // Every shard is looked at: one of another model after one that
        // misses its parts is named, not waited for.
        for (int s = 0; s < plan_.num_shards(); ++s) {
          const StatusResponse& r = (*statuses)[s];
          if (r.plan_fingerprint() != 0 && r.plan_fingerprint() != plan_.fingerprint()) {
            return absl::FailedPreconditionError(absl::StrFormat(
                "%s holds variables of another partition plan (fingerprint %016x, this worker's "
                "is %016x): every process must use the same model and number of ps shards",
                shards_[s].name, r.plan_fingerprint(), plan_.fingerprint()));
          }
          if (r.model_fingerprint() != 0 && options_.model_fingerprint != 0 &&
              r.model_fingerprint() != options_.model_fingerprint) {
            return absl::FailedPreconditionError(absl::StrFormat(
                "%s holds a model of fingerprint %016x, this worker's is %016x: the layers' "
                "settings (activations, padding, strides) or the data set differ; every "
                "process must use the same --model and --dataset",
                shards_[s].name, r.model_fingerprint(), options_.model_fingerprint));
          }
          // A shard that pages its parts counts them all in num_parts; an
          // older one lists them all.
          const int64_t held = std::max<int64_t>(r.num_parts(), r.parts_size());
          if (held < static_cast<int64_t>(shards_[s].parts.size()) && missing.ok()) {
            missing = absl::UnavailableError(
                absl::StrCat(shards_[s].name, " holds ", held, " of its ", shards_[s].parts.size(),
                             " variables; is the chief (the \"chief\" task, else worker 0) running "
                             "and registering the model?"));
          }
        }
      }
      // A shard that lacks its parts now while another held trained ones in
      // the round before restarted and lost them: no chief will register
      // them again (it is refused so), so waiting would end only at the
      // timeout, blaming the chief.
      if (!missing.ok() && statuses.ok()) {
        if (!earlier.empty()) {
          PSFLOW_RETURN_IF_ERROR(CheckNoShardLostTrainedModel(*statuses, earlier));
        }
        earlier = *statuses;
      }
      if (missing.ok()) {
        LearnShardPolicies(*statuses);
        LearnIncarnations(*statuses);
        for (int s = 0; s < plan_.num_shards(); ++s) FitMessagesToShard(s, (*statuses)[s]);
        return absl::OkStatus();
      }
      if (!IsRetryable(missing)) return missing;
      if (absl::Now() >= deadline) {
        // The last attempt ran into the deadline itself, on whichever shard
        // came first; the one before says what was missing.
        const absl::Status& why =
            absl::IsDeadlineExceeded(missing) && !previous.ok() ? previous : missing;
        return absl::DeadlineExceededError(absl::StrCat("variables were not registered within ",
                                                        absl::FormatDuration(timeout), ": ",
                                                        why.message()));
      }
      previous = missing;
      if (waiting && absl::Now() >= next_report) {
        waiting(absl::Now() - start, missing.message());
        next_report = absl::Now() + options_.waiting_report_interval;
      }
      WatchChannels(std::min(backoff.Next(), deadline - absl::Now()), /*only_shard=*/-1);
    }
  }

  absl::StatusOr<PullResult> Pull(absl::Span<float* const> values) override {
    PSFLOW_RETURN_IF_ERROR(CheckTensors(values, "Pull", "output buffer"));
    std::vector<PullResult> results(plan_.num_shards());
    PSFLOW_RETURN_IF_ERROR(ForEachShard(plan_.num_shards(), [&](int s) {
      // Nothing to read there (an empty request would read all it holds).
      if (shards_[s].parts.empty()) return absl::OkStatus();
      return RetryOnShard(s, "Pull", options_.retry, [&] {
        std::vector<PullResult> parts(NumStreams(s));
        PSFLOW_RETURN_IF_ERROR(ForEachStream(s, [&](int k, size_t, size_t, absl::Time deadline) {
          return PullOnce(s, k, deadline, values, &parts[k]);
        }));
        results[s] = CombineStreams(parts);
        return absl::OkStatus();
      });
    }));
    return Combine(results);
  }

  static PullResult CombineStreams(const std::vector<PullResult>& parts) {
    PullResult out = parts[0];
    for (size_t k = 1; k < parts.size(); ++k) {
      out.min_version = std::min(out.min_version, parts[k].min_version);
      out.max_version = std::max(out.max_version, parts[k].max_version);
    }
    return out;
  }

  // The versions read from every shard that holds parts.
  PullResult Combine(const std::vector<PullResult>& results) const {
    PullResult out;
    bool first = true;
    for (int s = 0; s < plan_.num_shards(); ++s) {
      if (shards_[s].parts.empty()) continue;
      out.min_version = first ? results[s].min_version
                              : std::min(out.min_version, results[s].min_version);
      out.max_version = first ? results[s].max_version
                              : std::max(out.max_version, results[s].max_version);
      first = false;
    }
    return out;
  }

  absl::Status Push(absl::Span<const float* const> grads, const PushInfo& info) override {
    PSFLOW_RETURN_IF_ERROR(CheckTensors(grads, "Push", "gradient"));
    PSFLOW_ASSIGN_OR_RETURN(const bool checked, CheckFinite(grads));
    const std::shared_ptr<const RetryOptions> push_retry = PushRetry();
    GradientRefs* refs = GradientRefs::Create();
    const absl::Status status = ForEachShard(plan_.num_shards(), [&](int s) {
      if (shards_[s].parts.empty()) return absl::OkStatus();
      // One id per logical push and shard, kept across retries.
      const uint64_t request_id = NewRequestId();
      return RetryOnShard(s, "Push", *push_retry, [&] {
        return ForEachStream(s, [&](int k, size_t begin, size_t end, absl::Time deadline) {
          return PushOnce(s, k, begin, end, deadline, grads, {info, request_id, checked}, refs);
        });
      });
    });
    ForgetAllowAfterRefusal(status);
    return ReleaseGradient(refs, status);
  }

  absl::StatusOr<PullResult> PushPull(absl::Span<const float* const> grads, const PushInfo& info,
                                      absl::Span<float* const> values) override {
    PSFLOW_RETURN_IF_ERROR(CheckTensors(grads, "PushPull", "gradient"));
    PSFLOW_RETURN_IF_ERROR(CheckTensors(values, "PushPull", "output buffer"));
    PSFLOW_RETURN_IF_ERROR(CheckSeparate(grads, values));
    PSFLOW_ASSIGN_OR_RETURN(const bool checked, CheckFinite(grads));
    const std::shared_ptr<const RetryOptions> push_retry = PushRetry();
    std::vector<PullResult> results(plan_.num_shards());
    GradientRefs* refs = GradientRefs::Create();
    const absl::Status status = ForEachShard(plan_.num_shards(), [&](int s) {
      if (shards_[s].parts.empty()) return absl::OkStatus();
      const uint64_t request_id = NewRequestId();
      return RetryOnShard(s, "PushPull", *push_retry, [&] {
        const int streams = NumStreams(s);
        std::vector<PullResult> parts(streams);
        std::vector<int64_t> received(streams, 0);
        PSFLOW_RETURN_IF_ERROR(
            ForEachStream(s, [&](int k, size_t begin, size_t end, absl::Time deadline) {
              return PushPullOnce(s, k, begin, end, deadline, grads, {info, request_id, checked},
                                  refs, values, &parts[k], &received[k]);
            }));
        int64_t total = 0;
        for (int k = 0; k < streams; ++k) total += received[k];
        PSFLOW_RETURN_IF_ERROR(CheckReceived(s, total, ShardElements(s)));
        results[s] = CombineStreams(parts);
        return absl::OkStatus();
      });
    });
    ForgetAllowAfterRefusal(status);
    PSFLOW_RETURN_IF_ERROR(ReleaseGradient(refs, status));
    return Combine(results);
  }

  using PsClient::GetStatus;
  absl::StatusOr<std::vector<StatusResponse>> GetStatus(absl::Time deadline) override {
    RetryOptions retry = options_.retry;
    if (deadline - absl::Now() < retry.retry_window) {
      retry.retry_window = std::max(absl::ZeroDuration(), deadline - absl::Now());
      retry.window_reason = "past this status check's deadline";
    }
    std::vector<StatusResponse> out(plan_.num_shards());
    const absl::Status answered = ForEachShard(plan_.num_shards(), [&](int s) {
      return RetryOnShard(s, "GetStatus", retry,
                          [&] { return StatusOnce(s, &out[s], deadline, /*page_size=*/0); });
    });
    if (!answered.ok()) return FirstIdentityProblem(out, answered);
    return out;
  }

 private:
  // Spends `wait` (a retry's backoff) watching the channels of shard
  // `only_shard` (-1: of every shard), asking each to connect. A client
  // that slept instead left a broken connection to gRPC: its reconnection
  // attempts went on, but nothing polled for their outcome until a call
  // did, and calls failed at once meanwhile with the last error (the
  // channel in TRANSIENT_FAILURE). With several connections to a shard, a
  // 0.3 s outage made every retry of a push fail with "Connection refused"
  // while the shard had been listening again for 16 s, and the worker gave
  // up. Watching polls the channels, so that a reconnection completes
  // while the client waits.
  void WatchChannels(absl::Duration wait, int only_shard) {
    // On the monotonic clock: a wall clock set back meanwhile would make a
    // push's retry wait past the window in which the shard remembers it.
    const gpr_timespec deadline =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                     gpr_time_from_micros(absl::ToInt64Microseconds(wait), GPR_TIMESPAN));
    grpc::CompletionQueue cq;
    int pending = 0;
    const auto watch = [&](grpc::Channel* channel) {
      channel->NotifyOnStateChange(channel->GetState(/*try_to_connect=*/true), deadline, &cq,
                                   channel);
      ++pending;
    };
    for (int s = 0; s < plan_.num_shards(); ++s) {
      if (only_shard >= 0 && s != only_shard) continue;
      // Not a channel whose host name has not resolved: asked to connect,
      // gRPC would try the name and, failing, wait its own backoff of up
      // to 120 s before trying again (HostResolves).
      if (!shards_[s].host.empty() && !shards_[s].host_resolved.load()) continue;
      for (Connection& c : shards_[s].conns) watch(c.channel.get());
    }
    if (pending == 0) absl::SleepFor(wait);  // nothing to watch: wait all the same
    void* tag;
    bool changed;
    // A watch ends with `changed` when its channel's state moved, else at
    // the deadline; each moved one is watched again until the deadline.
    while (pending > 0 && cq.Next(&tag, &changed)) {
      --pending;
      if (changed && gpr_time_cmp(gpr_now(GPR_CLOCK_MONOTONIC), deadline) < 0) {
        watch(static_cast<grpc::Channel*>(tag));
      }
    }
    cq.Shutdown();
    while (cq.Next(&tag, &changed)) {
    }
  }

  // RetryCall for `call` to shard s, each backoff spent watching the
  // shard's channels, its retries told to options_.retrying.
  absl::Status RetryOnShard(int s, absl::string_view call, const RetryOptions& options,
                            const std::function<absl::Status()>& attempt) {
    RetryObserver observe;
    // Not a status check's: a worker waiting for its shards to start says
    // so itself, every 10 s, and a shard not yet up is no failure.
    if (options_.retrying && call != "GetStatus") {
      observe = [this, s, call](const absl::Status& failed, int next, int most,
                                absl::Duration wait) {
        if (TakeRetryReport(s)) options_.retrying(call, failed, next, most, wait);
      };
    }
    return RetryCall(
        options, attempt, [this, s](absl::Duration wait) { WatchChannels(wait, s); }, observe);
  }

  // Whether a retry of shard s's calls is to be told now: the first is,
  // then one every retry_report_interval at most (calls to the shard that
  // fail together, a push and a pull at once or the calls of several
  // steps, each retry).
  bool TakeRetryReport(int s) {
    absl::MutexLock lock(&report_mu_);
    // A clock that no time adjustment moves (a wall clock set back would
    // silence the reports for as long).
    const auto now = std::chrono::steady_clock::now();
    std::optional<std::chrono::steady_clock::time_point>& last = last_retry_report_[s];
    if (last.has_value() && absl::FromChrono(now - *last) < options_.retry_report_interval) {
      return false;
    }
    last = now;
    return true;
  }

  // One received Pull message: its slices (references, no copy) and the
  // decoded segments pointing into them.
  struct PullBuffers {
    grpc::ByteBuffer buffer;
    std::vector<grpc::Slice> slices;
    std::vector<absl::string_view> pieces;
    wire::DecodedMessage msg;
  };

  // One connection to a shard, carrying one stream of a push.
  struct Connection {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<grpc::internal::RpcMethod> push_method;  // Push with ByteBuffer messages
    std::unique_ptr<grpc::internal::RpcMethod> push_pull_method;  // PushPull, ByteBuffers
    std::unique_ptr<grpc::internal::RpcMethod> pull_method;  // Pull with ByteBuffer messages
    PullBuffers push_pull_in;  // reused across calls
    PullBuffers pull_in;
    // This connection's share of a pull (built once: no allocation per
    // pull; one request, or more for a share of many thousand parts) and
    // the elements it brings.
    std::vector<PullRequest> pull_requests;
    int64_t pull_elements = 0;
  };

  // A run of one part's elements in a stream message.
  struct SegmentRef {
    int part;  // index into plan_.parts()
    int64_t offset;
    int64_t count;
  };

  // A host name lookup on its own thread (HostResolves).
  struct HostLookup {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    absl::Status result ABSL_GUARDED_BY(mu);
  };

  struct Shard {
    std::string name;
    // The host name to resolve before the status checks first use the
    // channel (HostToResolve; empty: none), and whether it has resolved.
    std::string host;
    std::atomic<bool> host_resolved{false};
    absl::Mutex lookup_mu;
    std::shared_ptr<HostLookup> lookup ABSL_GUARDED_BY(lookup_mu);  // the one in flight
    std::shared_ptr<grpc::Channel> channel;  // conns[0]'s: Register, Pull, GetStatus
    std::unique_ptr<ParameterServer::Stub> stub;
    std::vector<Connection> conns;                 // streams_per_shard of them
    std::vector<int> parts;                        // indices into plan_.parts()
    absl::flat_hash_map<std::string, int> by_name;  // variable name -> part index
    // The shard's stream messages (registration, push): at most
    // chunk_bytes each, framing included (PlanMessages), big parts spanning
    // messages and small ones sharing one. A push or pull over several
    // connections gives each a contiguous share.
    // chunk_bytes is the client's max_chunk_bytes, or the shard's where
    // that is smaller (FitMessagesToShard).
    int64_t chunk_bytes = 0;
    bool told_chunk_limit = false;  // the shard reported its limit
    // The shard's StatusResponse.incarnation as Register or WaitForVariables
    // found it, sent back in every push and pull so that a shard that
    // restarted since (and lost its variables) refuses them; 0: unknown.
    uint64_t incarnation = 0;
    std::vector<std::vector<SegmentRef>> messages;
  };

  // Messages of at most chunk_bytes, framing included: each segment's
  // prefix (tag, length, name, offset, the data's tag and length) counts
  // with its data, and every message keeps room for a push header. So a
  // model of many tiny variables is not sent in messages several times
  // chunk_bytes, past the shard's receive limit. A message holds at least
  // one element (chunk_bytes is at least 4).
  std::vector<std::vector<SegmentRef>> PlanMessages(const std::vector<int>& parts,
                                                    int64_t chunk_bytes) const {
    constexpr int64_t kPushHeaderRoom = 64;  // PushRequest.header at its longest (57 bytes)
    std::vector<std::vector<SegmentRef>> messages(1);
    int64_t used = kPushHeaderRoom;
    for (int p : parts) {
      const Part& part = plan_.parts()[p];
      const std::string& name = plan_.variables()[part.variable_index].name;
      const int64_t n = part.num_elements();
      for (int64_t offset = 0; offset < n;) {
        const int64_t left = n - offset;
        // The prefix grows with the data's length: the longest this
        // segment could be bounds it.
        const int64_t framing = static_cast<int64_t>(
            wire::SegmentPrefixSize(2, name, offset, std::min(left * 4, chunk_bytes)));
        const int64_t room = (chunk_bytes - used - framing) / 4;
        if (room < 1 && !messages.back().empty()) {
          messages.emplace_back();
          used = kPushHeaderRoom;
          continue;
        }
        const int64_t take = std::min(left, std::max<int64_t>(1, room));
        messages.back().push_back({p, offset, take});
        offset += take;
        used += framing + take * 4;
      }
    }
    return messages;
  }

  // Streams a push to shard s is split over: no more than its messages.
  int NumStreams(int s) const {
    return static_cast<int>(std::min(shards_[s].conns.size(), shards_[s].messages.size()));
  }

  // Stream k's share of shard s's messages: [first, second).
  std::pair<size_t, size_t> StreamShare(int s, int k) const {
    const size_t m = shards_[s].messages.size();
    const size_t streams = static_cast<size_t>(NumStreams(s));
    return {m * k / streams, m * (k + 1) / streams};
  }

  // Runs fn(k, begin, end, deadline) for each stream k of a push to shard
  // s, in parallel, with messages [begin, end) of the shard's push; their
  // statuses combined by CombineStreamStatuses. Every stream ends by the
  // same deadline, rpc_timeout from now, even one that ParallelFor runs
  // after the others (no thread could be started for it): one attempt
  // never outlasts rpc_timeout, which the retry window of a push counts on
  // (PushRetryOptions).
  absl::Status ForEachStream(
      int s, const std::function<absl::Status(int, size_t, size_t, absl::Time)>& fn) {
    const absl::Time deadline = absl::Now() + options_.rpc_timeout;
    auto run = [&](int k) {
      const auto [begin, end] = StreamShare(s, k);
      return fn(k, begin, end, deadline);
    };
    const int streams = NumStreams(s);
    if (streams == 1) return run(0);
    return CombineStreamStatuses(RunInParallel(streams, run));
  }

  // Refuses a gradient with NaN/Inf before anything is sent, so that no
  // shard applies part of it, unless every shard that holds parts of the
  // model applies such gradients (--allow_non_finite_gradients), which the
  // shards say in GetStatus. Nothing of the push is sent while it runs,
  // and it runs at memory speed, so a gradient of more than 32 MiB is
  // scanned on several cores at once (AnyNonFinite). True when the whole
  // gradient was found finite: the push's header says so, and the shards
  // do not scan it again.
  absl::StatusOr<bool> CheckFinite(absl::Span<const float* const> grads) {
    if (!options_.check_finite || non_finite_policy_.load() == kShardsAllowNonFinite) {
      return false;
    }
    std::vector<FloatRange> tensors;
    tensors.reserve(grads.size());
    for (size_t v = 0; v < grads.size(); ++v) {
      tensors.push_back({grads[v], plan_.variables()[v].num_elements()});
    }
    if (!AnyNonFinite(tensors, scan_threads_)) return true;
    // A client that has neither registered nor waited for the variables
    // has not heard from the shards yet: ask them now, on this rare path.
    if (non_finite_policy_.load() == kPolicyUnknown) {
      if (auto statuses = GetStatusOnce(absl::Now() + options_.rpc_timeout); statuses.ok()) {
        LearnShardPolicies(*statuses);
      }
      if (non_finite_policy_.load() == kShardsAllowNonFinite) return false;
    }
    // Names the first bad element.
    for (size_t v = 0; v < grads.size(); ++v) {
      const int64_t bad = FirstNonFinite(grads[v], plan_.variables()[v].num_elements());
      if (bad >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gradient of '", plan_.variables()[v].name, "' has a non-finite value (", grads[v][bad],
            ") at element ", bad,
            "; nothing was pushed (the ps shards apply NaN/Inf only when every one that holds "
            "parts of the model runs with --allow_non_finite_gradients)"));
      }
    }
    return false;  // not reached: AnyNonFinite found one
  }

  // Which start of each shard this client talks to (Shard::incarnation),
  // also in the pull requests already built.
  void LearnIncarnations(const std::vector<StatusResponse>& statuses) {
    for (int s = 0; s < plan_.num_shards(); ++s) {
      Shard& shard = shards_[s];
      shard.incarnation = statuses[s].incarnation();
      for (Connection& conn : shard.conns) {
        for (PullRequest& request : conn.pull_requests) {
          request.set_shard_incarnation(shard.incarnation);
        }
      }
    }
  }

  // FAILED_PRECONDITION when a shard is not the one this client's list of
  // addresses puts at its place (another order of the ps tasks, or another
  // number of them, than the shards were started with). Checked before any
  // other conclusion is drawn from what the shards hold: a list in another
  // order makes a shard holding other parts look restarted. A shard that
  // does not say (num_shards 0, not a psflow shard) is not checked.
  absl::Status CheckShardIdentities(const std::vector<StatusResponse>& statuses) const {
    for (int s = 0; s < plan_.num_shards(); ++s) {
      const StatusResponse& r = statuses[s];
      if (r.num_shards() == 0 || (r.num_shards() == plan_.num_shards() && r.shard_index() == s)) {
        continue;
      }
      return absl::FailedPreconditionError(absl::StrFormat(
          "the ps at %s is shard %d of %d, but this worker's ps list makes it shard %d of %d "
          "(check --ps_hosts / TF_CONFIG: every process must list the same ps tasks in the "
          "same order)",
          options_.ps_addresses[s], r.shard_index(), r.num_shards(), s, plan_.num_shards()));
    }
    return absl::OkStatus();
  }

  // Where some shards did not answer (`failed`), what those that did say of
  // themselves comes first: a list with more addresses than there are
  // shards has one that never answers, and the others name the mismatch
  // (a worker waited out --wait_for_variables_s to say only that one
  // address did not answer). Unanswered entries are empty (num_shards 0).
  absl::Status FirstIdentityProblem(const std::vector<StatusResponse>& statuses,
                                    const absl::Status& failed) const {
    const absl::Status identities = CheckShardIdentities(statuses);
    return identities.ok() ? failed : identities;
  }

  // FAILED_PRECONDITION when some shard lacks parts of the model while
  // another holds trained ones (a version above 0): the first restarted and
  // lost its variables, and registering would put initial values next to
  // trained ones, which training would then mix without a word. (A chief
  // that stopped part-way through registering leaves versions at 0.)
  absl::Status CheckNoShardLostTrainedModel(const std::vector<StatusResponse>& statuses) const {
    return CheckNoShardLostTrainedModel(statuses, statuses);
  }

  // The same, with what the shards hold now (`now`) against which held
  // trained parts before (`before`, answers all received before any of
  // `now` was asked for). A client other than the chief needs the two:
  // answers asked for at once may come seconds apart (a shard reached only
  // after its connection was retried), and a shard's "none" from before the
  // chief registered next to another's "trained" from after its first push
  // is no restart. (The chief registers itself, so its own answers do.)
  absl::Status CheckNoShardLostTrainedModel(const std::vector<StatusResponse>& now,
                                            const std::vector<StatusResponse>& before) const {
    // A shard of another plan (another model, another number of shards) is
    // the registration's to name, variable by variable: its part counts say
    // nothing of a restart.
    for (const auto* statuses : {&now, &before}) {
      for (const StatusResponse& status : *statuses) {
        if (status.plan_fingerprint() != 0 && status.plan_fingerprint() != plan_.fingerprint()) {
          return absl::OkStatus();
        }
      }
    }
    int trained = -1;
    for (int s = 0; s < plan_.num_shards() && trained < 0; ++s) {
      if (before[s].parts_size() > 0 && before[s].parts(0).version() > 0) trained = s;
    }
    if (trained < 0) return absl::OkStatus();
    for (int s = 0; s < plan_.num_shards(); ++s) {
      const int64_t held = std::max<int64_t>(now[s].num_parts(), now[s].parts_size());
      if (s == trained || held >= static_cast<int64_t>(shards_[s].parts.size())) continue;
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s holds %d of its %d variables while %s holds trained ones (version %d): %s "
          "restarted and lost its variables, and psflow keeps no checkpoints yet; restart every "
          "ps shard, then the workers",
          shards_[s].name, held, shards_[s].parts.size(), shards_[trained].name,
          before[trained].parts(0).version(), shards_[s].name));
    }
    return absl::OkStatus();
  }

  // Takes from the shards' statuses whether every shard holding parts of
  // the model applies NaN/Inf gradients, and how long the shortest-lived
  // remembers a push's request id: a push is retried only within that,
  // whatever this client was told (a retry after the shard forgot the id
  // would be applied twice).
  void LearnShardPolicies(const std::vector<StatusResponse>& statuses) {
    bool allow = true;
    int shortest = -1;
    for (int s = 0; s < plan_.num_shards(); ++s) {
      if (shards_[s].parts.empty()) continue;
      allow = allow && statuses[s].allows_non_finite_gradients();
      if (!statuses[s].has_request_id_retention_ms()) continue;  // not told: the client's own
      if (shortest < 0 ||
          statuses[s].request_id_retention_ms() < statuses[shortest].request_id_retention_ms()) {
        shortest = s;
      }
    }
    non_finite_policy_.store(allow ? kShardsAllowNonFinite : kShardsRefuseNonFinite);
    if (shortest < 0) return;
    const absl::Duration retention =
        absl::Milliseconds(std::max<int64_t>(0, statuses[shortest].request_id_retention_ms()));
    if (retention >= options_.request_id_retention) return;
    absl::MutexLock lock(&policy_mu_);
    push_retry_ = std::make_shared<const RetryOptions>(
        PushRetryOptions(options_, retention, shards_[shortest].name));
  }

  // A shard that refused a push may have been restarted without
  // --allow_non_finite_gradients: until the shards are asked again, the
  // client scans its pushes, so that a NaN/Inf is refused whole rather than
  // applied by the shards that allow it and refused by the others.
  void ForgetAllowAfterRefusal(const absl::Status& status) {
    if (!absl::IsInvalidArgument(status)) return;
    int allow = kShardsAllowNonFinite;
    non_finite_policy_.compare_exchange_strong(allow, kPolicyUnknown);
  }

  // Shared, so that a push takes it without copying its strings.
  std::shared_ptr<const RetryOptions> PushRetry() const {
    absl::MutexLock lock(&policy_mu_);
    return push_retry_;
  }

  // One non-null tensor per variable of the plan.
  template <typename T>
  absl::Status CheckTensors(absl::Span<T* const> tensors, const char* what,
                            const char* role) const {
    if (tensors.size() != plan_.variables().size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, " got ", tensors.size(),
                                                     " tensors; the model has ",
                                                     plan_.variables().size(), " variables"));
    }
    for (size_t v = 0; v < tensors.size(); ++v) {
      if (tensors[v] != nullptr) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the ", role, " of '", plan_.variables()[v].name, "' is null; expected ",
          plan_.variables()[v].num_elements(), " floats"));
    }
    return absl::OkStatus();
  }

  // PushPull writes values while a retry may still send the gradient from
  // where it lies: no output buffer may share a byte with a gradient.
  absl::Status CheckSeparate(absl::Span<const float* const> grads,
                             absl::Span<float* const> values) const {
    struct Span {
      uintptr_t begin, end;
      size_t variable;
      bool output;
    };
    // On the stack for models of up to 32 variables: this runs every step.
    absl::InlinedVector<Span, 64> spans;
    for (size_t v = 0; v < grads.size(); ++v) {
      const uintptr_t bytes = static_cast<uintptr_t>(plan_.variables()[v].num_elements()) * 4;
      if (bytes == 0) continue;
      spans.push_back({reinterpret_cast<uintptr_t>(grads[v]),
                       reinterpret_cast<uintptr_t>(grads[v]) + bytes, v, false});
      spans.push_back({reinterpret_cast<uintptr_t>(values[v]),
                       reinterpret_cast<uintptr_t>(values[v]) + bytes, v, true});
    }
    std::sort(spans.begin(), spans.end(),
              [](const Span& a, const Span& b) { return a.begin < b.begin; });
    // The furthest-reaching gradient and output seen so far.
    const Span* reach[2] = {nullptr, nullptr};
    for (const Span& span : spans) {
      const Span* other = reach[span.output ? 0 : 1];
      if (other != nullptr && span.begin < other->end) {
        const Span& output = span.output ? span : *other;
        const Span& grad = span.output ? *other : span;
        return absl::InvalidArgumentError(absl::StrCat(
            "PushPull: the output buffer of '", plan_.variables()[output.variable].name,
            "' shares memory with the gradient of '", plan_.variables()[grad.variable].name,
            "'; expected separate buffers (a retry sends the gradient again after the values "
            "were written)"));
      }
      const Span*& mine = reach[span.output ? 1 : 0];
      if (mine == nullptr || span.end > mine->end) mine = &span;
    }
    return absl::OkStatus();
  }

  uint64_t NewRequestId() {
    absl::MutexLock lock(&id_mu_);
    uint64_t id = 0;
    while (id == 0) id = absl::Uniform<uint64_t>(id_gen_);
    return id;
  }

  // gRPC refuses a message over a shard's receive limit (its
  // --max_chunk_bytes and 1 MiB for framing) with an error that names no
  // setting; this adds the two that must agree.
  absl::Status NameChunkLimit(int s, absl::Status status) const {
    if (!absl::IsResourceExhausted(status) ||
        !absl::StrContains(status.message(), "larger than max")) {
      return status;
    }
    const Shard& shard = shards_[s];
    return absl::ResourceExhaustedError(absl::StrCat(
        status.message(), "; this client sends messages of up to ", shard.chunk_bytes, " bytes",
        shard.told_chunk_limit
            ? ", the smaller of its own limit (worker --max_chunk_bytes) and the shard's "
              "ps_server --max_chunk_bytes as the shard reported it when the client registered "
              "or waited for the variables (was the shard restarted since with a smaller one?)"
            : " (worker --max_chunk_bytes), more than the shard's ps_server --max_chunk_bytes; "
              "a client fits its messages to the shard's limit when it registers or waits for "
              "the variables"));
  }

  // rpc_timeout from now, or `cap` if sooner.
  void SetDeadline(grpc::ClientContext* context, absl::Time cap = absl::InfiniteFuture()) const {
    context->set_deadline(absl::ToChronoTime(std::min(absl::Now() + options_.rpc_timeout, cap)));
  }

  absl::Status RegisterOnce(int s, absl::Span<const float* const> values,
                            RegisterResponse* response) {
    Shard& shard = shards_[s];
    grpc::ClientContext context;
    SetDeadline(&context);
    auto writer = shard.stub->RegisterVariables(&context, response);
    RegisterRequest msg;
    RegisterHeader* header = msg.mutable_header();
    header->set_plan_fingerprint(plan_.fingerprint());
    header->set_model_fingerprint(options_.model_fingerprint);
    header->set_shard_incarnation(shard.incarnation);
    header->set_num_shards(plan_.num_shards());
    header->set_shard_index(s);
    for (int p : shard.parts) {
      const Part& part = plan_.parts()[p];
      const VariableSpec& var = plan_.variables()[part.variable_index];
      PartDef* def = header->add_parts();
      def->set_variable(var.name);
      for (int64_t d : var.shape) def->add_variable_shape(d);
      def->set_row_begin(part.row_begin);
      def->set_row_end(part.row_end);
    }
    // A small header travels with the first message's values, within the
    // 1 MiB a shard accepts beyond its --max_chunk_bytes. A larger one (some
    // thousands of parts) is sent first, alone, over as many messages as
    // it takes, each a piece of the part list within that 1 MiB.
    if (header->ByteSizeLong() > kHeaderWithValuesBytes) {
      RegisterRequest piece;
      *piece.mutable_header() = *header;
      piece.mutable_header()->clear_parts();
      const size_t bare = piece.ByteSizeLong();
      size_t bytes = bare;
      bool ok = true;
      for (const PartDef& def : header->parts()) {
        const size_t def_bytes = def.ByteSizeLong() + 8;  // with its tag and length
        if (piece.header().parts_size() > 0 && bytes + def_bytes > kHeaderPieceBytes) {
          if (!(ok = writer->Write(piece))) break;
          piece.mutable_header()->clear_parts();
          bytes = bare;
        }
        *piece.mutable_header()->add_parts() = def;
        bytes += def_bytes;
      }
      if (ok) ok = writer->Write(piece);
      msg.clear_header();
      if (!ok) {
        writer->WritesDone();
        return NameChunkLimit(s, FromServerStatus(writer->Finish(), shard.name));
      }
    }
    // The initial values in the messages a push would use.
    for (const std::vector<SegmentRef>& message : shard.messages) {
      for (const SegmentRef& seg : message) {
        const Part& part = plan_.parts()[seg.part];
        Segment* segment = msg.add_segments();
        segment->set_variable(plan_.variables()[part.variable_index].name);
        segment->set_offset(seg.offset);
        segment->mutable_data()->assign(
            reinterpret_cast<const char*>(values[part.variable_index] + part.elem_begin +
                                          seg.offset),
            seg.count * 4);
      }
      if (!writer->Write(msg)) break;
      msg.Clear();
    }
    writer->WritesDone();
    return NameChunkLimit(s, FromServerStatus(writer->Finish(), shard.name));
  }

  // Writes messages [begin, end) of shard s's push of `grads` as
  // PushRequest messages (the header in the first) and half-closes the
  // stream. False when the stream broke.
  bool WritePush(int s, size_t begin, size_t end, absl::Span<const float* const> grads,
                 const PushCall& call, GradientRefs* refs,
                 grpc::internal::WriterInterface<grpc::ByteBuffer>* writer,
                 const std::function<bool()>& writes_done) {
    Shard& shard = shards_[s];
    PushHeader header;
    header.set_worker_id(options_.worker_id);
    header.set_step(call.info.step);
    header.set_read_version(call.info.read_version);
    header.set_request_id(call.request_id);
    header.set_gradient_checked(call.gradient_checked);
    header.set_shard_incarnation(shard.incarnation);
    PushEncoder encoder(refs);
    encoder.SetHeader(header);
    grpc::ByteBuffer message;
    bool ok = true;
    for (size_t i = begin; i < end && ok; ++i) {
      for (const SegmentRef& seg : shard.messages[i]) {
        const Part& part = plan_.parts()[seg.part];
        encoder.AddSegment(plan_.variables()[part.variable_index].name, seg.offset,
                           grads[part.variable_index] + part.elem_begin + seg.offset, seg.count);
      }
      encoder.Take(&message);
      ok = writer->Write(message);
    }
    return writes_done() && ok;
  }

  // Reads PullResponse messages from shard s until the stream ends, copying
  // each segment into `values`; counts the elements in `*received`.
  // DATA_LOSS for a malformed response or one outside the shard's parts.
  absl::Status ReadValues(int s, grpc::internal::ReaderInterface<grpc::ByteBuffer>* reader,
                          PullBuffers* in, absl::Span<float* const> values, PullResult* result,
                          int64_t* received) {
    Shard& shard = shards_[s];
    bool first = true;
    absl::Status bad;
    while (bad.ok() && reader->Read(&in->buffer)) {
      bad = wire::DumpPieces(in->buffer, &in->slices, &in->pieces);
      if (bad.ok()) bad = wire::Decode(wire::MessageKind::kPullResponse, in->pieces, &in->msg);
      if (!bad.ok()) {
        bad = absl::DataLossError(
            absl::StrCat(shard.name, " sent a malformed Pull response: ", bad.message()));
        break;
      }
      const wire::DecodedMessage& msg = in->msg;
      for (size_t i = 0; i < msg.num_segments; ++i) {
        const wire::DecodedSegment& segment = msg.segments[i];
        auto it = shard.by_name.find(segment.variable);
        if (it == shard.by_name.end()) continue;  // a variable of another model: not ours
        const int64_t count = segment.data_bytes / 4;
        const Part& part = plan_.parts()[it->second];
        if (segment.data_bytes % 4 != 0 || segment.offset < 0 ||
            count > part.num_elements() - segment.offset) {
          bad = absl::DataLossError(absl::StrCat(
              shard.name, " sent ", segment.data_bytes, " bytes at element ", segment.offset,
              " of '", segment.variable, "' whose part has ", part.num_elements(),
              " float32 elements"));
          break;
        }
        if (i >= msg.versions.size()) {
          bad = absl::DataLossError(absl::StrCat(
              shard.name, " sent a Pull response with ", msg.num_segments, " segments but ",
              msg.versions.size(), " versions; expected one version per segment"));
          break;
        }
        msg.CopyData(segment, values[part.variable_index] + part.elem_begin + segment.offset);
        *received += count;
        const int64_t version = msg.versions[i];
        result->min_version = first ? version : std::min(result->min_version, version);
        result->max_version = first ? version : std::max(result->max_version, version);
        first = false;
      }
    }
    // Drop the references to gRPC's slices before the call ends.
    in->msg.Clear();
    in->pieces.clear();
    in->slices.clear();
    in->buffer.Clear();
    return bad;
  }

  // Every element of shard s's parts, once.
  int64_t ShardElements(int s) const {
    int64_t n = 0;
    for (int p : shards_[s].parts) n += plan_.parts()[p].num_elements();
    return n;
  }

  absl::Status CheckReceived(int s, int64_t received, int64_t expected) const {
    if (received == expected) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat(shards_[s].name, " returned ", received, " of the ",
                                            expected, " elements this worker expects"));
  }

  // One stream of a push to shard s: messages [begin, end) on connection k,
  // its gradient slices counted by `refs`.
  absl::Status PushOnce(int s, int k, size_t begin, size_t end, absl::Time deadline,
                        absl::Span<const float* const> grads, const PushCall& call,
                        GradientRefs* refs) {
    Shard& shard = shards_[s];
    Connection& conn = shard.conns[k];
    grpc::ClientContext context;
    SetDeadline(&context, deadline);
    PushResponse response;
    // What the generated stub does, with ByteBuffer messages (PushEncoder).
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
            conn.channel.get(), *conn.push_method, &context, &response));
    WritePush(s, begin, end, grads, call, refs, writer.get(), [&] { return writer->WritesDone(); });
    return NameChunkLimit(s, FromServerStatus(writer->Finish(), shard.name));
  }

  // Returns `status` once gRPC holds none of the gradient slices counted by
  // `refs`, and drops the owner's reference. When its calls have ended,
  // gRPC has written their bytes or failed the connection that held them,
  // and lets go of them at once. If it still held them after a whole
  // deadline, the caller must not free the gradient and hears so: INTERNAL,
  // which replaces whatever the calls returned and is not retried.
  absl::Status ReleaseGradient(GradientRefs* refs, absl::Status status) {
    const bool released = refs->AwaitNoSlices(options_.rpc_timeout);
    refs->Release();
    if (released) return status;
    absl::Status held = absl::InternalError(absl::StrCat(
        "gRPC still holds part of the pushed gradient ", absl::FormatDuration(options_.rpc_timeout),
        " after the calls ended; it must not be freed or changed while this process runs (the "
        "push: ",
        status.ok() ? "succeeded" : status.ToString(), ")"));
    held.SetPayload(kGradientStillHeldPayload, absl::Cord("1"));
    return held;
  }

  // Connection k's pull of shard s (see BuildPullRequest): its requests,
  // one after another.
  absl::Status PullOnce(int s, int k, absl::Time deadline, absl::Span<float* const> values,
                        PullResult* result) {
    Shard& shard = shards_[s];
    Connection& conn = shard.conns[k];
    int64_t received = 0;
    PullResult later;  // a later request's versions, folded into *result
    for (size_t r = 0; r < conn.pull_requests.size(); ++r) {
      grpc::ClientContext context;
      SetDeadline(&context, deadline);
      // What the generated stub does, reading raw ByteBuffers: each
      // segment's data is copied once, from gRPC's slices straight into the
      // tensor.
      std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
          grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
              conn.channel.get(), *conn.pull_method, &context, conn.pull_requests[r]));
      absl::Status bad =
          ReadValues(s, reader.get(), &conn.pull_in, values, r == 0 ? result : &later, &received);
      if (!bad.ok()) {
        context.TryCancel();
        reader->Finish();
        return bad;
      }
      PSFLOW_RETURN_IF_ERROR(FromServerStatus(reader->Finish(), shard.name));
      if (r > 0) {
        result->min_version = std::min(result->min_version, later.min_version);
        result->max_version = std::max(result->max_version, later.max_version);
      }
    }
    return CheckReceived(s, received, conn.pull_elements);
  }

  // One stream of a PushPull to shard s (messages [begin, end) on
  // connection k): a helper thread writes the gradient while this thread
  // reads the values coming back (the server answers each message as soon
  // as it is applied, so both must run at once). The elements received are
  // added to `*received`.
  absl::Status PushPullOnce(int s, int k, size_t begin, size_t end, absl::Time deadline,
                            absl::Span<const float* const> grads, const PushCall& call,
                            GradientRefs* refs, absl::Span<float* const> values, PullResult* result,
                            int64_t* received) {
    Shard& shard = shards_[s];
    Connection& conn = shard.conns[k];
    grpc::ClientContext context;
    SetDeadline(&context, deadline);
    std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            conn.channel.get(), *conn.push_pull_method, &context));
    std::thread writer;
    try {
      writer = std::thread([&] {
        WritePush(s, begin, end, grads, call, refs, stream.get(),
                  [&] { return stream->WritesDone(); });
      });
    } catch (const std::exception& e) {  // std::system_error, or std::bad_alloc
      // Nothing was written: the shard sees a push without messages.
      context.TryCancel();
      stream->Finish();
      return absl::UnavailableError(absl::StrCat(
          "could not start the thread that writes the PushPull to ", shard.name, ": ", e.what()));
    }
    *received = 0;
    absl::Status bad = ReadValues(s, stream.get(), &conn.push_pull_in, values, result, received);
    if (!bad.ok()) context.TryCancel();  // also ends a Write the server no longer reads
    writer.join();
    const grpc::Status status = stream->Finish();
    PSFLOW_RETURN_IF_ERROR(bad);
    return NameChunkLimit(s, FromServerStatus(status, shard.name));
  }

  // OK once shard s's host name has resolved (GrpcPsClientOptions::
  // resolve_host), else UNAVAILABLE naming the shard and why, without
  // touching its channel. The lookup runs on a thread of its own, one at a
  // time per shard, and is waited for until `deadline` at most: with its
  // DNS server unreachable, glibc gives a name 10 s per search domain, past
  // a status check's deadline; a check that stops waiting leaves the lookup
  // to the next.
  absl::Status HostResolves(int s, absl::Time deadline) {
    Shard& shard = shards_[s];
    if (shard.host.empty() || shard.host_resolved.load()) return absl::OkStatus();
    std::shared_ptr<HostLookup> lookup;
    {
      absl::MutexLock lock(&shard.lookup_mu);
      if (shard.lookup == nullptr) {
        shard.lookup = std::make_shared<HostLookup>();
        std::function<absl::Status(const std::string&)> resolve = options_.resolve_host;
        if (!resolve) resolve = ResolveWithGetaddrinfo;
        auto run = [lookup = shard.lookup, resolve, host = shard.host] {
          const absl::Status result = resolve(host);
          absl::MutexLock done(&lookup->mu);
          lookup->result = result;
          lookup->done = true;
        };
        try {
          std::thread(run).detach();
        } catch (const std::system_error&) {
          run();  // no thread to be had: look it up here
        }
      }
      lookup = shard.lookup;
    }
    absl::Status result;
    {
      absl::MutexLock lock(&lookup->mu);
      if (!lookup->mu.AwaitWithDeadline(absl::Condition(&lookup->done), deadline)) {
        return absl::UnavailableError(
            absl::StrCat(shard.name, ": the name ", shard.host, " is still being looked up"));
      }
      result = lookup->result;
    }
    {
      absl::MutexLock lock(&shard.lookup_mu);
      if (shard.lookup == lookup) shard.lookup = nullptr;  // the next check looks again
    }
    if (!result.ok()) {
      return absl::UnavailableError(absl::StrCat(shard.name, ": ", result.message()));
    }
    shard.host_resolved = true;
    return absl::OkStatus();
  }

  static absl::Status ResolveWithGetaddrinfo(const std::string& host) {
    addrinfo hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
    if (rc == 0) {
      freeaddrinfo(found);
      return absl::OkStatus();
    }
    return absl::UnavailableError(absl::StrCat(
        "the name ", host,
        " does not resolve (yet): ", rc == EAI_SYSTEM ? std::strerror(errno) : gai_strerror(rc)));
  }

  // Shard s's status with a page of at most `page_size` parts (0: a full
  // page). The client's own checks read the counters and num_parts only,
  // so they ask for one part, not for up to 3 MiB of them.
  absl::Status StatusOnce(int s, StatusResponse* out, absl::Time cap = absl::InfiniteFuture(),
                          int page_size = 1) {
    PSFLOW_RETURN_IF_ERROR(HostResolves(s, std::min(absl::Now() + options_.rpc_timeout, cap)));
    grpc::ClientContext context;
    SetDeadline(&context, cap);
    StatusRequest request;
    request.set_page_size(page_size);
    return FromServerStatus(shards_[s].stub->GetStatus(&context, request, out), shards_[s].name);
  }

  // Every shard's status (one part of each), each call ending by `cap` at
  // the latest.
  absl::StatusOr<std::vector<StatusResponse>> GetStatusOnce(absl::Time cap) {
    std::vector<StatusResponse> out(plan_.num_shards());
    const absl::Status answered =
        ForEachShard(plan_.num_shards(), [&](int s) { return StatusOnce(s, &out[s], cap); });
    if (!answered.ok()) return FirstIdentityProblem(out, answered);
    return out;
  }

  // The retries of a push: only while the shards are sure to remember its
  // request id, `retention` (GrpcPsClientOptions::request_id_retention, or
  // what the shard named `shard` reported, where shorter).
  static RetryOptions PushRetryOptions(const GrpcPsClientOptions& options, absl::Duration retention,
                                       absl::string_view shard) {
    RetryOptions retry = options.retry;
    // Less a second: the shard dates an id from its first applied segment,
    // which reached it a one-way trip after the push began, and a retry's
    // deadline there ends a one-way trip later than the client's (and gRPC
    // rounds it up). Those trips differ by milliseconds, in either
    // direction; the second keeps the retry inside the retention.
    retry.retry_window =
        std::max(absl::ZeroDuration(), retention - options.rpc_timeout - kPushRetryRetentionMargin);
    retry.window_reason =
        absl::StrCat("when the ps shard may have forgotten the push's request id (",
                     shard.empty() ? "it keeps them " : absl::StrCat(shard, " keeps them "),
                     absl::FormatDuration(retention),
                     ", --request_id_retention_s) and would apply a retry twice");
    return retry;
  }

  // A gradient's NaN/Inf scan uses at most this many threads.
  static constexpr int kMaxScanThreads = 8;

  const PartitionPlan plan_;
  const GrpcPsClientOptions options_;
  const int scan_threads_;  // the cores, at most kMaxScanThreads
  // What the shards do with NaN/Inf gradients, once a GetStatus told.
  enum NonFinitePolicy { kPolicyUnknown, kShardsRefuseNonFinite, kShardsAllowNonFinite };
  std::atomic<int> non_finite_policy_{kPolicyUnknown};
  mutable absl::Mutex policy_mu_;
  std::shared_ptr<const RetryOptions> push_retry_ ABSL_GUARDED_BY(policy_mu_);
  std::vector<Shard> shards_;
  absl::Mutex report_mu_;
  // When a retry of each shard's calls was last told.
  std::vector<std::optional<std::chrono::steady_clock::time_point>> last_retry_report_
      ABSL_GUARDED_BY(report_mu_);
  absl::Mutex id_mu_;
  absl::BitGen id_gen_ ABSL_GUARDED_BY(id_mu_);
};

}  // namespace

int64_t PushSlicesInFlight() { return g_push_slices.load(std::memory_order_relaxed); }

int AutoStreamsPerShard(int cores) { return cores >= 8 ? 4 : 1; }

absl::Status CombineStreamStatuses(absl::Span<const absl::Status> statuses) {
  absl::Status combined;
  for (const absl::Status& s : statuses) {
    if (!s.ok() && !IsRetryable(s)) return s;
    if (combined.ok() || (absl::IsDeadlineExceeded(s) && !absl::IsDeadlineExceeded(combined))) {
      combined = s;
    }
  }
  return combined;
}

std::string HostToResolve(absl::string_view address) {
  if (absl::StrContains(address, "://") || absl::StartsWith(address, "unix:") ||
      absl::StartsWith(address, "unix-abstract:") || absl::StartsWith(address, "ipv4:") ||
      absl::StartsWith(address, "ipv6:") || absl::StartsWith(address, "dns:") ||
      absl::StartsWith(address, "[")) {
    return "";
  }
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return "";
  const std::string host(address.substr(0, colon));
  if (host.find(':') != std::string::npos) return "";  // a bare IPv6 literal
  in_addr ipv4;
  if (inet_pton(AF_INET, host.c_str(), &ipv4) == 1) return "";
  return host;
}

GrpcArgs ClientChannelArgs(const GrpcPsClientOptions& options) {
  GrpcArgs args = KeepaliveGrpcArgs(options.keepalive_time, options.keepalive_timeout);
  args.emplace_back(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                    absl::StrCat(absl::ToInt64Milliseconds(options.max_reconnect_backoff)));
  return OverrideGrpcArgs(std::move(args), options.grpc_args);
}

absl::StatusOr<std::unique_ptr<PsClient>> CreateGrpcPsClient(std::vector<VariableSpec> variables,
                                                             const GrpcPsClientOptions& options) {
  if (options.ps_addresses.empty()) {
    return absl::InvalidArgumentError("no ps addresses given (--ps_hosts or TF_CONFIG cluster.ps)");
  }
  if (options.streams_per_shard < 1 || options.streams_per_shard > 64) {
    return absl::InvalidArgumentError(absl::StrCat("streams_per_shard (--ps_streams) is ",
                                                   options.streams_per_shard,
                                                   "; expected 1 to 64 (--ps_streams=0 picks "
                                                   "4 or 1 by the machine's cores)"));
  }
  if (options.rpc_timeout <= absl::ZeroDuration() ||
      options.rpc_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rpc_timeout is ", absl::FormatDuration(options.rpc_timeout),
                     "; expected a positive, finite deadline for each call (--rpc_timeout_s)"));
  }
  if (options.request_id_retention < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id_retention is ", absl::FormatDuration(options.request_id_retention),
                     "; expected 0 or more (--request_id_retention_s)"));
  }
  for (const auto& [name, value] :
       {std::pair{"keepalive_time", options.keepalive_time},
        std::pair{"keepalive_timeout", options.keepalive_timeout},
        std::pair{"max_reconnect_backoff", options.max_reconnect_backoff}}) {
    if (value < absl::Milliseconds(1) || value > absl::Hours(24)) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is ", absl::FormatDuration(value),
                                                     "; expected 1 ms to 24 h"));
    }
  }
  PSFLOW_RETURN_IF_ERROR(CheckRetryOptions(options.retry));
  if (options.max_chunk_bytes < 4) {
    return absl::InvalidArgumentError(absl::StrCat("max_chunk_bytes (--max_chunk_bytes) is ",
                                                   options.max_chunk_bytes,
                                                   "; expected at least 4, one float"));
  }
  PartitionOptions plan_options;
  plan_options.num_shards = static_cast<int>(options.ps_addresses.size());
  plan_options.min_split_bytes = options.min_split_bytes;
  PSFLOW_ASSIGN_OR_RETURN(PartitionPlan plan,
                          PartitionPlan::Create(std::move(variables), plan_options));
  return std::unique_ptr<PsClient>(new GrpcPsClient(std::move(plan), options));
}

}  // namespace psflow::worker
