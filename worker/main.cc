// worker: trains a model on its shard of a data set against psflow's
// parameter servers.
//
//   worker --ps_hosts=localhost:2222,localhost:2223 --task_index=0
//          --worker_hosts=localhost:2230,localhost:2231 --dataset=fashion_mnist --epochs=3
//   TF_CONFIG='{"cluster":{"ps":[...],"worker":[...]},"task":{"type":"worker","index":1}}' worker
//
// The chief (or worker 0 when the cluster lists no chief) registers the
// variables and evaluates on the test set after every epoch.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cluster_spec.h"
#include "common/flags_usage.h"
#include "common/process_stats.h"
#include "worker/backend.h"
#include "worker/data/batcher.h"
#include "worker/data/dataset.h"
#include "worker/grpc_ps_client.h"
#include "worker/model/model_def.h"
#include "worker/trainer.h"

ABSL_FLAG(std::string, ps_hosts, "", "Comma-separated ps addresses (overrides TF_CONFIG).");
ABSL_FLAG(std::string, worker_hosts, "", "Comma-separated worker addresses (overrides TF_CONFIG).");
ABSL_FLAG(std::string, chief_host, "", "The chief's address, if the cluster has a chief.");
ABSL_FLAG(std::string, task_type, "", "worker or chief (default: TF_CONFIG task.type, else worker).");
ABSL_FLAG(std::optional<int>, task_index, std::nullopt,
          "This task's index (default: TF_CONFIG task.index, else 0 if its job lists one "
          "address; required otherwise).");
ABSL_FLAG(std::string, dataset, "fashion_mnist", "fashion_mnist | mnist | cifar10.");
ABSL_FLAG(std::string, data_dir, "",
          "Directory of the data set files (default: /usr/share/datasets/fashion-mnist for "
          "fashion_mnist, /usr/share/datasets/mnist for mnist; cifar10 needs it).");
ABSL_FLAG(std::string, model, "seed",
          "Model spec (e.g. conv2d:32:3:relu,flatten,dense:128:relu,dense:10), a built-in "
          "(seed, two_conv) or @file.");
ABSL_FLAG(int, batch_size, 64, "Examples per step and worker.");
ABSL_FLAG(int, epochs, 3, "Passes over this worker's shard of the training set.");
ABSL_FLAG(int64_t, train_steps, 0, "Stop after this many steps of this worker (0: no cap).");
ABSL_FLAG(std::string, device, "auto", "auto | cpu | cuda | reference (auto: cuda if a GPU is visible).");
ABSL_FLAG(int, threads, 0,
          "CPU threads for compute (0: the usable cores (CPU affinity, the container's CPU "
          "limit) shared among the cluster's chief and workers on this machine, at least 1; at "
          "most 256).");
ABSL_FLAG(double, gpu_memory_limit_mb, 0,
          "CUDA: most device memory the worker's buffers may take (parameters, activations, "
          "gradients, workspaces; never more than is free). The CUDA context and the "
          "libraries' handles, a few hundred MB, come on top (0: no cap).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the initial values and the shuffling (same on every worker).");
ABSL_FLAG(bool, overlap, true, "Overlap push/pull of one step with the compute of the next.");
ABSL_FLAG(double, clipnorm, 0,
          "Clip each variable's gradient to this L2 norm before pushing it, as Keras' clipnorm "
          "(0: off; at most one of --clipnorm, --clipvalue, --global_clipnorm).");
ABSL_FLAG(double, clipvalue, 0,
          "Clip each gradient element to [-clipvalue, clipvalue] before pushing, as Keras' "
          "clipvalue (0: off).");
ABSL_FLAG(double, global_clipnorm, 0,
          "Scale all of a step's gradients so that their joint L2 norm is at most this, before "
          "pushing, as Keras' global_clipnorm (0: off).");
ABSL_FLAG(bool, fused_push_pull, false,
          "Push the gradient and pull the new values in one PushPull call per ps shard, both "
          "directions at once (1.5-1.8x less communication time on a network link, about the "
          "same on loopback; the values read are a little older). Default: a Push, then a Pull.");
