// ps_server: one shard of psflow's parameter servers.
//
//   ps_server --port=2222 --shard_index=0 --num_shards=2
//   TF_CONFIG='{"cluster":{"ps":["h0:2222","h1:2222"]},"task":{"type":"ps","index":1}}' ps_server
//
// Flags win over TF_CONFIG. SIGTERM or SIGINT shut the server down
// gracefully (calls in flight may finish, for up to 5 s); a second one
// ends it at once.
#include <grpc/grpc.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cluster_spec.h"
#include "common/flags_usage.h"
#include "common/process_stats.h"
#include "common/protobuf_log.h"
#include "common/status_macros.h"
#include "ps_server/grpc_ps_server.h"

ABSL_FLAG(std::optional<int>, port, std::nullopt,
          "Port to listen on, on all interfaces (0 picks a free one). Default: the port of "
          "this task's address in TF_CONFIG / --ps_hosts (a unix:path address is listened on "
          "as it is), else 2222.");
ABSL_FLAG(std::string, address, "",
          "Full listen address instead of --port, e.g. 0.0.0.0:2222 or unix:/tmp/ps0.sock.");
ABSL_FLAG(std::optional<int>, shard_index, std::nullopt,
          "This shard's index (default: TF_CONFIG task.index, else 0 if there is one shard; "
          "required otherwise).");
ABSL_FLAG(std::optional<int>, num_shards, std::nullopt,
          "Number of PS shards (default: the ps list of TF_CONFIG / --ps_hosts, else 1; when "
          "given with a ps list, it must agree).");
ABSL_FLAG(std::string, ps_hosts, "", "Comma-separated ps addresses (overrides TF_CONFIG).");
ABSL_FLAG(std::string, optimizer, "adam",
          "Optimizer applied to pushed gradients: adam|adamw|sgd|adagrad|rmsprop|lion (adamw: "
          "adam with --weight_decay defaulting to 0.004, as Keras' AdamW).");
ABSL_FLAG(std::optional<double>, learning_rate, std::nullopt,
          "Learning rate of the optimizer (default: Keras's for --optimizer, 0.01 for sgd and "
          "0.001 for the others).");
ABSL_FLAG(std::string, learning_rate_schedule, "constant",
          "How the learning rate changes with the update count: constant|cosine|exponential|"
          "polynomial|inverse_time|piecewise_constant (Keras' CosineDecay, ExponentialDecay, "
          "PolynomialDecay, InverseTimeDecay and PiecewiseConstantDecay, counted per variable "
          "part).");
ABSL_FLAG(int64_t, decay_steps, 0,
          "cosine/exponential/polynomial/inverse_time: updates over which the rate decays "
          "(required for those; deploy/local/train.sh sets it from the planned steps of all "
          "workers).");
ABSL_FLAG(double, cosine_alpha, 0.0, "cosine: the final rate as a fraction of --learning_rate.");
ABSL_FLAG(int64_t, warmup_steps, 0,
          "cosine with --warmup_target: updates over which the rate rises linearly from "
          "--learning_rate (which may be 0) to --warmup_target, before the decay.");
ABSL_FLAG(std::optional<double>, warmup_target, std::nullopt,
          "cosine: the rate the warmup reaches and the decay starts from (default: no warmup).");
ABSL_FLAG(double, decay_rate, 0.96,
          "exponential: the factor per --decay_steps updates; inverse_time: the rate is "
          "--learning_rate / (1 + decay_rate * updates / --decay_steps).");
ABSL_FLAG(bool, staircase, false,
          "exponential/inverse_time: decay in whole steps of --decay_steps.");
ABSL_FLAG(double, end_learning_rate, 0.0001, "polynomial: the rate reached at --decay_steps.");
ABSL_FLAG(double, power, 1.0, "polynomial: the exponent of the decay (1 = linear).");
ABSL_FLAG(bool, cycle, false,
          "polynomial: after --decay_steps, decay again from --learning_rate over the next "
          "multiple of --decay_steps.");
