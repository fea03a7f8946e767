#include "worker/trainer.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/float_buffer.h"
#include "common/process_stats.h"
#include "common/retry.h"
#include "common/status_macros.h"
#include "worker/data/batcher.h"
#include "worker/progress.h"

namespace psflow::worker {
namespace {

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

// One background thread running one job at a time: the push of a step's
// gradient and the pull of fresh variables, while the next step computes.
class CommThread {
 public:
  CommThread() : thread_([this] { Loop(); }) {}
  ~CommThread() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Start(std::function<absl::Status()> job) {
    absl::MutexLock lock(&mu_);
    job_ = std::move(job);
    done_ = false;
  }
  // Waits for the job started last (OK if none) and returns its status.
  absl::Status Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](CommThread* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) { return t->done_; }, this));
    return status_;
  }

 private:
  void Loop() {
    while (true) {
      std::function<absl::Status()> job;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](CommThread* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) {
              return t->stop_ || t->job_ != nullptr;
            },
            this));
        if (job_ == nullptr) return;  // stopping, nothing queued
        job = std::move(job_);
        job_ = nullptr;
      }
      absl::Status status = job();
      absl::MutexLock lock(&mu_);
      status_ = status;
      done_ = true;
    }
  }

  absl::Mutex mu_;
  std::function<absl::Status()> job_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = true;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// One tensor per variable. FloatBuffer gives big tensors pages of their own
// (so a GPU backend can pin each one without touching its neighbours).
struct Buffers {
  std::vector<FloatBuffer> data;
  std::vector<float*> ptrs;
  std::vector<const float*> cptrs;
  explicit Buffers(const ModelDef& model) {
    for (const auto& v : model.variables) data.emplace_back(v.num_elements(), 0.0f);
    for (auto& d : data) {
      ptrs.push_back(d.data());
      cptrs.push_back(d.data());
    }
  }
  // Copies the values of `other` (same model).
  void CopyFrom(const Buffers& other) {
    for (size_t i = 0; i < data.size(); ++i) {
      std::copy(other.data[i].data(), other.data[i].data() + other.data[i].size(),
                data[i].data());
    }
  }
};

// Gradients that a push returned saying gRPC still holds them: kept,
// reachable, for the life of the process (gRPC may still send from them).
void KeepForever(std::unique_ptr<std::array<Buffers, 2>> grads) {
  ABSL_CONST_INIT static absl::Mutex mu(absl::kConstInit);
  static auto* kept = new std::vector<std::unique_ptr<std::array<Buffers, 2>>>();
  absl::MutexLock lock(&mu);
  kept->push_back(std::move(grads));
}

// JSON has no NaN or infinity (printf's "-nan" and "inf" made the summary
// of a diverged run unreadable): those are null.
void AppendNumber(std::string* out, const char* key, double value, bool comma = true) {
  if (std::isfinite(value)) {
    absl::StrAppendFormat(out, "\"%s\": %.6g%s", key, value, comma ? ", " : "");
  } else {
    absl::StrAppendFormat(out, "\"%s\": null%s", key, comma ? ", " : "");
  }
}

// Counts exactly: as a double with 6 digits, 345543210 bytes were written
// 3.45543e+08, and a million steps would have lost their last digits.
void AppendInteger(std::string* out, const char* key, int64_t value, bool comma = true) {
  absl::StrAppendFormat(out, "\"%s\": %d%s", key, value, comma ? ", " : "");
}