ABSL_FLAG(int64_t, max_chunk_bytes, 1 << 20,
          "Bytes per stream message at most, tensor data and framing (one element at least); "
          "less to a ps shard whose own --max_chunk_bytes is smaller (the worker asks each "
          "shard at start).");
ABSL_FLAG(std::vector<std::string>, grpc_arg, {},
          "Extra gRPC channel arguments of the connections to the ps shards, "
          "name=value[,name=value...] (for tuning experiments; grpc.keepalive_time_ms and "
          "grpc.keepalive_timeout_ms replace the default keepalive, a ping every 30000 ms while "
          "calls are open and 20000 ms to answer it, also the sockets' TCP_USER_TIMEOUT). The "
          "message size limits are psflow's (none) and are not taken here.");
ABSL_FLAG(int, ps_streams, 0,
          "Connections per ps shard that each push, pull (or PushPull) is split over, so that "
          "the shard receives it on several threads; 1 to 64, or 0 = 4 with 8 or more usable "
          "cores (CPU affinity, the container's CPU limit), else 1.");
ABSL_FLAG(int, rpc_timeout_s, 60, "Deadline of every call to a ps shard, in seconds.");
ABSL_FLAG(double, request_id_retention_s, 900,
          "Seconds the ps shards remember a push's request id (their own "
          "--request_id_retention_s): a failed push is retried only while a retry starts within "
          "this less --rpc_timeout_s and 1 s of the push, so that none is applied twice. "
          "Where a shard reports a shorter retention (GetStatus), the worker keeps to that.");
ABSL_FLAG(int, wait_for_variables_s, 300,
          "How long a worker waits for the cluster: the chief for every ps shard to answer "
          "(they may start after it), the others for the chief to register the variables "
          "(0: check once).");
ABSL_FLAG(std::string, summary_json, "", "Write a JSON summary here at the end.");