ABSL_FLAG(std::vector<std::string>, piecewise_boundaries, {},
          "piecewise_constant: Keras' boundaries, comma-separated and increasing, counted as "
          "Keras counts iterations (the updates before this one): the rate is "
          "--piecewise_values[i+1] from update boundaries[i] + 2 on.");
ABSL_FLAG(std::vector<std::string>, piecewise_values, {},
          "piecewise_constant: comma-separated rates, one more than --piecewise_boundaries (up "
          "to the first boundary, between each two, after the last).");
ABSL_FLAG(double, beta_1, 0.9,
          "Adam: decay of the first moment; Lion: weight of the momentum in the update's sign.");
ABSL_FLAG(std::optional<double>, beta_2, std::nullopt,
          "Adam: decay of the second moment (default 0.999); Lion: decay of the momentum "
          "(default 0.99).");
ABSL_FLAG(double, epsilon, 1e-7, "Adam, Adagrad and RMSprop: epsilon (Keras default 1e-7).");
ABSL_FLAG(double, momentum, 0.0, "SGD and RMSprop: momentum (0 = none).");
ABSL_FLAG(double, rho, 0.9, "RMSprop: decay of the mean square of the gradients.");
ABSL_FLAG(bool, centered, false,
          "RMSprop: divide by the root of the gradients' variance (also keeps their mean).");
ABSL_FLAG(bool, nesterov, false, "SGD: Nesterov momentum.");
ABSL_FLAG(double, initial_accumulator_value, 0.1, "Adagrad: initial accumulator value.");
ABSL_FLAG(bool, amsgrad, false,
          "Adam: divide by the largest second moment seen (AMSGrad; a third slot per element).");
ABSL_FLAG(std::optional<double>, weight_decay, std::nullopt,
          "Decoupled weight decay, every optimizer: before each update a variable becomes "
          "p - p * weight_decay * learning_rate, as Keras' weight_decay (default: 0.004 for "
          "adamw, else none).");
ABSL_FLAG(std::vector<std::string>, exclude_from_weight_decay, {},
          "Variables not decayed: comma-separated regular expressions (RE2 syntax; none may "
          "hold a comma), each searched anywhere in the variable's whole name, such as "
          "dense/bias (e.g. bias leaves every bias alone). Keras' "
          "exclude_from_weight_decay(var_names=...) searches only the last part (bias): a "
          "pattern that can match only within it means the same in both, while dense "
          "excludes every variable of the layer here and none in Keras.");
ABSL_FLAG(int, threads, 0,
          "Most calls that register, pull or push served at once (0 = no limit); more wait "
          "their turn, in arrival order, until their deadline, rather than fail. GetStatus and "
          "health checks never wait.");
ABSL_FLAG(int, apply_threads, -1,
          "Threads applying pushed gradients while the next chunks arrive (0 = apply on the "
          "reading thread; -1 = one per usable core (CPU affinity, the container's CPU limit), "
          "at most 16, with 4 or more of them, else 0; at most 256).");
ABSL_FLAG(int, apply_window, 4,
          "With applier threads: messages of one push applied at once, each on its own "
          "element range (1 = one after another, in order; at most 64).");
ABSL_FLAG(std::vector<std::string>, grpc_arg, {},
          "Extra gRPC server channel arguments, name=value[,name=value...] (for tuning "
          "experiments, e.g. grpc.experimental.tcp_min_read_chunk_size=262144; each replaces "
          "the default of the same name, if any: grpc.keepalive_time_ms=30000, "
          "grpc.keepalive_timeout_ms=10000 and grpc.http2.min_ping_interval_without_data_ms=10000, "
          "the least time between the clients' pings). The message size limits are set from "
          "--max_chunk_bytes and are not taken here.");
ABSL_FLAG(int64_t, max_chunk_bytes, 4 << 20,
          "Largest tensor data accepted in one segment of a stream message (a message may add "
          "1 MiB of framing), and the largest Pull answer sent, framing included (4 bytes to "
          "1 GiB).");
ABSL_FLAG(int64_t, max_variable_bytes, 0,
          "Most bytes of parameters and optimizer slots this shard holds; a registration "
          "beyond it is refused with RESOURCE_EXHAUSTED before anything is allocated (0 = the "
          "machine's memory, or the limit of this process's cgroup (container, Kubernetes pod) "
          "where lower, less a tenth (at least 64 MiB, at most half) for the rest of the process; "
          "-1 = no limit).");
