// The worker's training loop: asynchronous data-parallel training against
// the parameter servers, as TF2's ParameterServerStrategy does it. Each
// worker pulls the variables, computes the gradient of one batch of its own
// shard of the data, and pushes it; the PS shards apply the optimizer.
//
// With `overlap` (the default) a communication thread pushes step k's
// gradient and pulls fresh variables while step k+1 computes, so a step
// costs max(compute, push + pull) instead of their sum; the variables a step
// uses then lag the worker's own updates by one step (staleness 1, on top of
// the staleness async training has anyway).
//
// With `fused_push_pull` the push and the pull are one PushPull call per
// shard: each shard answers every gradient message with the values it just
// updated, so the gradient goes out while the new values come back. On a
// network link that takes about as long as one transfer instead of two
// (docs/BENCHMARKS.md). The values then are those of the moment each chunk
// was updated, a little older than a Pull after the whole push would read;
// the main job measured a slightly lower accuracy that way (0.9013 against
// 0.9036, mean test accuracy after 3 epochs), so it is off by default.
#ifndef PSFLOW_WORKER_TRAINER_H_
#define PSFLOW_WORKER_TRAINER_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/backend.h"
#include "worker/data/dataset.h"
#include "worker/gradient_clip.h"
#include "worker/model/model_def.h"
#include "worker/ps_client.h"

namespace psflow::worker {

struct TrainerOptions {
  int replica_index = 0;   // this worker among the training replicas (data shard)
  int num_replicas = 1;
  bool is_chief = true;    // registers the variables; evaluates after every epoch
  int batch_size = 64;
  int epochs = 3;
  int64_t train_steps = 0;  // stop after this many steps of this worker (0: no cap)
  uint64_t seed = 0;        // initial values and shuffling; the same on every worker
  bool overlap = true;      // overlap push/pull with compute (see above)
  bool fused_push_pull = false;  // PushPull instead of Push then Pull (see above)
  // How long a worker waits for the cluster: the chief for every ps shard
  // to answer, the others for the chief to register the variables.
  absl::Duration wait_for_variables = absl::Minutes(5);
  // Keras's clipnorm / clipvalue / global_clipnorm, applied to each step's
  // gradient before it is pushed (gradient_clip.h).
  ClipOptions clip;
  FILE* progress = stdout;  // Keras-style progress; nullptr for none
  bool progress_tty = false;  // rewrite one line with '\r' (a terminal)
};

struct EpochSummary {
  int epoch = 0;
  int64_t steps = 0;
  double train_loss = 0, train_accuracy = 0;
  double test_loss = -1, test_accuracy = -1;  // -1 when not evaluated
  double seconds = 0;
  int64_t resident_bytes = 0;  // at the end of the epoch
};

struct TrainSummary {
  int64_t steps = 0;
  int64_t examples = 0;
  double wall_seconds = 0;
  double examples_per_sec = 0;
  double train_loss = 0, train_accuracy = 0;  // last epoch
  double test_loss = -1, test_accuracy = -1;   // final evaluation
  // Where the time went (seconds). Before training: waiting for the shards
  // and registering the model (chief), or waiting for the chief's
  // registration (setup_s; examples_per_sec leaves it out, as it does
  // eval_s). Main thread: waiting for a batch,
  // computing, waiting for the communication thread; communication:
  // clipping the gradient (clip_s, with a ClipOptions set), push and pull
  // themselves, or the fused PushPull calls (they overlap compute when
  // overlap is on). pull_s also holds the initial pull and the pulls before
  // each evaluation.
  double setup_s = 0, wait_data_s = 0, compute_s = 0, wait_comm_s = 0, clip_s = 0, push_s = 0,
         pull_s = 0, push_pull_s = 0, eval_s = 0;
  int64_t resident_bytes = 0, peak_resident_bytes = 0;
  std::vector<EpochSummary> epochs;
};

// Trains `model` with `backend` (already Prepared for batch_size) through
// `client` on `train`, evaluating on `test`.
absl::StatusOr<TrainSummary> Train(const ModelDef& model, ComputeBackend* backend,
                                   PsClient* client, const Dataset& train, const Dataset& test,
                                   const TrainerOptions& options);

// Loss and accuracy of `params` on all of `data`, in batches of `batch_size`.
absl::Status Evaluate(ComputeBackend* backend, absl::Span<const float* const> params,
                      const Dataset& data, int batch_size, double* loss, double* accuracy);

// `text` as a JSON string: quoted, with quotes, backslashes and control
// characters escaped (a model file's path may hold any of them).
std::string JsonString(std::string_view text);

// The summary as a JSON object; `extra` are pre-rendered "key": value pairs
// (without braces) added first.
std::string SummaryToJson(const TrainSummary& summary, const std::string& extra);

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_TRAINER_H_
