#include "common/cluster_spec.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/edit_distance.h"
#include "common/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace psflow {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

enum Job { kChief = 0, kWorker, kPs, kEvaluator, kNumJobs };
constexpr const char* kJobNames[kNumJobs] = {"chief", "worker", "ps", "evaluator"};
constexpr char kExpectedTypes[] = "chief, worker, ps, evaluator or master";
constexpr char kExpectedAddress[] =
    "expected \"host:port\" with a port in 1..65535, \"[ipv6]:port\" or \"unix:path\"";

// A TF_CONFIG nests 3 deep ({"cluster": {"ps": [...]}}); protobuf's JSON
// parser takes time that grows with the square of the depth of nested lists
// (112 s for 60,000 levels), so deeper input is refused before parsing.
constexpr int kMaxJsonDepth = 16;

// `s` in double quotes, with C escapes for quotes, backslashes, control and
// non-ASCII bytes: the message stays one intact, printable line.
std::string Quoted(absl::string_view s) { return absl::StrCat("\"", absl::CHexEscape(s), "\""); }

// "master" is TF1's name for the chief.
std::optional<Job> ParseJobName(absl::string_view name) {
  if (name == "master") return kChief;
  for (int j = 0; j < kNumJobs; ++j) {
    if (name == kJobNames[j]) return static_cast<Job>(j);
  }
  return std::nullopt;
}

// Where a value came from: a TF_CONFIG key or a flag, for error messages.
struct Origin {
  Origin() = default;
  Origin(bool from_flag, std::string key, std::string description = "")
      : from_flag(from_flag), key(std::move(key)), description(std::move(description)) {}

  bool from_flag = false;
  std::string key;  // "cluster.worker" / "worker_hosts"
  // Set for a value that is a binary's default, not a flag or a key.
  std::string description;

  // `"cluster.worker[1]"` or `--worker_hosts entry 1`.
  std::string Name() const {
    if (!description.empty()) return description;
    return from_flag ? absl::StrCat("--", key) : absl::StrCat("\"", key, "\"");
  }
  std::string ItemName(size_t i) const {
    return from_flag ? absl::StrCat("--", key, " entry ", i)
                     : absl::StrCat("\"", key, "[", i, "]\"");
  }
  // The same, prefixed with "TF_CONFIG: " for keys, to start a message.
  std::string Where() const { return from_flag ? Name() : absl::StrCat("TF_CONFIG: ", Name()); }
  std::string ItemWhere(size_t i) const {
    return from_flag ? ItemName(i) : absl::StrCat("TF_CONFIG: ", ItemName(i));
  }
};

// The cluster as read so far, with the origin of each part.
struct Draft {
  std::vector<std::string> jobs[kNumJobs];
  bool has_job[kNumJobs] = {};
  Origin job_origin[kNumJobs];
  std::optional<std::string> task_type;  // raw, validated by Finish()
  Origin type_origin;
  std::optional<int64_t> task_index;
  Origin index_origin;
  bool tf_config_given = false;  // a TF_CONFIG was parsed into this draft
  // The task type that examples in error messages show: the binary's own.
  std::string example_type = "worker";
  std::vector<std::string> overrides;  // as ClusterSpec::overrides
  bool tf_config_cluster = false;      // the TF_CONFIG parsed has a "cluster"
};

std::string KindOf(const Value& v) {
  switch (v.kind_case()) {
    case Value::kNullValue:
      return "null";
    case Value::kNumberValue:
      return "a number";
    case Value::kStringValue:
      return "a string";
    case Value::kBoolValue:
      return "a bool";
    case Value::kStructValue:
      return "an object";
    case Value::kListValue:
      return "a list";
    default:
      return "nothing";
  }
}

