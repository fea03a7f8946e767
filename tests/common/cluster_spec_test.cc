#include "common/cluster_spec.h"

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// What Kubeflow's TFJob operator writes for a job with a chief, two workers
// and two PS, for the task `type`:`index`, with an evaluator listed too (the
// operator itself leaves the evaluator out of "cluster": see
// EvaluatorOutsideTheClusterAsTfJobWritesIt).
std::string TfJobConfig(const std::string& type, int index) {
  return R"({"cluster":{"chief":["job-chief-0.ns.svc:2222"],)"
         R"("worker":["job-worker-0.ns.svc:2222","job-worker-1.ns.svc:2222"],)"
         R"("ps":["job-ps-0.ns.svc:2222","job-ps-1.ns.svc:2222"],)"
         R"("evaluator":["job-evaluator-0.ns.svc:2222"]},)"
         R"("task":{"type":")" +
         type + R"(","index":)" + std::to_string(index) + R"(},"environment":"cloud"})";
}

ClusterSpec MustParse(const std::string& json) {
  absl::StatusOr<ClusterSpec> spec = ClusterSpec::FromTfConfig(json);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : ClusterSpec{};
}

std::string ErrorOf(const absl::StatusOr<ClusterSpec>& spec) {
  EXPECT_FALSE(spec.ok()) << "unexpectedly parsed: " << spec->DebugString();
  if (spec.ok()) return "";
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << spec.status();
  return std::string(spec.status().message());
}

std::string TfConfigError(const std::string& json) {
  return ErrorOf(ClusterSpec::FromTfConfig(json));
}

TEST(ClusterSpecTest, ParsesTfJobWorker) {
  const ClusterSpec spec = MustParse(TfJobConfig("worker", 1));
  EXPECT_THAT(spec.chief, ElementsAre("job-chief-0.ns.svc:2222"));
  EXPECT_THAT(spec.worker, ElementsAre("job-worker-0.ns.svc:2222", "job-worker-1.ns.svc:2222"));
  EXPECT_THAT(spec.ps, ElementsAre("job-ps-0.ns.svc:2222", "job-ps-1.ns.svc:2222"));
  EXPECT_THAT(spec.evaluator, ElementsAre("job-evaluator-0.ns.svc:2222"));
  EXPECT_EQ(spec.task_type, "worker");
  EXPECT_EQ(spec.task_index, 1);
  EXPECT_EQ(spec.num_replicas(), 3);
  EXPECT_EQ(spec.replica_index(), 2);  // after the chief and worker 0
  EXPECT_FALSE(spec.is_chief());
  EXPECT_EQ(spec.task_address().value(), "job-worker-1.ns.svc:2222");
}

TEST(ClusterSpecTest, ParsesTfJobPsChiefAndEvaluator) {
  const ClusterSpec ps = MustParse(TfJobConfig("ps", 1));
  EXPECT_EQ(ps.task_type, "ps");
  EXPECT_EQ(ps.replica_index(), -1);
  EXPECT_FALSE(ps.is_chief());
  EXPECT_EQ(ps.task_address().value(), "job-ps-1.ns.svc:2222");

  const ClusterSpec chief = MustParse(TfJobConfig("chief", 0));
  EXPECT_TRUE(chief.is_chief());
  EXPECT_EQ(chief.replica_index(), 0);
  EXPECT_EQ(chief.task_address().value(), "job-chief-0.ns.svc:2222");

  const ClusterSpec worker0 = MustParse(TfJobConfig("worker", 0));
  EXPECT_FALSE(worker0.is_chief());  // a chief is listed
  EXPECT_EQ(worker0.replica_index(), 1);

  const ClusterSpec evaluator = MustParse(TfJobConfig("evaluator", 0));
  EXPECT_EQ(evaluator.replica_index(), -1);
  EXPECT_FALSE(evaluator.is_chief());
  EXPECT_EQ(evaluator.task_address().value(), "job-evaluator-0.ns.svc:2222");
}

TEST(ClusterSpecTest, WorkerZeroIsChiefWhenNoChiefIsListed) {
  const std::string base =
      R"({"cluster":{"worker":["w0:1","w1:1"],"ps":["p0:1"]},"task":{"type":"worker","index":)";
  const ClusterSpec w0 = MustParse(base + "0}}");
  const ClusterSpec w1 = MustParse(base + "1}}");
  EXPECT_TRUE(w0.is_chief());
  EXPECT_FALSE(w1.is_chief());
  EXPECT_EQ(w0.replica_index(), 0);
  EXPECT_EQ(w1.replica_index(), 1);
  EXPECT_EQ(w1.num_replicas(), 2);
}