ABSL_FLAG(double, request_id_retention_s, 900,
          "Seconds a push's request id is remembered, so that a retry of it is applied once "
          "(exactly once); the workers start no retry later than their own "
          "--request_id_retention_s less --rpc_timeout_s and 1 s after the push began, so give "
          "both binaries the same value.");
ABSL_FLAG(int64_t, request_ledger_bytes, 32 << 20,
          "About the most memory the remembered request ids may take (about 230 bytes each, more "
          "for a push that left gaps); beyond it the oldest are forgotten before their "
          "retention, which the shard reports on stderr and in GetStatus.");
ABSL_FLAG(bool, allow_non_finite_gradients, false,
          "Apply gradients containing NaN or Inf, as TensorFlow does (rejected with "
          "INVALID_ARGUMENT by default). psflow's worker sends such gradients only when every "
          "ps shard sets this; otherwise it stops with an error naming the value.");

namespace {

using psflow::server::PsServer;
using psflow::server::PsServerOptions;

// Flags that only some optimizers or schedules read change nothing with
// the others: the shard says so on stderr instead of dropping them
// silently (--momentum=0.9 with the default adam was a plain Adam).
void WarnAboutUnreadFlags(const std::string& optimizer, const std::string& schedule) {
  struct Reader {
    const char* flag;
    const char* chooser;  // the flag that picks who reads it
    std::vector<std::string> readers;
  };
  const Reader readers[] = {
      {"beta_1", "optimizer", {"adam", "adamw", "lion"}},
      {"beta_2", "optimizer", {"adam", "adamw", "lion"}},
      {"epsilon", "optimizer", {"adam", "adamw", "adagrad", "rmsprop"}},
      {"amsgrad", "optimizer", {"adam", "adamw"}},
      {"momentum", "optimizer", {"sgd", "rmsprop"}},
      {"rho", "optimizer", {"rmsprop"}},
      {"centered", "optimizer", {"rmsprop"}},
      {"nesterov", "optimizer", {"sgd"}},
      {"initial_accumulator_value", "optimizer", {"adagrad"}},
      {"decay_steps",
       "learning_rate_schedule",
       {"cosine", "exponential", "polynomial", "inverse_time"}},
      {"cosine_alpha", "learning_rate_schedule", {"cosine"}},
      {"warmup_steps", "learning_rate_schedule", {"cosine"}},
      {"warmup_target", "learning_rate_schedule", {"cosine"}},
      {"decay_rate", "learning_rate_schedule", {"exponential", "inverse_time"}},
      {"staircase", "learning_rate_schedule", {"exponential", "inverse_time"}},
      {"end_learning_rate", "learning_rate_schedule", {"polynomial"}},
      {"power", "learning_rate_schedule", {"polynomial"}},
      {"cycle", "learning_rate_schedule", {"polynomial"}},
      {"piecewise_boundaries", "learning_rate_schedule", {"piecewise_constant"}},
      {"piecewise_values", "learning_rate_schedule", {"piecewise_constant"}},
  };
  for (const Reader& r : readers) {
    if (!absl::flags_internal::WasPresentOnCommandLine(r.flag)) continue;
    const bool optimizer_flag = std::string(r.chooser) == "optimizer";
    const std::string& chosen = optimizer_flag ? optimizer : schedule;
    if (std::find(r.readers.begin(), r.readers.end(), chosen) != r.readers.end()) continue;
    std::fprintf(stderr,
                 "ps_server: warning: --%s is ignored: only --%s=%s reads it, and it is %s\n",
                 r.flag, r.chooser, absl::StrJoin(r.readers, "|").c_str(), chosen.c_str());
  }
}

// The port of "host:port" or "[v6]:port", or the whole "unix:path".
std::string ListenPortOrPath(const std::string& address) {
  if (absl::StartsWith(address, "unix:")) return address;
  return address.substr(address.rfind(':') + 1);
}

// More applier threads than this would only contend for the cores.
constexpr int kMaxApplyThreads = 256;
constexpr int kMaxApplyWindow = 64;

int Fail(const absl::Status& status) {
  const std::string line = psflow::ErrorLine("ps_server", status.ToString());
  std::fwrite(line.data(), 1, line.size(), stderr);
  return 1;
}

absl::StatusOr<PsServerOptions> BuildOptions() {
  PsServerOptions options;
  psflow::server::OptimizerOptions& opt = options.store.optimizer;
  auto name = psflow::server::ParseOptimizerName(absl::GetFlag(FLAGS_optimizer));
  if (!name.ok()) return name.status();
  opt.kind = name->kind;
  opt.learning_rate = absl::GetFlag(FLAGS_learning_rate)
                          .value_or(psflow::server::DefaultLearningRate(opt.kind));
  auto schedule = psflow::server::ParseScheduleKind(absl::GetFlag(FLAGS_learning_rate_schedule));
  if (!schedule.ok()) return schedule.status();
  opt.schedule.kind = *schedule;
  opt.schedule.decay_steps = absl::GetFlag(FLAGS_decay_steps);
  opt.schedule.alpha = absl::GetFlag(FLAGS_cosine_alpha);
  opt.schedule.decay_rate = absl::GetFlag(FLAGS_decay_rate);
  opt.schedule.staircase = absl::GetFlag(FLAGS_staircase);
  opt.schedule.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  opt.schedule.warmup_target = absl::GetFlag(FLAGS_warmup_target);
  opt.schedule.end_learning_rate = absl::GetFlag(FLAGS_end_learning_rate);
  opt.schedule.power = absl::GetFlag(FLAGS_power);
  opt.schedule.cycle = absl::GetFlag(FLAGS_cycle);
  // Read only where they are used (elsewhere they are warned about below).
  const bool piecewise =
      opt.schedule.kind == psflow::server::LearningRateSchedule::Kind::kPiecewiseConstant;
  if (piecewise) {
    for (const std::string& b : absl::GetFlag(FLAGS_piecewise_boundaries)) {
      int64_t step = 0;
      if (!absl::SimpleAtoi(b, &step)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--piecewise_boundaries: \"", b,
                         "\" is not a whole number of updates (of at most 64 bits)"));
      }
      opt.schedule.boundaries.push_back(step);
    }
    for (const std::string& v : absl::GetFlag(FLAGS_piecewise_values)) {
      double rate = 0;
      if (!absl::SimpleAtod(v, &rate)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--piecewise_values: \"", v, "\" is not a number"));
      }
      opt.schedule.values.push_back(rate);
    }
  }
  if (opt.schedule.kind == psflow::server::LearningRateSchedule::Kind::kCosine &&
      !opt.schedule.warmup_target.has_value() &&
      absl::flags_internal::WasPresentOnCommandLine("warmup_steps")) {
    std::fprintf(stderr,
                 "ps_server: warning: --warmup_steps is ignored without --warmup_target (the "
                 "rate the warmup reaches), as in Keras' CosineDecay\n");
  }
  if (opt.schedule.kind == psflow::server::LearningRateSchedule::Kind::kPiecewiseConstant &&
      absl::GetFlag(FLAGS_learning_rate).has_value()) {
    std::fprintf(stderr,
                 "ps_server: warning: --learning_rate is ignored: "
                 "--learning_rate_schedule=piecewise_constant takes its rates from "
                 "--piecewise_values\n");
  }
  opt.beta_1 = absl::GetFlag(FLAGS_beta_1);
  opt.beta_2 = absl::GetFlag(FLAGS_beta_2).value_or(psflow::server::DefaultBeta2(opt.kind));
  opt.epsilon = absl::GetFlag(FLAGS_epsilon);
  opt.momentum = absl::GetFlag(FLAGS_momentum);
  opt.rho = absl::GetFlag(FLAGS_rho);
  opt.centered = absl::GetFlag(FLAGS_centered);
  opt.nesterov = absl::GetFlag(FLAGS_nesterov);
  opt.initial_accumulator_value = absl::GetFlag(FLAGS_initial_accumulator_value);
  opt.amsgrad = absl::GetFlag(FLAGS_amsgrad);
  opt.weight_decay = absl::GetFlag(FLAGS_weight_decay).value_or(name->default_weight_decay);
  opt.exclude_from_weight_decay = absl::GetFlag(FLAGS_exclude_from_weight_decay);
  if (!opt.exclude_from_weight_decay.empty() && opt.weight_decay == 0.0) {
    std::fprintf(
        stderr,
        "ps_server: warning: --exclude_from_weight_decay is ignored: there is no weight "
        "decay (--weight_decay is 0%s)\n",
        absl::GetFlag(FLAGS_weight_decay).has_value() ? "" : "; --optimizer=adamw has one");
  }
  WarnAboutUnreadFlags(absl::GetFlag(FLAGS_optimizer), absl::GetFlag(FLAGS_learning_rate_schedule));
  options.store.max_chunk_bytes = absl::GetFlag(FLAGS_max_chunk_bytes);
  options.store.allow_non_finite_gradients = absl::GetFlag(FLAGS_allow_non_finite_gradients);
  options.store.max_variable_bytes = absl::GetFlag(FLAGS_max_variable_bytes);
  const double retention_s = absl::GetFlag(FLAGS_request_id_retention_s);
  if (!(retention_s >= 0 && retention_s <= 1e9)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--request_id_retention_s is ", retention_s, "; expected 0 to 1e9 seconds"));
  }
  options.store.request_id_retention = absl::Seconds(retention_s);
  // Checked by the store, which names the flag.
  options.store.request_ledger_bytes = absl::GetFlag(FLAGS_request_ledger_bytes);
  options.threads = absl::GetFlag(FLAGS_threads);
  if (options.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads=", options.threads, "; expected 0 (no limit) or more"));
  }
  options.apply_threads = absl::GetFlag(FLAGS_apply_threads);
  if (options.apply_threads < -1 || options.apply_threads > kMaxApplyThreads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--apply_threads=", options.apply_threads,
        "; expected -1 (one per usable core, at most 16, with 4 or more, else none), 0 "
        "(none) or 1 to ",
        kMaxApplyThreads));
  }
  options.apply_window = absl::GetFlag(FLAGS_apply_window);
  if (options.apply_window < 1 || options.apply_window > kMaxApplyWindow) {
    // Each push holds the window's messages (up to --max_chunk_bytes + 1 MiB
    // each) and slots for them made before it reads any: 20,000,000 took
    // 5 GB for one empty push.
    return absl::InvalidArgumentError(absl::StrCat("--apply_window is ", options.apply_window,
                                                   "; expected 1 to ", kMaxApplyWindow));
  }
  auto grpc_args = psflow::ParseNameValues("grpc_arg", absl::GetFlag(FLAGS_grpc_arg));
  if (!grpc_args.ok()) return grpc_args.status();
  PSFLOW_RETURN_IF_ERROR(psflow::CheckGrpcArgs("grpc_arg", *grpc_args));
  options.grpc_args = std::move(*grpc_args);

  // Identity: TF_CONFIG and --ps_hosts, then the explicit flags.
  const std::optional<int> shard_flag = absl::GetFlag(FLAGS_shard_index);
  const std::optional<int> shards_flag = absl::GetFlag(FLAGS_num_shards);
  const std::optional<int> port_flag = absl::GetFlag(FLAGS_port);
  if (shard_flag && *shard_flag < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard_index=", *shard_flag, "; expected 0 or more"));
  }
  if (shards_flag && *shards_flag < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_shards=", *shards_flag, "; expected 1 or more"));
  }
  if (port_flag && (*port_flag < 0 || *port_flag > 65535)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port=", *port_flag, "; expected 0..65535 (0 picks a free port)"));
  }
  int shard_index = 0, num_shards = 1;
  std::string listen = "0.0.0.0:2222";
  std::string cluster_address;  // this shard's in TF_CONFIG / --ps_hosts
  const char* tf_config = std::getenv("TF_CONFIG");
  const bool no_tf_config = psflow::TfConfigAbsent(tf_config);
  if (!no_tf_config || !absl::GetFlag(FLAGS_ps_hosts).empty()) {
    psflow::ClusterFlags flags;
    flags.ps_hosts = absl::GetFlag(FLAGS_ps_hosts);
    flags.task_index_flag = "shard_index";
    flags.task_type_flag = "";  // ps_server has no --task_type
    flags.default_task_type = "ps";  // TF_CONFIG's task.type, when given, wins
    flags.hosts_flags = {"ps_hosts"};
    if (shard_flag) flags.task_index = *shard_flag;
    auto cluster = psflow::ResolveCluster(tf_config, flags);
    if (!cluster.ok()) return cluster.status();
    if (cluster->task_type != "ps") {
      // Also with --shard_index: it does not make a worker's host a shard.
      // (With --shard_index the index is the flag's, not TF_CONFIG's.)
      return absl::InvalidArgumentError(absl::StrCat(
          shard_flag ? absl::StrCat("--shard_index=", *shard_flag,
                                    " but TF_CONFIG's task type is \"", cluster->task_type, "\"")
                     : absl::StrCat("TF_CONFIG's task is \"", cluster->task_type, "\" ",
                                    cluster->task_index),
          "; ps_server serves a \"ps\" task (set TF_CONFIG task.type to \"ps\")"));
    }
    // After the refusal above: a warning that a flag overrides TF_CONFIG,
    // then an error that the override cannot be, read as a contradiction.
    for (const std::string& note : cluster->overrides) {
      std::fprintf(stderr, "ps_server: warning: %s\n", note.c_str());
    }
    shard_index = cluster->task_index;
    num_shards = static_cast<int>(cluster->ps.size());
    if (shards_flag && *shards_flag != num_shards) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--num_shards=", *shards_flag, " but ",
          absl::GetFlag(FLAGS_ps_hosts).empty() ? "TF_CONFIG's cluster.ps" : "--ps_hosts",
          " lists ", num_shards, " ps address", num_shards == 1 ? "" : "es",
          "; expected them to agree (workers count the shards from that list)"));
    }
    // The address is validated: "unix:path", "[v6]:port" or "host:port".
    const std::string address = cluster->ps[shard_index];
    cluster_address = address;
    if (absl::StartsWith(address, "unix:")) {
      listen = address;
    } else {
      listen = absl::StrCat("0.0.0.0:", address.substr(address.rfind(':') + 1));
    }
  } else {
    if (shard_flag) shard_index = *shard_flag;
    if (shards_flag) num_shards = *shards_flag;
    if (!shard_flag && num_shards > 1) {
      // Every shard of the job would otherwise be shard 0.
      return absl::InvalidArgumentError(absl::StrCat(
          "--num_shards=", num_shards, " but --shard_index was not given; expected 0..",
          num_shards - 1, " (or TF_CONFIG with task.index)"));
    }
    if (shard_index >= num_shards) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shard_index=", shard_index, " but there ", num_shards == 1 ? "is " : "are ",
          num_shards, " shard", num_shards == 1 ? "" : "s", " (--num_shards", shards_flag ? "" : " default",
          "); expected 0..", num_shards - 1));
    }
  }
  if (port_flag && !absl::GetFlag(FLAGS_address).empty()) {
    return absl::InvalidArgumentError(
        "--port and --address were both given; expected one of them (--address is the whole "
        "listen address)");
  }
  if (port_flag) listen = absl::StrCat("0.0.0.0:", *port_flag);
  if (const std::string address = absl::GetFlag(FLAGS_address); !address.empty()) {
    PSFLOW_RETURN_IF_ERROR(psflow::CheckListenAddress("address", address));
    listen = address;
  }
  // Flags win over the cluster description, as the design says, but the
  // workers dial the address it lists.
  if (!cluster_address.empty() && (port_flag || !absl::GetFlag(FLAGS_address).empty()) &&
      ListenPortOrPath(listen) != ListenPortOrPath(cluster_address)) {
    std::fprintf(stderr,
                 "ps_server: warning: listening on %s by %s, not where %s lists shard %d (%s), "
                 "which is where workers reading it will connect\n",
                 listen.c_str(), port_flag ? "--port" : "--address",
                 absl::GetFlag(FLAGS_ps_hosts).empty() ? "TF_CONFIG" : "--ps_hosts", shard_index,
                 cluster_address.c_str());
  }
  options.store.shard_index = shard_index;
  options.store.num_shards = num_shards;
  options.address = listen;
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  psflow::SetUsage(
      "psflow parameter-server shard.\n"
      "  ps_server --port=2222 --shard_index=0 --num_shards=2 [--optimizer=adam ...]\n"
      "  or set TF_CONFIG as Kubeflow's TFJob writes it (task.type \"ps\").",
      "ps_server/main.cc");
  psflow::ParseFlagsOrExit(argc, argv, "ps_server");
  psflow::TuneAllocatorForLargeMessages();
  // A request whose names are not UTF-8 makes protobuf log a line; a client
  // sending many must not fill the shard's log.
  psflow::LimitProtobufLog(10);
  // Debian's Abseil is built with Mutex deadlock detection on, which keeps a
  // lock graph on every acquisition of the hot path; our lock order is fixed.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // A log reader that went away (`| tee` ended by the same Ctrl-C, `| head`)
  // made the next line kill the shard with SIGPIPE, with no grace for the
  // calls in flight: the writes fail instead.
  std::signal(SIGPIPE, SIG_IGN);
  // Block the shutdown signals in every thread (gRPC's included) and wait
  // for them here.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto options = BuildOptions();
  if (!options.ok()) return Fail(options.status());
  // A reference to gRPC's library held until the process ends, so that
  // destroying the stopped server does not end the library: ending it joins
  // a poller thread that may be waiting out a timer (the shard exited 9.5 s
  // after SIGTERM when a worker had disconnected just before it).
  grpc_init();
  auto server = PsServer::Start(*options);
  if (!server.ok()) return Fail(server.status());

  const int64_t limit = (*server)->store().max_variable_bytes();
  // The address with the port it got (--port=0 picks one).
  std::string listening = options->address;
  if (!absl::StartsWith(listening, "unix:")) {
    listening = absl::StrCat(listening.substr(0, listening.rfind(':')), ":", (*server)->port());
  }
  std::printf("ps_server: shard %d of %d listening on %s, optimizer %s, %s%s%s\n",
              options->store.shard_index, options->store.num_shards, listening.c_str(),
              (*server)->store().optimizer().DebugString().c_str(),
              limit <= 0         ? "no limit on variable bytes"
              : limit >= 1 << 20 ? absl::StrCat("variables up to ", limit >> 20, " MiB").c_str()
                                 : absl::StrCat("variables up to ", limit, " bytes").c_str(),
              options->threads > 0
                  ? absl::StrCat(", at most ", options->threads, " call",
                                 options->threads == 1 ? "" : "s", " served at once")
                        .c_str()
                  : "",
              options->store.allow_non_finite_gradients ? ", NaN/Inf gradients applied" : "");
  std::fflush(stdout);

  int sig = 0;
  sigwait(&signals, &sig);
  std::printf("ps_server: shard %d received %s, shutting down\n", options->store.shard_index,
              sig == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stdout);
  // A second signal ends the process at once, as an operator pressing
  // Ctrl-C twice expects, rather than after the calls' grace.
  // (The set by value: main may return while the thread starts.)
  try {
    std::thread([signals, shard = options->store.shard_index] {
      int again = 0;
      sigwait(&signals, &again);
      std::fprintf(stderr, "ps_server: shard %d received a second %s, exiting without waiting\n",
                   shard, again == SIGTERM ? "SIGTERM" : "SIGINT");
      std::_Exit(1);
    }).detach();
  } catch (const std::system_error&) {
    // No thread to be had: the shutdown keeps its grace.
  }
  (*server)->Shutdown(absl::Seconds(5));
  const auto stats = (*server)->store().stats();
  std::printf(
      "ps_server: shard %d stopped after %lld pushes (%lld rejected; %lld stripe copies made "
      "for pulls in flight)\n",
      options->store.shard_index, static_cast<long long>(stats.pushes),
      static_cast<long long>(stats.rejected_requests),
      static_cast<long long>(stats.stripes_copied_on_write));
  return 0;
}
