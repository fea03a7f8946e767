// ClusterSpec: the processes of a psflow cluster and which one this is, read
// from TF_CONFIG (as TensorFlow and Kubeflow's TFJob write it) and/or from the
// binaries' flags.
//
//   TF_CONFIG='{"cluster": {"chief": ["c:2222"], "worker": ["w0:2222"],
//                           "ps": ["p0:2222", "p1:2222"]},
//               "task": {"type": "worker", "index": 0},
//               "environment": "cloud"}'
//
// Accepted: the jobs "chief", "worker", "ps", "evaluator" and TF1's "master"
// (read as "chief", also as a task type); unknown top-level keys and unknown
// keys inside "task" are ignored (TFJob writes "environment", some writers
// "rpc_layer"). An "evaluator" task (index 0) need not be in the cluster:
// TFJob leaves it out, as TensorFlow's resolver allows. Rejected: any other
// job name, a job that is not a list of strings, more than one chief, any
// other task type missing from the cluster, an index out of range, an
// address that is not "host:port" (port 1..65535; "[v6addr]:port" and
// "unix:path" are also accepted), an address listed twice, JSON nested
// deeper than 16 (a TF_CONFIG needs 3), and TFJob's "sparseCluster" (its
// dynamic-worker mode), which is named as such.
// When "task.index" is absent it is 0 if the task's job has one address, and
// an error otherwise. Strings from the input are quoted in messages with
// C escapes, so a control byte cannot cut or garble a message.
//
// Every error is INVALID_ARGUMENT and names the key or flag at fault, the
// value received and what was expected, e.g.
//   TF_CONFIG: "task.index" is 3 but cluster "worker" has 2 addresses
//   (expected 0..1)
//
// This library reads no environment variable and no flag itself: the file
// with main() passes getenv("TF_CONFIG") and its flag values in.
#ifndef PSFLOW_COMMON_CLUSTER_SPEC_H_
#define PSFLOW_COMMON_CLUSTER_SPEC_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace psflow {

struct ClusterSpec {
  // Addresses ("host:port") of each job's tasks, by task index.
  std::vector<std::string> chief, worker, ps, evaluator;
  std::string task_type;  // "chief" | "worker" | "ps" | "evaluator"
  int task_index = 0;
  // Where ResolveCluster's flags changed what TF_CONFIG said (flags win):
  // one sentence each, for the binary to print as a warning, as other
  // processes reading the same TF_CONFIG see the cluster it describes.
  std::vector<std::string> overrides;

  // Parses and validates a complete TF_CONFIG (it must have "cluster" and
  // "task"). See the file comment for what is accepted.
  static absl::StatusOr<ClusterSpec> FromTfConfig(std::string_view json);

  // Training processes: chief.size() + worker.size().
  int num_replicas() const;
  // This task's index among the training replicas: the chief is 0, worker i
  // is i + chief.size(); -1 for ps and evaluator tasks.
  int replica_index() const;
  // Training replicas (chief and workers) on this task's machine: those
  // whose host is this task's, with "localhost", loopback addresses, unix
  // sockets and this machine's host name (alone, as the first label of a
  // longer name, or by its own first label where it is fully qualified)
  // all counted as one machine. At least 1 (also for a task
  // without an address in the cluster). A host named by another of its
  // addresses or aliases counts as another machine.
  int local_replicas() const;
  // The same, with `own_host_name` standing for this machine's host name.
  int local_replicas(std::string_view own_host_name) const;
  // The chief, or worker 0 when no chief is listed: it registers variables,
  // decides checkpoints and runs evaluation.
  bool is_chief() const;
  // This task's own address; INVALID_ARGUMENT if task_type/task_index do not
  // name a listed task (an evaluator outside the cluster, or a hand-built
  // spec).
  absl::StatusOr<std::string> task_address() const;
  // Addresses of `job` ("chief", "worker", "ps", "evaluator"); nullptr for
  // any other name.
  const std::vector<std::string>* job(std::string_view name) const;

  // One line, e.g. `task=worker:1 chief=[c:1] worker=[w0:1,w1:1] ps=[p:1]`.
  std::string DebugString() const;
};

// The binaries' cluster flags. An empty string or a negative index means
// "not given".
struct ClusterFlags {
  std::string ps_hosts;      // --ps_hosts: comma-separated "host:port" list
  std::string worker_hosts;  // --worker_hosts: comma-separated list
  std::string chief_host;    // --chief_host: one "host:port"
  std::string task_type;     // --task_type: chief|worker|ps|evaluator|master
  int task_index = -1;       // --task_index

  // The binary's own task type when neither task_type nor TF_CONFIG's
  // "task.type" gives one (ps_server's is "ps", the worker's "worker").
  // Unlike task_type it does not override TF_CONFIG.
  std::string default_task_type;

  // How errors name the pieces above, for a binary whose flags differ:
  // ps_server calls its index --shard_index, has no --task_type (empty here)
  // and no worker or chief hosts flags.
  std::string task_index_flag = "task_index";
  std::string task_type_flag = "task_type";
  std::vector<std::string> hosts_flags = {"ps_hosts", "worker_hosts", "chief_host"};
};

// True when `tf_config` (getenv("TF_CONFIG")) is unset, empty or blank, which
// ResolveCluster reads as "no TF_CONFIG".
bool TfConfigAbsent(const char* tf_config);

// OK when `address`, given by flag --`flag`, is one a server can listen on:
// "host:port" or "[ipv6]:port" with a port in 0..65535 (0: any free one),
// or "unix:path"; else INVALID_ARGUMENT naming the flag and the problem.
absl::Status CheckListenAddress(absl::string_view flag, absl::string_view address);

// Reads `tf_config` (the value of the TF_CONFIG variable; nullptr, empty or
// blank means absent), then lets each given flag replace its part: a hosts
// flag replaces that job's whole list, --task_type and --task_index the
// task's. Validates the result as described in the file comment; errors name
// the TF_CONFIG key or the flag each offending value came from.
absl::StatusOr<ClusterSpec> ResolveCluster(const char* tf_config, const ClusterFlags& flags);

}  // namespace psflow

#endif  // PSFLOW_COMMON_CLUSTER_SPEC_H_