absl::Status ParseClusterJobs(const Value& cluster, Draft* d) {
  if (cluster.kind_case() != Value::kStructValue) {
    return absl::InvalidArgumentError(
        absl::StrCat("TF_CONFIG: \"cluster\" must be an object mapping job names to lists of "
                     "\"host:port\" strings, got ",
                     KindOf(cluster)));
  }
  // Map order is unspecified; sort so that errors are reproducible.
  std::vector<std::string> names;
  for (const auto& [name, unused] : cluster.struct_value().fields()) names.push_back(name);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::optional<Job> job = ParseJobName(name);
    if (!job) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "TF_CONFIG: unknown job %s in \"cluster\"; expected %s", Quoted(name), kExpectedTypes));
    }
    if (d->has_job[*job]) {
      return absl::InvalidArgumentError(
          "TF_CONFIG: \"cluster\" has both \"chief\" and \"master\" (TF1's name for the "
          "chief); expected only one of them");
    }
    const Origin origin{false, absl::StrCat("cluster.", name)};
    const Value& list = cluster.struct_value().fields().at(name);
    if (list.kind_case() != Value::kListValue) {
      return absl::InvalidArgumentError(absl::StrCat(
          origin.Where(), " must be a list of \"host:port\" strings, got ", KindOf(list)));
    }
    std::vector<std::string>& out = d->jobs[*job];
    for (int i = 0; i < list.list_value().values_size(); ++i) {
      const Value& item = list.list_value().values(i);
      if (item.kind_case() != Value::kStringValue) {
        return absl::InvalidArgumentError(absl::StrCat(
            origin.ItemWhere(i), " must be a \"host:port\" string, got ", KindOf(item)));
      }
      out.push_back(item.string_value());
    }
    d->has_job[*job] = true;
    d->job_origin[*job] = origin;
  }
  return absl::OkStatus();
}

// A key of `object` that TF_CONFIG does not define but that looks like one
// of `wanted` that the object lacks (another case, a letter off, or that key
// with more after it, as "clusterSpec") is a misspelling, which TensorFlow
// would ignore, leaving the task to a default or to "missing" errors that
// hide the cause.
absl::Status CheckMisspelledKeys(const google::protobuf::Struct& object, absl::string_view where,
                                 std::initializer_list<absl::string_view> wanted,
                                 std::initializer_list<absl::string_view> others) {
  auto listed = [](std::initializer_list<absl::string_view> keys, absl::string_view key) {
    return std::find(keys.begin(), keys.end(), key) != keys.end();
  };
  for (const auto& [key, value] : object.fields()) {
    if (listed(wanted, key) || listed(others, key)) continue;
    const std::string lower = absl::AsciiStrToLower(key);
    for (absl::string_view w : wanted) {
      if (object.fields().contains(std::string(w))) continue;
      if (lower == w || EditDistance(lower, w) <= 1 || absl::StartsWith(lower, w)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "TF_CONFIG%s has %s but no \"%s\"; expected \"%s\" (keys are case-sensitive)", where,
            Quoted(key), w, w));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ParseTask(const Value& task, Draft* d) {
  if (task.kind_case() != Value::kStructValue) {
    return absl::InvalidArgumentError(
        absl::StrCat("TF_CONFIG: \"task\" must be an object like {\"type\": \"", d->example_type,
                     "\", \"index\": 0} (type one of ", kExpectedTypes, "), got ", KindOf(task)));
  }
  PSFLOW_RETURN_IF_ERROR(CheckMisspelledKeys(task.struct_value(), ": \"task\"", {"type", "index"},
                                             {"trial", "cloud"}));
  const auto& fields = task.struct_value().fields();
  if (auto it = fields.find("type"); it != fields.end()) {
    if (it->second.kind_case() != Value::kStringValue) {
      return absl::InvalidArgumentError(
          absl::StrFormat("TF_CONFIG: \"task.type\" must be a string (%s), got %s", kExpectedTypes,
                          KindOf(it->second)));
    }
    d->task_type = it->second.string_value();
    d->type_origin = {false, "task.type"};
  }
  if (auto it = fields.find("index"); it != fields.end()) {
    const Value& v = it->second;
    // TensorFlow's resolver takes int(task["index"]), so a hand-written
    // "index": "1" works there: here too.
    if (int64_t index = 0;
        v.kind_case() == Value::kStringValue && absl::SimpleAtoi(v.string_value(), &index)) {
      d->task_index = index;
      d->index_origin = {false, "task.index"};
      return absl::OkStatus();
    }
    // JSON numbers arrive as doubles; 2^53 bounds the exactly representable
    // integers, far beyond any task count.
    if (v.kind_case() != Value::kNumberValue || v.number_value() != std::floor(v.number_value()) ||
        std::fabs(v.number_value()) > 9007199254740992.0) {
      std::string got = v.kind_case() == Value::kNumberValue ? absl::StrCat(v.number_value())
                        : v.kind_case() == Value::kStringValue
                            ? "the string " + Quoted(v.string_value())
                            : KindOf(v);
      return absl::InvalidArgumentError(
          absl::StrCat("TF_CONFIG: \"task.index\" must be an integer, got ", got));
    }
    d->task_index = static_cast<int64_t>(v.number_value());
    d->index_origin = {false, "task.index"};
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT once lists and objects in `json` (outside strings) nest
// deeper than kMaxJsonDepth, or a string is single-quoted. Other malformed
// input is the parser's to report.
absl::Status CheckJsonDepth(absl::string_view json) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '\'') {
      // Protobuf's parser takes 'single-quoted' strings, which JSON (and
      // TensorFlow's json.loads) does not. This scan would have missed
      // where such a string ends: a '"' in one hid every bracket after it,
      // and a deep nest then took the parser minutes (with the shard's
      // SIGTERM blocked).
      return absl::InvalidArgumentError(absl::StrFormat(
          "TF_CONFIG has a single-quoted string at byte %d; expected JSON, whose strings "
          "are in double quotes",
          i));
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "TF_CONFIG nests lists or objects more than %d deep (at byte %d); expected a "
            "TF_CONFIG like {\"cluster\": {\"ps\": [\"host:port\"]}, \"task\": {...}}, "
            "3 deep",
            kMaxJsonDepth, i));
      }
    } else if ((c == ']' || c == '}') && depth > 0) {  // a stray one is the parser's
      --depth;
    }
  }
  return absl::OkStatus();
}