// The worker's default --threads shares the cores among the training
// processes on its machine: all of README's hand-started cluster on
// localhost, one per pod in a TFJob.
TEST(ClusterSpecTest, LocalReplicasCountTheTrainingTasksOnThisTasksMachine) {
  const std::string cluster =
      R"({"cluster":{"chief":["localhost:2"],"worker":["127.0.0.1:3","unix:/tmp/w1","[::1]:4",)"
      R"("Other-Host:5","other-host:6"],"ps":["localhost:1","localhost:7"]},"task":)";
  // Loopback names, addresses and unix sockets are one machine; ps tasks
  // do not count.
  EXPECT_EQ(MustParse(cluster + R"({"type":"chief","index":0}})").local_replicas(), 4);
  EXPECT_EQ(MustParse(cluster + R"({"type":"worker","index":1}})").local_replicas(), 4);
  // Host names compare without case.
  EXPECT_EQ(MustParse(cluster + R"({"type":"worker","index":3}})").local_replicas(), 2);
  // A TFJob: every replica in a pod of its own.
  const ClusterSpec pod =
      MustParse(R"({"cluster":{"worker":["job-worker-0.ns.svc:2222","job-worker-1.ns.svc:2222"],)"
                R"("ps":["job-ps-0.ns.svc:2222"]},"task":{"type":"worker","index":1}})");
  EXPECT_EQ(pod.local_replicas(), 1);
  // A ps task counts the training tasks on its machine; an evaluator
  // outside the cluster has no address to compare: 1.
  EXPECT_EQ(MustParse(cluster + R"({"type":"ps","index":0}})").local_replicas(), 4);
  EXPECT_EQ(MustParse(cluster + R"({"type":"evaluator","index":0}})").local_replicas(), 1);
}

TEST(ClusterSpecTest, LocalReplicasKnowThisMachinesHostName) {
  const ClusterSpec spec = MustParse(
      R"({"cluster":{"chief":["localhost:2"],"worker":["Box7:3","box7.lab.example:4","box70:5",)"
      R"("box7x.lab:6","other:7"],"ps":["localhost:1"]},"task":{"type":"worker","index":0}})");
  // "box7" alone or as a first label is this machine; "box70" and "box7x"
  // are not.
  EXPECT_EQ(spec.local_replicas("box7"), 3);
  EXPECT_EQ(spec.local_replicas("BOX7"), 3);
  // A fully qualified host name: its first label names it too.
  EXPECT_EQ(spec.local_replicas("box7.lab.example"), 3);
  // Under another host name, "Box7:3" is a machine of its own.
  EXPECT_EQ(spec.local_replicas("elsewhere"), 1);
  EXPECT_EQ(spec.local_replicas(""), 1);
  // The real host name: a worker listed by it shares the machine with the
  // chief on localhost.
  char name[256] = {};
  ASSERT_EQ(gethostname(name, sizeof(name) - 1), 0);
  const ClusterSpec here =
      MustParse(absl::StrCat(R"({"cluster":{"chief":["localhost:2"],"worker":[")", name,
                             R"(:3"]},"task":{"type":"chief","index":0}})"));
  EXPECT_EQ(here.local_replicas(), 2);
}

TEST(ClusterSpecTest, MasterIsReadAsChief) {
  const ClusterSpec spec =
      MustParse(R"({"cluster":{"master":["m:2222"],"worker":["w:2222"],"ps":["p:2222"]},)"
                R"("task":{"type":"master","index":0}})");
  EXPECT_THAT(spec.chief, ElementsAre("m:2222"));
  EXPECT_EQ(spec.task_type, "chief");
  EXPECT_TRUE(spec.is_chief());
  EXPECT_THAT(
      TfConfigError(R"({"cluster":{"master":["m:1"],"chief":["c:1"]},"task":{"type":"chief"}})"),
      HasSubstr("both \"chief\" and \"master\""));
}

TEST(ClusterSpecTest, IgnoresUnknownTopLevelAndTaskKeys) {
  const ClusterSpec spec = MustParse(
      R"({"cluster":{"ps":["p:1"],"worker":["w:1"]},"task":{"type":"ps","index":0,"trial":"3"},)"
      R"("environment":"cloud","rpc_layer":"grpc","extra":{"a":[1,2]}})");
  EXPECT_EQ(spec.task_type, "ps");
}

// A key that looks like one TF_CONFIG defines, where that one is absent, is
// a misspelling: "Index" left a single-ps task at index 0 without a word,
// and "clusterSpec" was reported as a missing "cluster".
TEST(ClusterSpecTest, MisspelledKeysAreNamed) {
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["p:1"]},"task":{"type":"ps","Index":1}})"),
              HasSubstr("TF_CONFIG: \"task\" has \"Index\" but no \"index\"; expected \"index\" "
                        "(keys are case-sensitive)"));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["p:1"]},"task":{"typ":"ps","index":0}})"),
              HasSubstr("\"task\" has \"typ\" but no \"type\""));
  EXPECT_THAT(TfConfigError(R"({"clusterSpec":{"ps":["p:1"]},"task":{"type":"ps"}})"),
              HasSubstr("TF_CONFIG has \"clusterSpec\" but no \"cluster\""));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["p:1"]},"Task":{"type":"ps"}})"),
              HasSubstr("TF_CONFIG has \"Task\" but no \"task\""));
  // Beside the right key, a look-alike is somebody else's: ignored.
  EXPECT_EQ(
      MustParse(R"({"cluster":{"ps":["p:1"]},"task":{"type":"ps","index":0,"Index":5},"tasks":1})")
          .task_index,
      0);
}