namespace {

constexpr int kMaxThreads = 256;
// The most a ps shard accepts per message (ps_server --max_chunk_bytes).
constexpr int64_t kMaxChunkBytes = int64_t{1} << 30;

// Whether `path` is the file this process's stdout or stderr goes to
// (--summary_json=/dev/stdout, or the log's own name): emptying it would
// take the log with it.
bool IsOwnOutput(const std::string& path) {
  struct stat file {};
  if (::stat(path.c_str(), &file) != 0) return false;
  for (int fd : {STDOUT_FILENO, STDERR_FILENO}) {
    struct stat out {};
    if (::fstat(fd, &out) == 0 && out.st_dev == file.st_dev && out.st_ino == file.st_ino) {
      return true;
    }
  }
  return false;
}

// Removes the summary an earlier run left at `path`, so that a run that
// fails cannot be taken for it: a regular file (not /dev/null or a pipe,
// nor this process's own log); a symbolic link stays, and the file it
// points to is emptied.
void ForgetEarlierSummary(const std::string& path) {
  if (IsOwnOutput(path)) return;
  std::error_code error;
  const std::filesystem::file_status own = std::filesystem::symlink_status(path, error);
  if (std::filesystem::is_symlink(own)) {
    if (std::filesystem::is_regular_file(path, error)) {
      std::ofstream(path, std::ios::trunc).close();
    }
  } else if (std::filesystem::is_regular_file(own)) {
    std::filesystem::remove(path, error);
    if (error) {  // a directory we may not change: empty it at least
      std::ofstream(path, std::ios::trunc).close();
    }
  }
}

// What the error line begins with: "worker", then "worker N" once the
// cluster says which replica this is, so that the last lines of several
// workers' merged logs tell who failed (as their retry lines do).
std::string& ErrorPrefix() {
  static auto* prefix = new std::string("worker");
  return *prefix;
}

int Fail(const absl::Status& status) {
  const std::string line = psflow::ErrorLine(ErrorPrefix(), status.ToString());
  std::fwrite(line.data(), 1, line.size(), stderr);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  psflow::SetUsage(
      "psflow worker: trains a model against the parameter servers.\n"
      "  worker --ps_hosts=h:2222,h:2223 --worker_hosts=h:2230,h:2231 --task_index=0\n"
      "  or set TF_CONFIG as Kubeflow's TFJob writes it (task.type \"worker\" or \"chief\").",
      "worker/main.cc");
  // A run refused by the flag parser (an unknown flag, a value that is not
  // a number) fails too, and removes the earlier summary: its path as the
  // command line gives it, a --flagfile's included (the parse may have
  // stopped before it set the flag, or set it from a file that a later
  // flag overrides), else as far as the flags were parsed (--fromenv).
  psflow::ParseFlagsOrExit(argc, argv, "worker", [argc, argv] {
    std::string path = psflow::CommandLineValue(argc, argv, "summary_json").value_or("");
    if (path.empty()) path = absl::GetFlag(FLAGS_summary_json);
    if (!path.empty()) ForgetEarlierSummary(path);
  });
  psflow::TuneAllocatorForLargeMessages();
  // A log reader that went away (`| head`, a `tee` that was stopped) must
  // not end the training with SIGPIPE at the next progress line: the
  // writes fail instead.
  std::signal(SIGPIPE, SIG_IGN);
  // The summary is written at the end of training: find out now whether it
  // can be, not after the run, and before any other check can fail. Then
  // the file is removed: the one the probe created, so that a run that
  // fails leaves no empty summary behind, and one an earlier run left, so
  // that it cannot pass for this run's.
  if (const std::string path = absl::GetFlag(FLAGS_summary_json); !path.empty()) {
    std::ofstream probe(path, std::ios::app);
    if (!probe) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--summary_json=", path, " cannot be written: ", std::strerror(errno))));
    }
    probe.close();
    ForgetEarlierSummary(path);
  }
  // A container's entry point runs as PID 1, to which the kernel delivers
  // no signal the process has no handler for: SIGTERM (docker stop, a pod's
  // deletion) was dropped, and the worker trained on until the SIGKILL that
  // follows the grace period. There it ends as the signal would end it
  // elsewhere (exit code 128 + the signal's number).
  if (getpid() == 1) {
    struct sigaction action {};
    action.sa_handler = [](int sig) { _exit(128 + sig); };
    sigaction(SIGTERM, &action, nullptr);
    sigaction(SIGINT, &action, nullptr);
  }
  // Debian's Abseil is built with Mutex deadlock detection on, which keeps a
  // lock graph on every acquisition of the hot path; our lock order is fixed.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  using namespace psflow::worker;  // NOLINT: a main file