std::string ExpectedTfConfig(const Draft& d) {
  return absl::StrCat(
      "expected an object like {\"cluster\": {\"worker\": [\"host:port\"], \"ps\": "
      "[\"host:port\"]}, \"task\": {\"type\": \"",
      d.example_type, "\", \"index\": 0}}");
}

absl::Status ParseTfConfig(absl::string_view json, Draft* d) {
  // A JSON list or string is valid JSON, but not the object TF_CONFIG is
  // (protobuf would say "Root element must be a message").
  const absl::string_view trimmed = absl::StripLeadingAsciiWhitespace(json);
  if (!trimmed.empty() && trimmed[0] != '{') {
    const char c = trimmed[0];
    return absl::InvalidArgumentError(absl::StrCat("TF_CONFIG must be a JSON object, got ",
                                                   c == '['   ? "a list"
                                                   : c == '"' ? "a string"
                                                              : Quoted(trimmed.substr(0, 20)),
                                                   "; ", ExpectedTfConfig(*d)));
  }
  PSFLOW_RETURN_IF_ERROR(CheckJsonDepth(json));
  Struct root;
  google::protobuf::util::JsonParseOptions options;
  const auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &root, options);
  if (!status.ok()) {
    // Protobuf's message spans lines (it quotes the input with a caret).
    const std::string message(status.message());
    const absl::string_view first_line =
        absl::StripAsciiWhitespace(absl::string_view(message).substr(0, message.find('\n')));
    return absl::InvalidArgumentError(absl::StrCat(
        "TF_CONFIG is not valid JSON: ", absl::CHexEscape(first_line), "; ", ExpectedTfConfig(*d)));
  }
  // Other top-level keys ("environment", "rpc_layer", ...) are not ours.
  if (root.fields().contains("sparseCluster") && !root.fields().contains("cluster")) {
    return absl::InvalidArgumentError(
        "TF_CONFIG has \"sparseCluster\" (TFJob's enableDynamicWorker mode) and no "
        "\"cluster\"; psflow needs the full \"cluster\": set enableDynamicWorker to false");
  }
  PSFLOW_RETURN_IF_ERROR(CheckMisspelledKeys(root, "", {"cluster", "task"},
                                             {"environment", "rpc_layer", "sparseCluster"}));
  if (auto it = root.fields().find("cluster"); it != root.fields().end()) {
    d->tf_config_cluster = true;
    PSFLOW_RETURN_IF_ERROR(ParseClusterJobs(it->second, d));
  }
  if (auto it = root.fields().find("task"); it != root.fields().end()) {
    PSFLOW_RETURN_IF_ERROR(ParseTask(it->second, d));
  }
  return absl::OkStatus();
}