// A task type that the cluster lacks: the message lists what it has.
TEST(ClusterSpecTest, TaskTypeNotInTheClusterListsTheJobsItHas) {
  EXPECT_THAT(
      TfConfigError(
          R"({"cluster":{"chief":["c:1"],"ps":["p:1"]},"task":{"type":"worker","index":0}})"),
      HasSubstr("lists no \"worker\" addresses; expected a task type that is in the cluster: "
                "\"chief\", \"ps\""));
  // "master" is the chief, listed under either name: the message says both
  // (it named only "chief", which the user never wrote).
  EXPECT_THAT(
      TfConfigError(R"({"cluster":{"worker":["w:1"],"ps":["p:1"]},"task":{"type":"master"}})"),
      HasSubstr("\"task.type\" is \"master\" but the cluster lists no \"chief\" or \"master\" "
                "addresses"));
  // Given by flags, it names the flags that would mend it: the worker's
  // default type in a cluster of a chief and shards wants --task_type=chief
  // (or worker addresses).
  ClusterFlags flags;
  flags.ps_hosts = "p:1";
  flags.chief_host = "c:1";
  flags.default_task_type = "worker";
  EXPECT_EQ(ErrorOf(ResolveCluster(nullptr, flags)),
            "the task type (worker by default) is \"worker\" but the cluster lists no \"worker\" "
            "addresses; expected a task type that is in the cluster (--task_type): \"chief\", "
            "\"ps\"; or list the \"worker\" tasks (--worker_hosts)");
  flags.chief_host.clear();
  flags.worker_hosts = "w:1";
  flags.task_type = "chief";
  EXPECT_THAT(ErrorOf(ResolveCluster(nullptr, flags)),
              HasSubstr("lists no \"chief\" addresses; expected a task type that is in the "
                        "cluster (--task_type): \"worker\", \"ps\"; or list the \"chief\" tasks "
                        "(--chief_host)"));
  // Where TF_CONFIG lists the cluster, a hosts flag would add a job the
  // other processes do not see (ApplyHostsFlag warns of it): not offered.
  const std::string json =
      R"({"cluster":{"chief":["c:1"],"ps":["p:1"]},"task":{"type":"worker","index":0}})";
  const std::string from_tf_config = ErrorOf(ResolveCluster(json.c_str(), ClusterFlags{}));
  EXPECT_THAT(from_tf_config, HasSubstr("in the cluster (--task_type): \"chief\", \"ps\""));
  EXPECT_THAT(from_tf_config, Not(HasSubstr("--worker_hosts")));
}

TEST(ClusterSpecTest, MissingIndexIsZeroOnlyForASingleAddressJob) {
  const ClusterSpec spec = MustParse(
      R"({"cluster":{"chief":["c:1"],"worker":["w0:1","w1:1"]},"task":{"type":"chief"}})");
  EXPECT_EQ(spec.task_index, 0);
  EXPECT_THAT(TfConfigError(R"({"cluster":{"worker":["w0:1","w1:1"]},"task":{"type":"worker"}})"),
              HasSubstr("missing \"task.index\": cluster \"worker\" has 2 addresses"));
}

TEST(ClusterSpecTest, AcceptsIpv6AndUnixAddresses) {
  const ClusterSpec spec = MustParse(
      R"({"cluster":{"worker":["[::1]:2222","unix:/tmp/psflow.sock","[fe80::1%eth0]:1"],)"
      R"("ps":["10.0.0.1:1","ps-0.example.com:65535","under_score:80"]},"task":{"type":"worker","index":1}})");
  EXPECT_EQ(spec.task_address().value(), "unix:/tmp/psflow.sock");
}

TEST(ClusterSpecTest, RejectsMalformedJson) {
  for (const char* json :
       {"{", R"({"cluster": )", R"({"a":})", R"({"cluster":{"worker":["w:1"]})"}) {
    EXPECT_THAT(TfConfigError(json), HasSubstr("TF_CONFIG is not valid JSON: ")) << json;
  }
  EXPECT_THAT(TfConfigError(""), HasSubstr("TF_CONFIG is empty"));
  // Valid JSON, or not JSON at all, but not an object: said so, not with
  // protobuf's "Root element must be a message".
  EXPECT_THAT(TfConfigError("[1,2]"), HasSubstr("TF_CONFIG must be a JSON object, got a list"));
  EXPECT_THAT(TfConfigError(" []"), HasSubstr("TF_CONFIG must be a JSON object, got a list"));
  EXPECT_THAT(TfConfigError(R"("ps")"), HasSubstr("must be a JSON object, got a string"));
  EXPECT_THAT(TfConfigError("not json"),
              HasSubstr("TF_CONFIG must be a JSON object, got \"not json\"; expected an object "
                        "like {\"cluster\""));
  // Control bytes, from the input or in the parser's message, come out
  // escaped, not raw on the terminal.
  EXPECT_THAT(TfConfigError("x\n\x1b[31mred"), HasSubstr("got \"x\\n\\x1b[31mred\""));
  const std::string parser_error =
      TfConfigError("{\"k\\u001b[31m\":1,\"k\\u001b[31m\":2,\"cluster\":{\"ps\":[\"p:1\"]}}");
  EXPECT_THAT(parser_error, HasSubstr("TF_CONFIG is not valid JSON: "));
  EXPECT_THAT(parser_error, ::testing::Not(HasSubstr("\x1b")));
}