  psflow::ClusterFlags flags;
  flags.ps_hosts = absl::GetFlag(FLAGS_ps_hosts);
  flags.worker_hosts = absl::GetFlag(FLAGS_worker_hosts);
  flags.chief_host = absl::GetFlag(FLAGS_chief_host);
  flags.task_type = absl::GetFlag(FLAGS_task_type);
  if (const std::optional<int> index = absl::GetFlag(FLAGS_task_index); index.has_value()) {
    if (*index < 0) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--task_index=", *index, "; expected 0 or more")));
    }
    flags.task_index = *index;
  }
  flags.default_task_type = "worker";  // TF_CONFIG's task.type, when given, wins
  const char* tf_config = std::getenv("TF_CONFIG");
  if (psflow::TfConfigAbsent(tf_config) && flags.worker_hosts.empty() &&
      flags.chief_host.empty()) {
    return Fail(absl::InvalidArgumentError(
        "without TF_CONFIG, give --worker_hosts (every worker's \"host:port\", this one "
        "included; they number the replicas) and/or --chief_host"));
  }
  auto cluster = psflow::ResolveCluster(tf_config, flags);
  if (!cluster.ok()) return Fail(cluster.status());
  for (const std::string& note : cluster->overrides) {
    std::fprintf(stderr, "worker: warning: %s\n", note.c_str());
  }
  // Numbers that make no sense are refused before anything runs.
  if (absl::GetFlag(FLAGS_epochs) < 1) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--epochs=", absl::GetFlag(FLAGS_epochs), "; expected 1 or more")));
  }
  if (absl::GetFlag(FLAGS_train_steps) < 0) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--train_steps=", absl::GetFlag(FLAGS_train_steps), "; expected 0 (no cap) or more")));
  }
  if (absl::GetFlag(FLAGS_threads) < 0 || absl::GetFlag(FLAGS_threads) > kMaxThreads) {
    // Far more threads than cores crashed in OpenMP (100,000) or failed in
    // oneDNN with a message naming neither.
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--threads=", absl::GetFlag(FLAGS_threads), "; expected 0 (automatic) to ", kMaxThreads)));
  }
  // At most 1 PiB: infinity used to become a cap of 0 bytes.
  if (const double mb = absl::GetFlag(FLAGS_gpu_memory_limit_mb); !(mb >= 0 && mb <= 1 << 30)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--gpu_memory_limit_mb=", mb, "; expected 0 (no cap) to 1073741824 (1 PiB)")));
  }
  psflow::worker::ClipOptions clip;
  clip.clipnorm = absl::GetFlag(FLAGS_clipnorm);
  clip.clipvalue = absl::GetFlag(FLAGS_clipvalue);
  clip.global_clipnorm = absl::GetFlag(FLAGS_global_clipnorm);
  if (absl::Status s = psflow::worker::ValidateClipOptions(clip); !s.ok()) return Fail(s);
  if (absl::GetFlag(FLAGS_wait_for_variables_s) < 0) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--wait_for_variables_s=", absl::GetFlag(FLAGS_wait_for_variables_s),
                     "; expected 0 (check once) or more seconds")));
  }
  if (const int64_t chunk = absl::GetFlag(FLAGS_max_chunk_bytes);
      chunk < 4 || chunk > kMaxChunkBytes) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--max_chunk_bytes=", chunk, "; expected 4 to ", kMaxChunkBytes, " (1 GiB)")));
  }
  if (cluster->task_type != "worker" && cluster->task_type != "chief") {
    // What to do instead, for the task types a TensorFlow job has.
    std::string hint;
    if (cluster->task_type == "ps") hint = " (a ps task runs ps_server)";
    if (cluster->task_type == "evaluator") {
      hint =
          " (psflow has no evaluator task yet: leave it out of the job; the chief evaluates on "
          "the test set after every epoch)";
    }
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("this process's task is \"", cluster->task_type,
                     "\"; the worker binary runs \"worker\" or \"chief\" tasks", hint)));
  }
  if (cluster->ps.empty()) {
    return Fail(absl::InvalidArgumentError("the cluster lists no ps tasks (--ps_hosts or "
                                           "TF_CONFIG cluster.ps)"));
  }
  const int replica = cluster->replica_index();
  const int replicas = cluster->num_replicas();
  ErrorPrefix() = absl::StrCat("worker ", replica);

  auto data = LoadDataset(absl::GetFlag(FLAGS_dataset), absl::GetFlag(FLAGS_data_dir));
  if (!data.ok()) return Fail(data.status());
  auto model = ParseModel(absl::GetFlag(FLAGS_model),
                          {data->train.height, data->train.width, data->train.channels});
  if (!model.ok()) return Fail(model.status());
  int64_t parameters = 0;
  for (const auto& v : model->variables) parameters += v.num_elements();
  const int batch_size = absl::GetFlag(FLAGS_batch_size);
  if (batch_size < 1) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--batch_size=", batch_size, "; expected at least 1")));
  }

  BackendOptions backend_options;
  int threads = absl::GetFlag(FLAGS_threads);
  const int cores = psflow::UsableCores();  // affinity and the cgroup's CPU limit
  if (threads <= 0) {
    // The cores shared by the training processes on this machine: two
    // workers of 2 threads each on 2 cores ran 3.3 times slower than with
    // one each (an OpenMP team waits at every barrier for its thread that
    // lost its core).
    threads = std::max(1, cores / cluster->local_replicas());
  } else if (threads > cores) {
    std::fprintf(stderr,
                 "worker: warning: --threads=%d on %d usable cores; compute slows down when its "
                 "threads outnumber the cores (64 threads on 2 cores ran 12 times slower)\n",
                 threads, cores);
  }
  backend_options.threads = threads;
  backend_options.gpu_memory_limit_mb = absl::GetFlag(FLAGS_gpu_memory_limit_mb);
  auto backend = CreateBackend(absl::GetFlag(FLAGS_device), backend_options);
  if (!backend.ok()) return Fail(backend.status());
  {
    // A model, a batch or an image beyond the machine's memory is refused
    // here instead of ending in std::bad_alloc. What is counted is the
    // least the worker holds: the trainer's two parameter and two gradient
    // buffers and the backend's copy of the weights; a batch's activations
    // and their gradients (on the CPU; a GPU's are in device memory, which
    // its backend checks); the batches the data pipeline assembles ahead.
    const double gib = 1 << 30;
    const double weights = static_cast<double>(parameters) * 4 * 6;
    const int64_t per_example = ActivationsPerExample(*model);
    const double activations = (*backend)->ActivationsInHostMemory()
                                   ? static_cast<double>(per_example) * batch_size * 4 * 2
                                   : 0;
    const double batches = static_cast<double>(data->train.example_size()) * batch_size * 4 *
                           (BatcherOptions().prefetch + 1);
    const double need = weights + activations + batches;
    // The machine's RAM, or the container's (pod's) cgroup limit where lower.
    const double have = static_cast<double>(psflow::MemoryLimitBytes());
    if (have > 0 && need > have) {
      return Fail(absl::ResourceExhaustedError(absl::StrFormat(
          "--model=%s with --batch_size=%d on %dx%dx%d examples needs at least %.1f GiB here: "
          "%.1f GiB for its %d parameters (6 float32 copies: parameters and gradients, twice "
          "each, and the backend's), %.1f GiB for a batch's activations and their gradients "
          "(%d values per example), %.1f GiB for the input batches assembled ahead; but this "
          "process may use %.1f GiB (the machine's memory, or its cgroup's limit where lower)",
          absl::GetFlag(FLAGS_model), batch_size, data->train.height, data->train.width,
          data->train.channels, need / gib, weights / gib, parameters, activations / gib,
          per_example, batches / gib, have / gib)));
    }
  }
  if (absl::Status s = (*backend)->Prepare(*model, batch_size); !s.ok()) return Fail(s);

  GrpcPsClientOptions client_options;
  client_options.ps_addresses = cluster->ps;
  client_options.worker_id = replica;
  client_options.model_fingerprint = ModelFingerprint(*model, absl::GetFlag(FLAGS_dataset));
  client_options.max_chunk_bytes = absl::GetFlag(FLAGS_max_chunk_bytes);
  client_options.streams_per_shard = absl::GetFlag(FLAGS_ps_streams);
  if (client_options.streams_per_shard == 0) {
    client_options.streams_per_shard = AutoStreamsPerShard(cores);
  }
  auto grpc_args = psflow::ParseNameValues("grpc_arg", absl::GetFlag(FLAGS_grpc_arg));
  if (!grpc_args.ok()) return Fail(grpc_args.status());
  if (absl::Status s = psflow::CheckGrpcArgs("grpc_arg", *grpc_args); !s.ok()) return Fail(s);
  client_options.grpc_args = std::move(*grpc_args);
  client_options.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
  const double retention_s = absl::GetFlag(FLAGS_request_id_retention_s);
  if (!(retention_s >= 0 && retention_s <= 1e9)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--request_id_retention_s is ", retention_s, "; expected 0 to 1e9 seconds")));
  }
  client_options.request_id_retention = absl::Seconds(retention_s);
  if (client_options.request_id_retention <=
      client_options.rpc_timeout + kPushRetryRetentionMargin) {
    std::fprintf(stderr,
                 "worker: warning: --request_id_retention_s=%g is not above --rpc_timeout_s=%d "
                 "plus 1 s: no failed push will be retried (a retry must start within the "
                 "retention less the deadline and a second, so that none is applied twice)\n",
                 retention_s, absl::GetFlag(FLAGS_rpc_timeout_s));
  }
  // A shard gone away is retried for about 16 s before the worker gives
  // up: say so while it happens, as TensorFlow logs its retries.
  client_options.retrying = [replica](absl::string_view call, const absl::Status& failed,
                                      int next_attempt, int max_attempts, absl::Duration wait) {
    const std::string line = psflow::ErrorLine(
        absl::StrCat("worker ", replica),
        absl::StrCat("retrying a ", call, " (attempt ", next_attempt, " of at most ", max_attempts,
                     ", in ", absl::FormatDuration(absl::Trunc(wait, absl::Milliseconds(1))),
                     ") after ", failed.ToString()));
    std::fputs(line.c_str(), stderr);
    std::fflush(stderr);
  };
  auto client = CreateGrpcPsClient(model->variables, client_options);
  if (!client.ok()) return Fail(client.status());

  // "1 thread", "2 threads".
  auto count = [](int64_t n, absl::string_view noun) {
    return absl::StrCat(n, " ", noun, n == 1 ? "" : "s");
  };
  const std::string examples =
      replicas == 1 ? "each epoch" : absl::StrCat("shared by ", replicas, " workers each epoch");
  std::printf(
      "worker %d of %d%s: %s, model %s (%lld parameters), %lld training examples %s, "
      "device %s, %s, %s (%s each)\n",
      replica, replicas, cluster->is_chief() ? " (chief)" : "",
      absl::GetFlag(FLAGS_dataset).c_str(), model->spec.c_str(), static_cast<long long>(parameters),
      static_cast<long long>(data->train.num_examples), examples.c_str(),
      (*backend)->name().c_str(), count(threads, "thread").c_str(),
      count(static_cast<int64_t>(cluster->ps.size()), "ps shard").c_str(),
      count(client_options.streams_per_shard, "connection").c_str());
  std::fflush(stdout);

  TrainerOptions options;
  options.replica_index = replica;
  options.num_replicas = replicas;
  options.is_chief = cluster->is_chief();
  options.batch_size = batch_size;
  options.epochs = absl::GetFlag(FLAGS_epochs);
  options.train_steps = absl::GetFlag(FLAGS_train_steps);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.overlap = absl::GetFlag(FLAGS_overlap);
  options.fused_push_pull = absl::GetFlag(FLAGS_fused_push_pull);
  options.wait_for_variables = absl::Seconds(absl::GetFlag(FLAGS_wait_for_variables_s));
  options.clip = clip;
  options.progress_tty = isatty(fileno(stdout)) != 0;
  auto summary = Train(*model, backend->get(), client->get(), data->train, data->test, options);
  if (!summary.ok()) return Fail(summary.status());

  std::printf(
      "worker %d: %lld steps, %.0f examples/s, test_accuracy %.4f, test_loss %.4f, "
      "%.1f s (compute %.1f s, waiting for push/pull %.1f s, data %.1f s, eval %.1f s, "
      "setup %.1f s)\n",
      replica, static_cast<long long>(summary->steps), summary->examples_per_sec,
      summary->test_accuracy, summary->test_loss, summary->wall_seconds, summary->compute_s,
      summary->wait_comm_s, summary->wait_data_s, summary->eval_s, summary->setup_s);
  const std::string path = absl::GetFlag(FLAGS_summary_json);
  if (!path.empty()) {
    const std::string extra = absl::StrFormat(
        "\"worker\": %d, \"num_workers\": %d, \"chief\": %s, \"device\": %s, \"model\": "
        "%s, \"dataset\": %s, \"batch_size\": %d, \"threads\": %d, \"ps_shards\": %d, "
        "\"parameters\": %d",
        replica, replicas, cluster->is_chief() ? "true" : "false", JsonString((*backend)->name()),
        JsonString(model->spec), JsonString(absl::GetFlag(FLAGS_dataset)), batch_size, threads,
        static_cast<int>(cluster->ps.size()), parameters);
    // Appended where it is this process's own output (/dev/stdout): opening
    // it afresh would empty the log written so far.
    std::ofstream out(path, IsOwnOutput(path) ? std::ios::app : std::ios::trunc);
    out << SummaryToJson(*summary, extra);
    out.close();  // the bytes reach the file here, or fail to (a full disk)
    if (out.fail()) {
      return Fail(absl::UnavailableError(
          absl::StrCat("--summary_json: cannot write ", path, ": ", std::strerror(errno))));
    }
  }
  return 0;
}