// `status` with the call that failed (and its step) before its message;
// its code and payloads (GradientStillHeld) kept.
absl::Status InCall(const absl::Status& status, absl::string_view call) {
  absl::Status out(status.code(), absl::StrCat(call, ": ", status.message()));
  status.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

// The ps shards may start after the chief (a cluster's pods start in any
// order): as TensorFlow's chief does, it waits for every shard to answer,
// as long as the other workers wait for it, saying so on `progress`. A
// client's own retries give up after about 16 s.
absl::Status WaitForShards(PsClient* client, const TrainerOptions& options) {
  const absl::Time start = absl::Now(), deadline = start + options.wait_for_variables;
  while (true) {
    // Each check ends by the wait's deadline (but has at least a second to
    // be answered, however short the wait) and within 10 s, so that a line
    // says what the chief waits for while a shard is slow to answer.
    const absl::Time now = absl::Now();
    absl::StatusOr<std::vector<StatusResponse>> statuses = client->GetStatus(
        std::max(std::min(deadline, now + absl::Seconds(10)), now + absl::Seconds(1)));
    if (statuses.ok()) return absl::OkStatus();
    if (!IsRetryable(statuses.status())) {
      return InCall(statuses.status(), "checking the ps shards' status");
    }
    // What the last check found, without its retries' account: this wait
    // is what goes on, or gives up.
    const std::string why(WithoutRetrySummary(statuses.status().message()));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the ps shards did not all answer within ",
          absl::FormatDuration(options.wait_for_variables), " (--wait_for_variables_s): ", why));
    }
    if (options.progress != nullptr) {
      std::fprintf(options.progress, "waiting for the ps shards (%s of %s): %s\n",
                   absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Seconds(1))).c_str(),
                   absl::FormatDuration(options.wait_for_variables).c_str(), why.c_str());
      std::fflush(options.progress);
    }
    absl::SleepFor(std::min(absl::Seconds(1), deadline - absl::Now()));
  }
}

}  // namespace

absl::Status Evaluate(ComputeBackend* backend, absl::Span<const float* const> params,
                      const Dataset& data, int batch_size, double* loss, double* accuracy) {
  std::vector<float> images(static_cast<size_t>(batch_size) * data.example_size());
  std::vector<int32_t> labels(batch_size);
  StepResult result;
  int64_t seen = 0;
  for (int64_t begin = 0; begin < data.num_examples; begin += batch_size) {
    const int n = FillBatch(data, begin, batch_size, images.data(), labels.data());
    PSFLOW_RETURN_IF_ERROR(backend->Evaluate(params, images.data(), labels.data(), n, &result));
    seen += n;
  }
  if (seen == 0) return absl::InvalidArgumentError(absl::StrCat(data.name, " has no examples"));
  *loss = result.loss_sum / seen;
  *accuracy = static_cast<double>(result.correct) / seen;
  return absl::OkStatus();
}