TEST(ClusterSpecTest, RejectsWrongJsonTypesNamingTheKey) {
  EXPECT_EQ(TfConfigError(R"({"cluster":{"ps":3,"worker":["w:1"]},"task":{"type":"worker"}})"),
            "TF_CONFIG: \"cluster.ps\" must be a list of \"host:port\" strings, got a number");
  EXPECT_THAT(
      TfConfigError(R"({"cluster":{"worker":"w:1"},"task":{"type":"worker"}})"),
      HasSubstr("\"cluster.worker\" must be a list of \"host:port\" strings, got a string"));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"worker":["w:1",2222]},"task":{"type":"worker"}})"),
              HasSubstr("\"cluster.worker[1]\" must be a \"host:port\" string, got a number"));
  EXPECT_THAT(TfConfigError(R"({"cluster":["w:1"],"task":{"type":"worker"}})"),
              HasSubstr("\"cluster\" must be an object"));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"worker":["w:1"]},"task":"worker"})"),
              HasSubstr("\"task\" must be an object"));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"worker":["w:1"]},"task":{"type":1}})"),
              HasSubstr("\"task.type\" must be a string"));
  EXPECT_THAT(
      TfConfigError(R"({"cluster":{"worker":["w:1"]},"task":{"type":"worker","index":"one"}})"),
      HasSubstr("\"task.index\" must be an integer, got the string \"one\""));
  // As TensorFlow's int(task["index"]): an integer in a string is taken.
  const ClusterSpec quoted =
      MustParse(R"({"cluster":{"worker":["w:1","w:2"]},"task":{"type":"worker","index":"1"}})");
  EXPECT_EQ(quoted.task_index, 1);
  EXPECT_THAT(
      TfConfigError(R"({"cluster":{"worker":["w:1"]},"task":{"type":"worker","index":0.5}})"),
      HasSubstr("\"task.index\" must be an integer, got 0.5"));
}

TEST(ClusterSpecTest, RejectsUnknownJobAndTaskType) {
  EXPECT_THAT(
      TfConfigError(R"({"cluster":{"worker":["w:1"],"trainer":["t:1"]},"task":{"type":"worker"}})"),
      HasSubstr("unknown job \"trainer\" in \"cluster\"; expected chief, worker, ps, evaluator or "
                "master"));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"worker":["w:1"]},"task":{"type":"boss","index":0}})"),
              HasSubstr("TF_CONFIG: \"task.type\" is \"boss\"; expected chief"));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"worker":["w:1"]},"task":{"type":"ps","index":0}})"),
              HasSubstr("\"task.type\" is \"ps\" but the cluster lists no \"ps\" addresses"));
}

TEST(ClusterSpecTest, RejectsIndexOutOfRange) {
  EXPECT_EQ(
      TfConfigError(R"({"cluster":{"worker":["w0:1","w1:1"]},"task":{"type":"worker","index":3}})"),
      "TF_CONFIG: \"task.index\" is 3 but \"cluster.worker\" has 2 addresses (expected 0..1)");
  EXPECT_THAT(
      TfConfigError(R"({"cluster":{"worker":["w0:1"]},"task":{"type":"worker","index":-1}})"),
      HasSubstr("\"task.index\" is -1 but \"cluster.worker\" has 1 address (expected 0..0)"));
}

TEST(ClusterSpecTest, RejectsMissingPieces) {
  EXPECT_THAT(TfConfigError(R"({"cluster":{"worker":["w:1"]}})"),
              HasSubstr("missing \"task.type\""));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"worker":["w:1"]},"task":{"index":0}})"),
              HasSubstr("missing \"task.type\""));
  EXPECT_THAT(TfConfigError(R"({"task":{"type":"worker","index":0}})"),
              HasSubstr("missing \"cluster\""));
  EXPECT_THAT(TfConfigError(R"({"cluster":{},"task":{"type":"worker","index":0}})"),
              HasSubstr("missing \"cluster\""));
}