absl::Status ApplyHostsFlag(absl::string_view flag, absl::string_view value, Job job, Draft* d) {
  if (value.empty()) return absl::OkStatus();
  const Origin origin{true, std::string(flag)};
  std::vector<std::string> hosts;
  int i = 0;
  for (absl::string_view item : absl::StrSplit(value, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s is empty (in %s); expected a comma-separated list of \"host:port\" addresses",
          origin.ItemName(i), Quoted(value)));
    }
    hosts.emplace_back(item);
    ++i;
  }
  if (job == kChief && hosts.size() > 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--%s is %s; expected exactly one \"host:port\" address (a cluster has at most "
        "one chief)",
        flag, Quoted(value)));
  }
  if (d->tf_config_given && d->has_job[job] && d->jobs[job] != hosts) {
    d->overrides.push_back(absl::StrCat("--", flag, " replaces TF_CONFIG's \"", kJobNames[job],
                                        "\" list (", absl::StrJoin(d->jobs[job], ","), ")"));
  } else if (d->tf_config_cluster && !d->has_job[job]) {
    d->overrides.push_back(absl::StrCat("--", flag, " adds a \"", kJobNames[job],
                                        "\" job that TF_CONFIG's cluster does not list; "
                                        "processes started without it see another cluster"));
  }
  d->jobs[job] = std::move(hosts);
  d->has_job[job] = true;
  d->job_origin[job] = origin;
  return absl::OkStatus();
}

absl::Status ApplyFlags(const ClusterFlags& flags, Draft* d) {
  PSFLOW_RETURN_IF_ERROR(ApplyHostsFlag("ps_hosts", flags.ps_hosts, kPs, d));
  PSFLOW_RETURN_IF_ERROR(ApplyHostsFlag("worker_hosts", flags.worker_hosts, kWorker, d));
  PSFLOW_RETURN_IF_ERROR(ApplyHostsFlag("chief_host", flags.chief_host, kChief, d));
  if (!flags.task_type.empty()) {
    // "master" is "chief": compared as the jobs they name.
    if (d->tf_config_given && d->task_type &&
        ParseJobName(*d->task_type) != ParseJobName(flags.task_type)) {
      d->overrides.push_back(absl::StrCat("--", flags.task_type_flag, "=", flags.task_type,
                                          " overrides TF_CONFIG's task type \"", *d->task_type,
                                          "\""));
    }
    d->task_type = flags.task_type;
    d->type_origin = {true, flags.task_type_flag};
  } else if (!d->task_type && !flags.default_task_type.empty()) {
    d->task_type = flags.default_task_type;
    d->type_origin = {true, "", absl::StrCat("the task type (", flags.default_task_type,
                                             " by default)")};
  }
  if (flags.task_index >= 0) {
    if (d->tf_config_given && d->task_index && *d->task_index != flags.task_index) {
      d->overrides.push_back(absl::StrCat("--", flags.task_index_flag, "=", flags.task_index,
                                          " overrides TF_CONFIG's task index ", *d->task_index));
    }
    d->task_index = flags.task_index;
    d->index_origin = {true, flags.task_index_flag};
  }
  return absl::OkStatus();
}