absl::StatusOr<TrainSummary> Train(const ModelDef& model, ComputeBackend* backend,
                                   PsClient* client, const Dataset& train, const Dataset& test,
                                   const TrainerOptions& options) {
  const Shape3 want = model.input;
  for (const Dataset* d : {&train, &test}) {
    if (d->height != want.h || d->width != want.w || d->channels != want.c) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s has %dx%dx%d examples but the model expects %dx%dx%d", d->name, d->height,
          d->width, d->channels, want.h, want.w, want.c));
    }
  }
  if (test.num_examples <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(test.name, " has no examples; evaluation needs at least one"));
  }
  PSFLOW_RETURN_IF_ERROR(ValidateClipOptions(options.clip));
  // Checked by every worker alike, before anything is registered: with more
  // workers than examples the first shard is empty, and the chief alone
  // would fail while the others wait for its variables.
  if (train.num_examples < options.num_replicas) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s has %d examples, fewer than the %d workers that share it; expected at least one "
        "example per worker",
        train.name, train.num_examples, options.num_replicas));
  }
  if (train.num_classes > model.num_classes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the model's last layer (--model) has %d units but %s has %d classes; expected a last "
        "layer dense:%d or wider",
        model.num_classes, train.name, train.num_classes, train.num_classes));
  }
  const absl::Time start = absl::Now();
  TrainSummary summary;
  Progress progress(options.progress, options.progress_tty,
                    options.num_replicas > 1 ? absl::StrCat("[worker ", options.replica_index, "] ")
                                             : "");

  // Before any variable is registered, so that bad batching options change
  // nothing on the shards.
  BatcherOptions batcher_options;
  batcher_options.batch_size = options.batch_size;
  batcher_options.num_shards = options.num_replicas;
  batcher_options.shard_index = options.replica_index;
  batcher_options.seed = options.seed;
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<Batcher> batcher,
                          Batcher::Create(&train, batcher_options));

  // Variables: the chief registers its initial values; the others wait.
  Buffers params[2] = {Buffers(model), Buffers(model)};
  // The gradients on the heap: if a push returns saying gRPC still holds
  // part of one (GradientStillHeld), they are never freed.
  struct Gradients {
    std::unique_ptr<std::array<Buffers, 2>> buffers;
    std::atomic<bool> held{false};
    ~Gradients() {
      if (held) KeepForever(std::move(buffers));
    }
  } keep_grads{std::make_unique<std::array<Buffers, 2>>(
      std::array<Buffers, 2>{Buffers(model), Buffers(model)})};
  std::array<Buffers, 2>& grads = *keep_grads.buffers;
  std::vector<int64_t> sizes;  // of each variable, for clipping
  for (const auto& v : model.variables) sizes.push_back(v.num_elements());
  if (options.is_chief) {
    PSFLOW_RETURN_IF_ERROR(WaitForShards(client, options));
    std::vector<std::vector<float>> init = InitializeVariables(model, options.seed);
    std::vector<const float*> init_ptrs;
    for (const auto& v : init) init_ptrs.push_back(v.data());
    absl::StatusOr<RegisterResult> register_result = client->Register(init_ptrs);
    if (!register_result.ok()) return InCall(register_result.status(), "registering the model");
    const RegisterResult& registered = *register_result;
    // A chief restarted against running shards trains on from their values,
    // not from its own initial ones: say which.
    if (options.progress != nullptr) {
      std::fprintf(options.progress,
                   "registered the model: %d parts created with this worker's initial values, "
                   "%d kept as the ps shards hold them%s\n",
                   registered.parts_created, registered.parts_kept,
                   registered.retried ? " (a registration was retried: parts created by an "
                                        "attempt whose reply was lost count as kept)"
                                      : "");
      std::fflush(options.progress);
    }
  } else {
    // As TensorFlow's workers log that they wait for the model, a line
    // about every 10 s says what is missing (the wait was silent for up to
    // --wait_for_variables_s).
    PsClient::WaitingFn waiting;
    if (options.progress != nullptr) {
      waiting = [&](absl::Duration waited, absl::string_view missing) {
        std::fprintf(
            options.progress, "waiting for the chief to register the model (%s of %s): %s\n",
            absl::FormatDuration(absl::Trunc(waited, absl::Seconds(1))).c_str(),
            absl::FormatDuration(options.wait_for_variables).c_str(), std::string(missing).c_str());
        std::fflush(options.progress);
      };
    }
    if (absl::Status waited = client->WaitForVariables(options.wait_for_variables, waiting);
        !waited.ok()) {
      if (!absl::IsDeadlineExceeded(waited)) return waited;
      return absl::DeadlineExceededError(
          absl::StrCat(waited.message(), " (the wait is --wait_for_variables_s)"));
    }
  }
  // Waiting for the shards or the chief is not training: a worker started
  // 5 s before its chief reported 2,852 examples/s against the chief's
  // 177,926 for the same steps.
  summary.setup_s = Seconds(start);
  PullResult read;
  {
    const absl::Time t = absl::Now();
    absl::StatusOr<PullResult> first = client->Pull(params[0].ptrs);
    if (!first.ok()) return InCall(first.status(), "the first pull, before training");
    read = *first;
    summary.pull_s += Seconds(t);
  }
  params[1].CopyFrom(params[0]);  // same values, own storage


  // A GPU backend copies straight from and to pinned tensors.
  PinnedTensors pinned(backend);
  bool warned = false;
  for (Buffers* b : {&params[0], &params[1], &grads[0], &grads[1]}) {
    for (FloatBuffer& d : b->data) {
      absl::Status s = pinned.Pin(d.data(), d.size());
      if (!s.ok() && !warned) {
        std::fprintf(stderr, "worker: %s\n", std::string(s.message()).c_str());
        warned = true;
      }
    }
  }

  // Written by the comm thread between Start and Wait.
  double clip_s = 0, push_s = 0, pull_s = 0, push_pull_s = 0;
  int64_t read_version = read.max_version;
  // Pushes grads[g] and pulls into params[p]; an error says which call of
  // which step failed ("the push of step S (epoch E, batch B)", counted
  // from 1, B as the progress line counts).
  auto communicate = [&](int g, int p, int64_t step, int epoch, int64_t batch) -> absl::Status {
    auto in_call = [&](const absl::Status& status, absl::string_view call) {
      return InCall(status, absl::StrCat(call, " of step ", step + 1, " (epoch ", epoch + 1,
                                         ", batch ", batch + 1, ")"));
    };
    absl::Time t = absl::Now();
    // On this thread, while the next step computes.
    if (options.clip.enabled()) {
      ClipGradients(options.clip, grads[g].ptrs, sizes);
      clip_s += Seconds(t);
      t = absl::Now();
    }
    if (options.fused_push_pull) {
      absl::StatusOr<PullResult> r =
          client->PushPull(grads[g].cptrs, {step, read_version}, params[p].ptrs);
      if (!r.ok()) {
        if (GradientStillHeld(r.status())) keep_grads.held = true;
        return in_call(r.status(), "the push and pull (PushPull)");
      }
      push_pull_s += Seconds(t);
      read_version = r->max_version;
      return absl::OkStatus();
    }
    if (absl::Status pushed = client->Push(grads[g].cptrs, {step, read_version}); !pushed.ok()) {
      if (GradientStillHeld(pushed)) keep_grads.held = true;
      return in_call(pushed, "the push");
    }
    push_s += Seconds(t);
    t = absl::Now();
    absl::StatusOr<PullResult> pulled = client->Pull(params[p].ptrs);
    if (!pulled.ok()) return in_call(pulled.status(), "the pull");
    const PullResult& r = *pulled;
    pull_s += Seconds(t);
    read_version = r.max_version;
    return absl::OkStatus();
  };
  // Declared after what its jobs use, so that on an early return it is
  // destroyed (waiting for a job still running) before them.
  std::optional<CommThread> comm;
  try {
    comm.emplace();
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("could not start the worker's thread for pushes and pulls: ", e.what(),
                     " (is the process out of threads?)"));
  }

  int64_t step = 0;
  const auto capped = [&] { return options.train_steps > 0 && step >= options.train_steps; };
  // The progress shows the epochs and steps that will run, as Keras does
  // with steps_per_epoch: --train_steps=20 draws 20/20 in "Epoch 1/1", not
  // 20/938 in "Epoch 1/3".
  const int64_t per_epoch = batcher->batches_per_epoch();
  int64_t shown_epochs = options.epochs;
  if (options.train_steps > 0 && per_epoch > 0) {
    shown_epochs = std::min(shown_epochs, (options.train_steps + per_epoch - 1) / per_epoch);
  }
  for (int epoch = 0; epoch < options.epochs && !capped(); ++epoch) {
    const absl::Time epoch_start = absl::Now();
    progress.StartEpoch(
        epoch + 1, static_cast<int>(shown_epochs),
        options.train_steps > 0 ? std::min(per_epoch, options.train_steps - step) : per_epoch);
    StepResult totals;
    int64_t seen = 0, epoch_steps = 0;
    while (!capped()) {
      absl::Time t = absl::Now();
      const Batch* batch = batcher->Next(epoch);
      summary.wait_data_s += Seconds(t);
      if (batch == nullptr) break;
      const int cur = options.overlap ? static_cast<int>(step % 2) : 0;
      t = absl::Now();
      PSFLOW_RETURN_IF_ERROR(backend->TrainStep(params[cur].cptrs, batch->images, batch->labels,
                                                batch->size, grads[cur].ptrs, &totals));
      summary.compute_s += Seconds(t);
      t = absl::Now();
      PSFLOW_RETURN_IF_ERROR(comm->Wait());  // the previous step's push and pull
      summary.wait_comm_s += Seconds(t);
      // Push this gradient; pull into the buffer this step used. The next
      // step uses the other buffer, which the previous job filled.
      comm->Start([&, cur, s = step, e = epoch, b = epoch_steps] {
        return communicate(cur, cur, s, e, b);
      });
      if (!options.overlap) {
        t = absl::Now();
        PSFLOW_RETURN_IF_ERROR(comm->Wait());
        summary.wait_comm_s += Seconds(t);
      }
      ++step;
      ++epoch_steps;
      seen += batch->size;
      progress.Update(epoch_steps, totals.loss_sum / seen,
                      static_cast<double>(totals.correct) / seen, seen);
    }
    absl::Time t = absl::Now();
    PSFLOW_RETURN_IF_ERROR(comm->Wait());
    summary.wait_comm_s += Seconds(t);

    EpochSummary e;
    e.epoch = epoch + 1;
    e.steps = epoch_steps;
    e.train_loss = seen > 0 ? totals.loss_sum / seen : 0;
    e.train_accuracy = seen > 0 ? static_cast<double>(totals.correct) / seen : 0;
    summary.examples += seen;
    const bool last = capped() || epoch + 1 == options.epochs;
    std::string extra;
    if (options.is_chief || last) {
      t = absl::Now();
      // Evaluate the newest variables of the whole job.
      if (absl::Status s = client->Pull(params[0].ptrs).status(); !s.ok()) {
        return InCall(s, absl::StrCat("the pull for the evaluation after epoch ", epoch + 1));
      }
      summary.pull_s += Seconds(t);
      t = absl::Now();
      PSFLOW_RETURN_IF_ERROR(Evaluate(backend, params[0].cptrs, test, options.batch_size,
                                      &e.test_loss, &e.test_accuracy));
      summary.eval_s += Seconds(t);
      extra = absl::StrFormat(" - test_loss: %.4f - test_accuracy: %.4f", e.test_loss,
                              e.test_accuracy);
      // The other buffer must hold values of the same age for the next step.
      params[1].CopyFrom(params[0]);
    }
    e.seconds = Seconds(epoch_start);
    e.resident_bytes = ResidentBytes();
    progress.EndEpoch(extra);
    summary.epochs.push_back(e);
  }
  summary.steps = step;
  summary.clip_s = clip_s;
  summary.push_s = push_s;
  summary.pull_s += pull_s;
  summary.push_pull_s = push_pull_s;
  summary.wall_seconds = Seconds(start);
  const double train_seconds = summary.wall_seconds - summary.eval_s - summary.setup_s;
  summary.examples_per_sec = train_seconds > 0 ? summary.examples / train_seconds : 0;
  if (!summary.epochs.empty()) {
    const EpochSummary& last = summary.epochs.back();
    summary.train_loss = last.train_loss;
    summary.train_accuracy = last.train_accuracy;
    summary.test_loss = last.test_loss;
    summary.test_accuracy = last.test_accuracy;
  }
  summary.resident_bytes = ResidentBytes();
  summary.peak_resident_bytes = PeakResidentBytes();
  return summary;
}