TEST(ClusterSpecTest, RejectsBadAddressesNamingKeyAndValue) {
  for (const char* bad : {"h:0",
                          "h:65536",
                          "h:abc",
                          "h",
                          "h:",
                          ":80",
                          "h:-1",
                          "h: 80",
                          "h :80",
                          "::1:80",
                          "[::1]",
                          "[::1]80",
                          "[]:80",
                          "[::g]:80",
                          "[::1%]:80x",
                          "unix:",
                          "h:123456",
                          "http://h:80",
                          "unix-abstract:80",
                          "[:]:80",
                          "ipv4:127.0.0.1:80",
                          "h:023456",
                          "h:080",
                          "unix:/tmp/a\\u0000z",
                          "unix:/tmp/a\\nb"}) {
    const std::string json = std::string(R"({"cluster":{"worker":["ok:1",")") + bad +
                             R"("]},"task":{"type":"worker","index":0}})";
    const std::string error = TfConfigError(json);
    // (The JSON escapes \u0000 and \n come back escaped as C.)
    const std::string shown = absl::StrReplaceAll(bad, {{"\\u0000", "\\x00"}, {"\\n", "\\n"}});
    EXPECT_THAT(error,
                HasSubstr(std::string("TF_CONFIG: \"cluster.worker[1]\" is \"") + shown + "\""))
        << bad;
    EXPECT_THAT(error, HasSubstr("expected \"host:port\" with a port in 1..65535")) << bad;
  }
}

TEST(ClusterSpecTest, AUrlIsNotAnAddress) {
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["http://h0:2222"]},"task":{"type":"ps"}})"),
              HasSubstr("is \"http://h0:2222\", which has a URL scheme (\"http://\")"));
  // Each reason says what is wrong, not a neighbour's.
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["ipv4:10.0.0.1:2222"]},"task":{"type":"ps"}})"),
              HasSubstr("which has gRPC's \"ipv4:\" scheme"));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["h:023456"]},"task":{"type":"ps"}})"),
              HasSubstr("has port \"023456\", with a leading zero"));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["[:]:2222"]},"task":{"type":"ps"}})"),
              HasSubstr("has \":\" in brackets, which is not an IPv6 address"));
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["unix:/tmp/a\u0000b"]},"task":{"type":"ps"}})"),
              HasSubstr("has the control byte '\\x00' in its unix socket path"));
}

TEST(ClusterSpecTest, RejectsDuplicateAddressesAndTwoChiefs) {
  EXPECT_THAT(
      TfConfigError(
          R"({"cluster":{"worker":["a:1"],"ps":["b:1","a:1"]},"task":{"type":"ps","index":0}})"),
      HasSubstr("\"cluster.ps[1]\" is \"a:1\", the same address as \"cluster.worker[0]\""));
  EXPECT_THAT(
      TfConfigError(R"({"cluster":{"chief":["a:1","b:1"]},"task":{"type":"chief","index":0}})"),
      HasSubstr("\"cluster.chief\" has 2 addresses; expected at most one chief"));
  // Host names are the same in any case (the resolver ignores it).
  EXPECT_THAT(
      TfConfigError(
          R"({"cluster":{"ps":["localhost:2222","LocalHost:2222"]},"task":{"type":"ps","index":0}})"),
      HasSubstr("\"cluster.ps[1]\" is \"LocalHost:2222\", the same address as \"cluster.ps[0]\""));
}

TEST(ResolveClusterTest, FlagsAlone) {
  ClusterFlags flags;
  flags.ps_hosts = "p0:2222,p1:2222";
  flags.worker_hosts = "w0:2222, w1:2222 ,w2:2222";
  flags.chief_host = "c:2222";
  flags.task_type = "worker";
  flags.task_index = 2;
  for (const char* absent : {static_cast<const char*>(nullptr), "", "  \n"}) {
    absl::StatusOr<ClusterSpec> spec = ResolveCluster(absent, flags);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_THAT(spec->ps, ElementsAre("p0:2222", "p1:2222"));
    EXPECT_THAT(spec->worker, ElementsAre("w0:2222", "w1:2222", "w2:2222"));
    EXPECT_THAT(spec->chief, ElementsAre("c:2222"));
    EXPECT_EQ(spec->replica_index(), 3);
    EXPECT_EQ(spec->task_address().value(), "w2:2222");
  }
}

TEST(ResolveClusterTest, TfConfigAloneMatchesFromTfConfig) {
  const std::string json = TfJobConfig("ps", 0);
  absl::StatusOr<ClusterSpec> spec = ResolveCluster(json.c_str(), ClusterFlags{});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->DebugString(), MustParse(json).DebugString());
}

TEST(ResolveClusterTest, FlagsOverrideTfConfigPartByPart) {
  const std::string json = TfJobConfig("worker", 1);
  ClusterFlags flags;
  flags.worker_hosts = "x0:1,x1:1,x2:1";
  flags.task_index = 2;
  absl::StatusOr<ClusterSpec> spec = ResolveCluster(json.c_str(), flags);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->worker, ElementsAre("x0:1", "x1:1", "x2:1"));
  EXPECT_EQ(spec->task_type, "worker");  // from TF_CONFIG
  EXPECT_EQ(spec->task_index, 2);        // from the flag
  EXPECT_THAT(spec->ps, ElementsAre("job-ps-0.ns.svc:2222", "job-ps-1.ns.svc:2222"));
  EXPECT_THAT(spec->chief, ElementsAre("job-chief-0.ns.svc:2222"));

  ClusterFlags type_only;
  type_only.task_type = "master";
  type_only.task_index = 0;
  spec = ResolveCluster(json.c_str(), type_only);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->task_type, "chief");
  EXPECT_TRUE(spec->is_chief());
}