// Returns why `address` is not acceptable, or "" when it is; port 0 only
// where `allow_port_zero` (a listen address: any free port).
std::string AddressProblem(absl::string_view address, bool allow_port_zero) {
  if (absl::StartsWith(address, "unix:")) {
    if (address.size() == 5) return "has an empty unix socket path";
    // gRPC cuts the path at a NUL and listens on what comes before it.
    for (char c : address) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        return absl::StrFormat("has the control byte '%s' in its unix socket path",
                               absl::CHexEscape({&c, 1}));
      }
    }
    return "";
  }
  for (absl::string_view scheme : {"ipv4:", "ipv6:", "dns:"}) {
    if (absl::StartsWith(address, scheme)) {
      return absl::StrFormat("has gRPC's %s scheme, which psflow's addresses do not take",
                             Quoted(scheme));
    }
  }
  // Else read as host "unix-abstract", port N: a shard listened on the
  // abstract socket N while its workers dialled TCP port N.
  if (absl::StartsWith(address, "unix-abstract:")) {
    return "is an abstract unix socket, which psflow does not take; use \"unix:path\"";
  }
  absl::string_view host, port;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) return "has no closing ']'";
    host = address.substr(1, close - 1);
    if (host.empty()) return "has an empty host";
    // An IPv6 address, optionally with a zone: "fe80::1%eth0".
    const size_t percent = host.find('%');
    for (size_t i = 0; i < host.size(); ++i) {
      const char c = host[i];
      const bool ok = i < percent ? (absl::ascii_isxdigit(c) || c == ':' || c == '.')
                                  : (i == percent || absl::ascii_isalnum(c) || c == '-' ||
                                     c == '_' || c == '.');
      if (!ok) return absl::StrFormat("has '%s' in its IPv6 address", absl::CHexEscape({&c, 1}));
    }
    in6_addr parsed;
    if (::inet_pton(AF_INET6, std::string(host.substr(0, percent)).c_str(), &parsed) != 1) {
      return absl::StrFormat("has %s in brackets, which is not an IPv6 address",
                             Quoted(host.substr(0, percent)));
    }
    if (close + 1 >= address.size() || address[close + 1] != ':') return "has no \":port\"";
    port = address.substr(close + 2);
  } else {
    if (const size_t scheme = address.find("://"); scheme != absl::string_view::npos) {
      return absl::StrFormat("has a URL scheme (%s), which a gRPC address has not",
                             Quoted(address.substr(0, scheme + 3)));
    }
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) return "has no \":port\"";
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    if (host.empty()) return "has an empty host";
    if (host.find(':') != absl::string_view::npos) return "has an IPv6 host without [brackets]";
    // A longer one resolves nowhere: the workers failed only at DNS.
    // (A fully qualified name's final dot is not counted.)
    if (host.size() - (host.back() == '.' ? 1 : 0) > 253) {
      return absl::StrFormat("has a host name of %d bytes, longer than DNS allows (253)",
                             host.size());
    }
    for (char c : host) {
      if (!absl::ascii_isalnum(c) && c != '-' && c != '.' && c != '_') {
        return absl::StrFormat("has '%s' in its host name", absl::CHexEscape({&c, 1}));
      }
    }
  }
  if (port.empty()) return "has an empty port";
  if (!std::all_of(port.begin(), port.end(), [](char c) { return absl::ascii_isdigit(c); })) {
    return absl::StrFormat("has port %s, which is not a number", Quoted(port));
  }
  int value = 0;
  const int lowest = allow_port_zero ? 0 : 1;
  if (port.size() > 1 && port[0] == '0') {
    return absl::StrFormat(
        "has port %s, with a leading zero; expected %d..65535 as written "
        "without one",
        Quoted(port), lowest);
  }
  if (port.size() > 5 || !absl::SimpleAtoi(port, &value) || value < lowest || value > 65535) {
    return absl::StrFormat("has port %s, outside %d..65535", Quoted(port), lowest);
  }
  return "";
}