std::string JsonString(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string SummaryToJson(const TrainSummary& s, const std::string& extra) {
  std::string out = "{";
  if (!extra.empty()) absl::StrAppend(&out, extra, ", ");
  AppendNumber(&out, "test_accuracy", s.test_accuracy);
  AppendNumber(&out, "test_loss", s.test_loss);
  AppendNumber(&out, "train_accuracy", s.train_accuracy);
  AppendNumber(&out, "train_loss", s.train_loss);
  AppendInteger(&out, "steps", s.steps);
  AppendInteger(&out, "examples", s.examples);
  AppendNumber(&out, "examples_per_sec", s.examples_per_sec);
  AppendNumber(&out, "wall_seconds", s.wall_seconds);
  AppendInteger(&out, "resident_bytes", s.resident_bytes);
  AppendInteger(&out, "peak_resident_bytes", s.peak_resident_bytes);
  out += "\"phases\": {";
  AppendNumber(&out, "setup_s", s.setup_s);
  AppendNumber(&out, "wait_data_s", s.wait_data_s);
  AppendNumber(&out, "compute_s", s.compute_s);
  AppendNumber(&out, "wait_comm_s", s.wait_comm_s);
  AppendNumber(&out, "clip_s", s.clip_s);
  AppendNumber(&out, "push_s", s.push_s);
  AppendNumber(&out, "pull_s", s.pull_s);
  AppendNumber(&out, "push_pull_s", s.push_pull_s);
  AppendNumber(&out, "eval_s", s.eval_s, false);
  out += "}, \"epochs\": [";
  for (size_t i = 0; i < s.epochs.size(); ++i) {
    const EpochSummary& e = s.epochs[i];
    out += "{";
    AppendInteger(&out, "epoch", e.epoch);
    AppendInteger(&out, "steps", e.steps);
    AppendNumber(&out, "train_loss", e.train_loss);
    AppendNumber(&out, "train_accuracy", e.train_accuracy);
    AppendNumber(&out, "test_loss", e.test_loss);
    AppendNumber(&out, "test_accuracy", e.test_accuracy);
    AppendNumber(&out, "seconds", e.seconds);
    AppendInteger(&out, "resident_bytes", e.resident_bytes, false);
    out += i + 1 < s.epochs.size() ? "}, " : "}";
  }
  out += "]}\n";
  return out;
}

}  // namespace psflow::worker