TEST(ResolveClusterTest, ErrorsNameTheFlag) {
  const std::string json = TfJobConfig("worker", 1);
  ClusterFlags index;
  index.task_index = 5;
  EXPECT_EQ(ErrorOf(ResolveCluster(json.c_str(), index)),
            "--task_index is 5 but \"cluster.worker\" has 2 addresses (expected 0..1)");
  // TF_CONFIG's index into a list from a flag: the message names the flag.
  ClusterFlags hosts;
  hosts.ps_hosts = "p0:1";
  hosts.hosts_flags = {"ps_hosts"};
  EXPECT_THAT(ErrorOf(ResolveCluster(
                  R"({"cluster":{"ps":["a:1","b:1"]},"task":{"type":"ps","index":1}})", hosts)),
              HasSubstr("TF_CONFIG: \"task.index\" is 1 but --ps_hosts has 1 address"));
  ClusterFlags type;
  type.task_type = "trainer";
  EXPECT_THAT(ErrorOf(ResolveCluster(json.c_str(), type)), HasSubstr("--task_type is \"trainer\""));
  ClusterFlags port;
  port.worker_hosts = "w0:1,w1:0";
  EXPECT_THAT(ErrorOf(ResolveCluster(json.c_str(), port)),
              HasSubstr("--worker_hosts entry 1 is \"w1:0\""));
  ClusterFlags empty_entry;
  empty_entry.ps_hosts = "p0:1,,p2:1";
  EXPECT_THAT(ErrorOf(ResolveCluster(nullptr, empty_entry)),
              HasSubstr("--ps_hosts entry 1 is empty"));
  ClusterFlags two_chiefs;
  two_chiefs.chief_host = "a:1,b:1";
  EXPECT_THAT(ErrorOf(ResolveCluster(nullptr, two_chiefs)),
              HasSubstr("--chief_host is \"a:1,b:1\""));
  ClusterFlags duplicate;
  duplicate.ps_hosts = "job-worker-0.ns.svc:2222";
  EXPECT_THAT(ErrorOf(ResolveCluster(json.c_str(), duplicate)),
              HasSubstr("the same address as \"cluster.worker[0]\""));
}

TEST(ResolveClusterTest, MissingDescriptionOrTask) {
  EXPECT_THAT(ErrorOf(ResolveCluster(nullptr, ClusterFlags{})),
              HasSubstr("no cluster description"));
  ClusterFlags hosts_only;
  hosts_only.worker_hosts = "w0:1,w1:1";
  EXPECT_THAT(ErrorOf(ResolveCluster(nullptr, hosts_only)), HasSubstr("--task_type was not given"));
  hosts_only.task_type = "worker";
  EXPECT_THAT(ErrorOf(ResolveCluster(nullptr, hosts_only)),
              HasSubstr("--task_index was not given"));
  // A malformed TF_CONFIG is reported even when flags are given.
  EXPECT_THAT(ErrorOf(ResolveCluster("{oops", hosts_only)),
              HasSubstr("TF_CONFIG is not valid JSON"));
}

TEST(ClusterSpecTest, TaskAddressOfHandBuiltSpecIsChecked) {
  ClusterSpec spec;
  spec.worker = {"w:1"};
  spec.task_type = "worker";
  spec.task_index = 1;
  EXPECT_FALSE(spec.task_address().ok());
  spec.task_type = "boss";
  spec.task_index = 0;
  EXPECT_FALSE(spec.task_address().ok());
  EXPECT_EQ(spec.job("boss"), nullptr);
}

TEST(ClusterSpecTest, DebugStringShowsTaskAndJobs) {
  const std::string s = MustParse(TfJobConfig("ps", 1)).DebugString();
  EXPECT_THAT(s, HasSubstr("task=ps:1"));
  EXPECT_THAT(s, HasSubstr("job-ps-1.ns.svc:2222"));
  EXPECT_THAT(s, HasSubstr("evaluator=[job-evaluator-0.ns.svc:2222]"));
}

// The training-operator's genClusterSpec skips the evaluator ("evaluator is
// not part of training cluster"), but its pod still gets task.type
// "evaluator"; TensorFlow's resolver accepts that.
TEST(ClusterSpecTest, EvaluatorOutsideTheClusterAsTfJobWritesIt) {
  const std::string cluster =
      R"({"cluster":{"chief":["c:2222"],"worker":["w0:2222"],"ps":["p0:2222"]},)";
  const ClusterSpec spec =
      MustParse(cluster + R"("task":{"type":"evaluator","index":0},"environment":"cloud"})");
  EXPECT_EQ(spec.task_type, "evaluator");
  EXPECT_EQ(spec.task_index, 0);
  EXPECT_EQ(spec.replica_index(), -1);
  EXPECT_EQ(spec.num_replicas(), 2);
  EXPECT_FALSE(spec.is_chief());
  EXPECT_TRUE(spec.evaluator.empty());
  MustParse(cluster + R"("task":{"type":"evaluator"}})");  // index absent: 0
  EXPECT_THAT(TfConfigError(cluster + R"("task":{"type":"evaluator","index":1}})"),
              HasSubstr("\"task.index\" is 1 but the cluster lists no \"evaluator\" addresses; "
                        "expected index 0"));
  // Other task types must still be in the cluster.
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["p0:2222"]},"task":{"type":"worker"}})"),
              HasSubstr("lists no \"worker\" addresses"));
}