// Validates the merged draft. `flags` is the binary's flags, which could have
// supplied a missing piece (ResolveCluster), or nullptr (FromTfConfig).
absl::StatusOr<ClusterSpec> Finish(const Draft& d, const ClusterFlags* flags) {
  const bool flags_possible = flags != nullptr;
  const bool any_job =
      std::any_of(std::begin(d.has_job), std::end(d.has_job), [](bool b) { return b; });
  if (!any_job) {
    if (flags_possible) {
      std::vector<std::string> names;
      for (const std::string& f : flags->hosts_flags) names.push_back(absl::StrCat("--", f));
      return absl::InvalidArgumentError(absl::StrCat(
          "no cluster description: TF_CONFIG is unset or has no \"cluster\", and ",
          names.size() == 1 ? absl::StrCat(names[0], " was not given")
                            : absl::StrCat("none of ", absl::StrJoin(names, ", "), " was given")));
    }
    return absl::InvalidArgumentError(
        "TF_CONFIG: missing \"cluster\"; expected e.g. {\"cluster\": {\"worker\": "
        "[\"host:port\"], \"ps\": [\"host:port\"]}, \"task\": {...}}");
  }
  if (d.jobs[kChief].size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s has %d addresses; expected at most one chief",
                        d.job_origin[kChief].Where(), d.jobs[kChief].size()));
  }
  // Address -> its name. Host names are compared without case and ports as
  // numbers ("LOCALHOST:02222" is "localhost:2222"), as the resolver and
  // the socket see them.
  absl::flat_hash_map<std::string, std::string> seen;
  auto same_address_key = [](const std::string& address) {
    const size_t colon = address.rfind(':');
    int port = 0;
    if (absl::StartsWith(address, "unix:") || colon == std::string::npos ||
        !absl::SimpleAtoi(absl::string_view(address).substr(colon + 1), &port)) {
      return address;
    }
    return absl::StrCat(absl::AsciiStrToLower(address.substr(0, colon)), ":", port);
  };
  for (int j = 0; j < kNumJobs; ++j) {
    for (size_t i = 0; i < d.jobs[j].size(); ++i) {
      const std::string& address = d.jobs[j][i];
      const std::string problem = AddressProblem(address, /*allow_port_zero=*/false);
      if (!problem.empty()) {
        return absl::InvalidArgumentError(absl::StrFormat("%s is %s, which %s; %s",
                                                          d.job_origin[j].ItemWhere(i),
                                                          Quoted(address), problem,
                                                          kExpectedAddress));
      }
      auto [it, inserted] = seen.emplace(same_address_key(address), d.job_origin[j].ItemName(i));
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s is %s, the same address as %s; expected every task to have its own address",
            d.job_origin[j].ItemWhere(i), Quoted(address), it->second));
      }
    }
  }

  if (!d.task_type) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s; expected one of %s",
        flags_possible && !flags->task_type_flag.empty()
            ? absl::StrCat("no task type: TF_CONFIG has no \"task.type\" and --",
                           flags->task_type_flag, " was not given")
            : "TF_CONFIG: missing \"task.type\"",
        kExpectedTypes));
  }
  const std::optional<Job> job = ParseJobName(*d.task_type);
  if (!job) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is %s; expected %s", d.type_origin.Where(), Quoted(*d.task_type), kExpectedTypes));
  }
  const int size = static_cast<int>(d.jobs[*job].size());
  int64_t index = 0;
  if (size == 0) {
    // TFJob (and TensorFlow's own examples) leave the evaluator out of the
    // cluster: it trains nothing and serves nothing. TensorFlow's resolver
    // accepts that; so do we, for index 0.
    if (*job != kEvaluator) {
      std::vector<std::string> listed;
      for (int j = 0; j < kNumJobs; ++j) {
        if (!d.jobs[j].empty()) listed.push_back(absl::StrCat("\"", kJobNames[j], "\""));
      }
      // "master" is the chief: the cluster may list it under either name.
      const std::string missing =
          *job == kChief && *d.task_type != kJobNames[kChief]
              ? absl::StrCat("\"", kJobNames[kChief], "\" or ", Quoted(*d.task_type))
              : absl::StrCat("\"", kJobNames[*job], "\"");
      // Where flags may describe the cluster, which of them would mend it.
      std::string type_flag, hosts_flag;
      if (flags_possible) {
        if (!flags->task_type_flag.empty()) {
          type_flag = absl::StrCat(" (--", flags->task_type_flag, ")");
        }
        // Not where TF_CONFIG lists the cluster: a hosts flag adding a job
        // to it is warned against (the other processes see another cluster).
        for (const std::string& f :
             d.tf_config_cluster ? std::vector<std::string>{} : flags->hosts_flags) {
          if (absl::StartsWith(f, kJobNames[*job])) {
            hosts_flag = absl::StrCat("; or list the ", missing, " tasks (--", f, ")");
          }
        }
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s is %s but the cluster lists no %s addresses; expected a task type that is in the "
          "cluster%s: %s%s",
          d.type_origin.Where(), Quoted(*d.task_type), missing, type_flag,
          listed.empty() ? "it lists none" : absl::StrJoin(listed, ", "), hosts_flag));
    }
    if (d.task_index.value_or(0) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s is %d but the cluster lists no \"evaluator\" addresses; expected index 0 for an "
          "evaluator outside the cluster",
          d.index_origin.Where(), *d.task_index));
    }
  } else if (d.task_index) {
    index = *d.task_index;
    if (index < 0 || index >= size) {
      // The list's own origin, which may differ from the index's (TF_CONFIG's
      // index into --ps_hosts).
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s is %d but %s has %d address%s (expected 0..%d)", d.index_origin.Where(), index,
          d.job_origin[*job].Name(), size, size == 1 ? "" : "es", size - 1));
    }
  } else if (size > 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: cluster \"%s\" has %d addresses; expected an index in 0..%d",
        flags_possible ? absl::StrCat("no task index: ",
                                      d.tf_config_given ? "TF_CONFIG has no \"task.index\""
                                                        : "TF_CONFIG is not set",
                                      " and --", flags->task_index_flag, " was not given")
                       : "TF_CONFIG: missing \"task.index\"",
        kJobNames[*job], size, size - 1));
  }

  ClusterSpec spec;
  spec.chief = d.jobs[kChief];
  spec.worker = d.jobs[kWorker];
  spec.ps = d.jobs[kPs];
  spec.evaluator = d.jobs[kEvaluator];
  spec.task_type = kJobNames[*job];
  spec.task_index = static_cast<int>(index);
  spec.overrides = d.overrides;
  return spec;
}

}  // namespace