TEST(ClusterSpecTest, SparseClusterIsNamed) {
  EXPECT_THAT(
      TfConfigError(R"({"sparseCluster":{"ps":["p0:2222"],"worker":{"1":"w1:2222"}},)"
                    R"("task":{"type":"worker","index":1}})"),
      HasSubstr("\"sparseCluster\" (TFJob's enableDynamicWorker mode)"));
}

TEST(ClusterSpecTest, DeepNestingIsRefusedBeforeParsing) {
  // 60,000 nested lists took protobuf's parser 112 s; they are refused at
  // once, naming the limit. Ten levels under an ignored key are fine.
  const std::string deep = std::string(60000, '[') + std::string(60000, ']');
  EXPECT_THAT(TfConfigError(R"({"x":)" + deep + R"(,"cluster":{"ps":["p:1"]},"task":{"type":"ps"}})"),
              HasSubstr("more than 16 deep"));
  const std::string ten = std::string(10, '[') + std::string(10, ']');
  const ClusterSpec spec =
      MustParse(R"({"x":)" + ten + R"(,"cluster":{"ps":["p:1"]},"task":{"type":"ps"}})");
  EXPECT_EQ(spec.task_type, "ps");
  // Brackets inside strings do not count.
  MustParse(R"({"x":")" + std::string(100, '[') +
            R"(","cluster":{"ps":["p:1"]},"task":{"type":"ps","index":0}})");
  // Nor does an apostrophe inside one.
  MustParse(R"({"x":"it's","cluster":{"ps":["p:1"]},"task":{"type":"ps","index":0}})");
  // A single-quoted string (which protobuf's parser takes and JSON does
  // not) holding a '"' used to hide every bracket after it from the count.
  const std::string hidden =
      R"({'x':'"', "y":)" + deep + R"(,"cluster":{"ps":["p:1"]},"task":{"type":"ps","index":0}})";
  EXPECT_THAT(TfConfigError(hidden), HasSubstr("single-quoted string at byte 1"));
  // Stray closing brackets first do not lower the count for what follows.
  const std::string stray = R"({"x":)" + std::string(60000, ']') + deep +
                            R"(,"cluster":{"ps":["p:1"]},"task":{"type":"ps","index":0}})";
  EXPECT_THAT(TfConfigError(stray), HasSubstr("more than 16 deep"));
}

TEST(ClusterSpecTest, ControlAndNonAsciiBytesAreEscapedInMessages) {
  // A NUL in an address used to end the message there (printf's %s).
  const std::string error = TfConfigError(
      R"({"cluster":{"ps":["h\u0000x:1"]},"task":{"type":"ps","index":0}})");
  EXPECT_THAT(error, HasSubstr("\"h\\x00x:1\""));
  EXPECT_THAT(error, HasSubstr("in its host name; expected"));
  EXPECT_EQ(error.find('\0'), std::string::npos);
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":["p:1"]},"task":{"type":"caf\u00e9"}})"),
              HasSubstr("\"caf\\xc3\\xa9\""));
}

// A host name longer than DNS allows was taken, and the workers failed
// only when they resolved it.
TEST(ClusterSpecTest, HostNamesLongerThanDnsAllowsAreRefused) {
  const std::string longest(253, 'h');
  MustParse(R"({"cluster":{"ps":[")" + longest + R"(:1"]},"task":{"type":"ps","index":0}})");
  MustParse(R"({"cluster":{"ps":[")" + longest + R"(.:1"]},"task":{"type":"ps","index":0}})");
  EXPECT_THAT(TfConfigError(R"({"cluster":{"ps":[")" + longest +
                            R"(h:1"]},"task":{"type":"ps","index":0}})"),
              HasSubstr("has a host name of 254 bytes, longer than DNS allows (253)"));
}