absl::StatusOr<ClusterSpec> ClusterSpec::FromTfConfig(std::string_view std_json) {
  // Debian's Abseil has its own string_view, distinct from std::string_view.
  const absl::string_view json(std_json.data(), std_json.size());
  if (absl::StripAsciiWhitespace(json).empty()) {
    return absl::InvalidArgumentError(
        "TF_CONFIG is empty; expected {\"cluster\": {...}, \"task\": {\"type\": ..., "
        "\"index\": ...}}");
  }
  Draft draft;
  PSFLOW_RETURN_IF_ERROR(ParseTfConfig(json, &draft));
  return Finish(draft, /*flags=*/nullptr);
}

absl::StatusOr<ClusterSpec> ResolveCluster(const char* tf_config, const ClusterFlags& flags) {
  Draft draft;
  if (!flags.default_task_type.empty()) draft.example_type = flags.default_task_type;
  if (!TfConfigAbsent(tf_config)) {
    PSFLOW_RETURN_IF_ERROR(ParseTfConfig(tf_config, &draft));
    draft.tf_config_given = true;
  }
  PSFLOW_RETURN_IF_ERROR(ApplyFlags(flags, &draft));
  return Finish(draft, &flags);
}

bool TfConfigAbsent(const char* tf_config) {
  return tf_config == nullptr || absl::StripAsciiWhitespace(tf_config).empty();
}

int ClusterSpec::num_replicas() const { return static_cast<int>(chief.size() + worker.size()); }

int ClusterSpec::replica_index() const {
  if (task_type == "chief") return 0;
  if (task_type == "worker") return task_index + static_cast<int>(chief.size());
  return -1;
}

bool ClusterSpec::is_chief() const {
  return task_type == "chief" || (task_type == "worker" && task_index == 0 && chief.empty());
}

namespace {

// This machine's host name in lower case, "" where it has none.
std::string OwnHostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return absl::AsciiStrToLower(name);
}

// The machine an address names, for comparing two of them: its host in
// lower case, and one name for all of this machine's own (loopback
// addresses, "localhost", unix sockets, and `own_host`, this machine's host
// name, alone or as the first label of a longer name, or its own first
// label where it is a longer name: "box7" and "box7.lab" name one machine).
std::string MachineOf(absl::string_view address, absl::string_view own_host) {
  constexpr absl::string_view kThisMachine = "<this machine>";
  if (absl::StartsWith(address, "unix:")) return std::string(kThisMachine);
  absl::string_view host = address.substr(0, address.rfind(':'));
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  const std::string lower = absl::AsciiStrToLower(host);
  if (lower == "localhost" || lower == "::1" || absl::StartsWith(lower, "127.")) {
    return std::string(kThisMachine);
  }
  if (!own_host.empty()) {
    absl::string_view rest = lower;
    if (absl::ConsumePrefix(&rest, own_host) && (rest.empty() || rest[0] == '.')) {
      return std::string(kThisMachine);
    }
    if (lower == own_host.substr(0, own_host.find('.'))) return std::string(kThisMachine);
  }
  return lower;
}

}  // namespace

int ClusterSpec::local_replicas() const { return local_replicas(OwnHostName()); }

int ClusterSpec::local_replicas(std::string_view own_host_name) const {
  const absl::StatusOr<std::string> own = task_address();
  if (!own.ok()) return 1;
  const std::string own_host =
      absl::AsciiStrToLower(absl::string_view(own_host_name.data(), own_host_name.size()));
  const std::string machine = MachineOf(*own, own_host);
  int n = 0;
  for (const std::vector<std::string>* list : {&chief, &worker}) {
    for (const std::string& address : *list) n += MachineOf(address, own_host) == machine ? 1 : 0;
  }
  return std::max(n, 1);
}

const std::vector<std::string>* ClusterSpec::job(std::string_view name) const {
  if (name == "chief") return &chief;
  if (name == "worker") return &worker;
  if (name == "ps") return &ps;
  if (name == "evaluator") return &evaluator;
  return nullptr;
}

absl::StatusOr<std::string> ClusterSpec::task_address() const {
  const std::vector<std::string>* list = job(task_type);
  if (list == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cluster spec: task type \"%s\" is not one of chief, worker, ps, evaluator", task_type));
  }
  if (task_index < 0 || task_index >= static_cast<int>(list->size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cluster spec: task index %d is outside cluster \"%s\", which has %d addresses", task_index,
        task_type, list->size()));
  }
  return (*list)[task_index];
}

std::string ClusterSpec::DebugString() const {
  std::string out = absl::StrCat("task=", task_type, ":", task_index);
  for (int j = 0; j < kNumJobs; ++j) {
    const std::vector<std::string>& list = *job(kJobNames[j]);
    if (!list.empty())
      absl::StrAppend(&out, " ", kJobNames[j], "=[", absl::StrJoin(list, ","), "]");
  }
  return out;
}

absl::Status CheckListenAddress(absl::string_view flag, absl::string_view address) {
  const std::string problem = AddressProblem(address, /*allow_port_zero=*/true);
  if (problem.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "--%s=%s %s; expected \"host:port\" with a port in 0..65535 (0 picks a free one), "
      "\"[ipv6]:port\" or \"unix:path\"",
      flag, Quoted(address), problem));
}

}  // namespace psflow