TEST(ResolveClusterTest, ErrorsUseTheBinarysOwnFlagNames) {
  // As ps_server calls ResolveCluster: its index flag is --shard_index, it
  // has no --task_type and only --ps_hosts.
  ClusterFlags ps;
  ps.task_index_flag = "shard_index";
  ps.task_type_flag = "";
  ps.hosts_flags = {"ps_hosts"};
  const std::string none = ErrorOf(ResolveCluster(nullptr, ps));
  EXPECT_THAT(none, HasSubstr("--ps_hosts was not given"));
  EXPECT_THAT(none, ::testing::Not(HasSubstr("--worker_hosts")));
  ps.ps_hosts = "p0:1,p1:1";
  EXPECT_THAT(ErrorOf(ResolveCluster(nullptr, ps)), HasSubstr("TF_CONFIG: missing \"task.type\""));
  ps.default_task_type = "ps";
  const std::string no_index = ErrorOf(ResolveCluster(nullptr, ps));
  EXPECT_THAT(no_index, HasSubstr("TF_CONFIG is not set and --shard_index was not given"));
  EXPECT_THAT(no_index, ::testing::Not(HasSubstr("--task_index")));
  ps.task_index = 2;
  EXPECT_THAT(ErrorOf(ResolveCluster(nullptr, ps)),
              HasSubstr("--shard_index is 2 but --ps_hosts has 2 addresses"));
  // A default task type is described, not blamed on a flag.
  ClusterFlags worker;
  worker.ps_hosts = "p0:1";
  worker.default_task_type = "worker";
  EXPECT_THAT(ErrorOf(ResolveCluster(nullptr, worker)),
              HasSubstr("the task type (worker by default) is \"worker\" but the cluster lists "
                        "no \"worker\" addresses"));
  // TF_CONFIG's task type wins over the default; --task_type over both.
  const std::string json =
      R"({"cluster":{"ps":["p0:1"],"worker":["w0:1"]},"task":{"type":"worker"}})";
  ClusterFlags ps_default;
  ps_default.default_task_type = "ps";
  absl::StatusOr<ClusterSpec> spec = ResolveCluster(json.c_str(), ps_default);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->task_type, "worker");
  ps_default.task_type = "ps";
  spec = ResolveCluster(json.c_str(), ps_default);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->task_type, "ps");
}

// The example in a TF_CONFIG error shows the binary's own task type: a
// worker's user was shown a ps task.
TEST(ResolveClusterTest, ExamplesShowTheBinarysOwnTaskType) {
  ClusterFlags worker;
  worker.default_task_type = "worker";
  ClusterFlags ps;
  ps.default_task_type = "ps";
  for (const char* bad : {"notjson", "[1]", R"({"cluster":{"ps":["p:1"]},"task":3})"}) {
    EXPECT_THAT(ErrorOf(ResolveCluster(bad, worker)),
                HasSubstr(R"({"type": "worker", "index": 0})"))
        << bad;
    EXPECT_THAT(ErrorOf(ResolveCluster(bad, ps)), HasSubstr(R"({"type": "ps", "index": 0})"))
        << bad;
  }
}

// Flags win over TF_CONFIG, and say where they changed it: other processes
// reading the same TF_CONFIG see the cluster it describes.
TEST(ResolveClusterTest, FlagsSayWhatOfTfConfigTheyOverride) {
  const char* json =
      R"({"cluster":{"ps":["p0:1"],"worker":["w0:1","w1:1"]},"task":{"type":"worker","index":1}})";
  ClusterFlags same;
  same.task_index = 1;
  same.ps_hosts = "p0:1";
  absl::StatusOr<ClusterSpec> spec = ResolveCluster(json, same);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->overrides, ::testing::IsEmpty());
  ClusterFlags other;
  other.task_index = 0;
  other.task_type = "worker";
  other.ps_hosts = "p0:1,p1:1";
  other.chief_host = "c:1";
  spec = ResolveCluster(json, other);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->task_index, 0);
  EXPECT_THAT(spec->overrides,
              ::testing::UnorderedElementsAre(
                  "--task_index=0 overrides TF_CONFIG's task index 1",
                  "--ps_hosts replaces TF_CONFIG's \"ps\" list (p0:1)",
                  "--chief_host adds a \"chief\" job that TF_CONFIG's cluster does not list; "
                  "processes started without it see another cluster"));
  other.task_type = "ps";
  other.task_index = 1;
  spec = ResolveCluster(json, other);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->overrides,
              ::testing::Contains("--task_type=ps overrides TF_CONFIG's task type \"worker\""));
  // Without TF_CONFIG there is nothing to override.
  spec = ResolveCluster(nullptr, other);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->overrides, ::testing::IsEmpty());
  // Nor with a TF_CONFIG of only a task: the flags give the cluster.
  ClusterFlags hosts;
  hosts.ps_hosts = "p0:1";
  hosts.worker_hosts = "w0:1,w1:1";
  spec = ResolveCluster(R"({"task":{"type":"worker","index":1}})", hosts);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->overrides, ::testing::IsEmpty());
  // "master" is "chief".
  ClusterFlags chief;
  chief.task_type = "chief";
  spec = ResolveCluster(R"({"cluster":{"ps":["p0:1"],"master":["c:1"]},"task":{"type":"master"}})",
                        chief);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->overrides, ::testing::IsEmpty());
}

TEST(ResolveClusterTest, BlankTfConfigIsAbsent) {
  EXPECT_TRUE(TfConfigAbsent(nullptr));
  EXPECT_TRUE(TfConfigAbsent(""));
  EXPECT_TRUE(TfConfigAbsent(" \n\t"));
  EXPECT_FALSE(TfConfigAbsent("{}"));
  ClusterFlags flags;
  flags.ps_hosts = "p:1";
  flags.task_type = "ps";
  absl::StatusOr<ClusterSpec> spec = ResolveCluster("  ", flags);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->task_address().value(), "p:1");
}

}  // namespace
}  // namespace psflow
