#include "common/partition_plan.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/fingerprint.h"
#include "common/status_macros.h"

namespace psflow {
namespace {

// A larger count is surely a typo, and would make the per-shard tables huge.
constexpr int kMaxShards = 1 << 16;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::Status Validate(const std::vector<VariableSpec>& variables, const PartitionOptions& options) {
  if (options.num_shards < 1 || options.num_shards > kMaxShards) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "partition plan: num_shards is %d; expected 1..%d", options.num_shards, kMaxShards));
  }
  if (options.min_split_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "partition plan: min_split_bytes is %d; expected >= 1", options.min_split_bytes));
  }
  absl::flat_hash_map<std::string_view, int> seen;
  int64_t total = 0;  // bytes of the variables so far
  for (size_t i = 0; i < variables.size(); ++i) {
    const VariableSpec& v = variables[i];
    if (v.name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("partition plan: variable #%d (shape %s) has an empty name; expected "
                          "a unique non-empty name",
                          i, ShapeString(v.shape)));
    }
    auto [it, inserted] = seen.emplace(v.name, static_cast<int>(i));
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrFormat("partition plan: variable \"%s\" appears twice (#%d and #%d); "
                          "expected unique names",
                          v.name, it->second, i));
    }
    for (size_t d = 0; d < v.shape.size(); ++d) {
      if (v.shape[d] < 1) {
        return absl::InvalidArgumentError(
            absl::StrFormat("partition plan: variable \"%s\" has shape %s: dimension %d is %d; "
                            "expected every dimension >= 1",
                            v.name, ShapeString(v.shape), d, v.shape[d]));
      }
    }
    int64_t bytes = 4;  // float32
    bool overflow = false;
    for (int64_t d : v.shape) overflow = overflow || __builtin_mul_overflow(bytes, d, &bytes);
    if (overflow) {
      return absl::InvalidArgumentError(
          absl::StrFormat("partition plan: variable \"%s\" has shape %s, which overflows a "
                          "64-bit byte count",
                          v.name, ShapeString(v.shape)));
    }
    // The whole model's bytes too: no shard's load can then overflow
    // (which placed parts against a negative load, and the plan differed
    // from PROTOCOL.md's rule).
    if (__builtin_add_overflow(total, bytes, &total)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "partition plan: the variables up to \"%s\" (#%d) hold more bytes than a 64-bit "
          "count; expected a model under 8 EiB",
          v.name, i));
    }
  }
  return absl::OkStatus();
}

// Number of row ranges a variable is cut into (see the header).
int64_t NumSplits(const VariableSpec& v, const PartitionOptions& options) {
  const int64_t bytes = v.num_bytes();
  if (bytes <= options.min_split_bytes) return 1;
  return std::min({static_cast<int64_t>(options.num_shards), v.num_rows(),
                   std::max<int64_t>(1, bytes / options.min_split_bytes)});
}

}  // namespace

absl::StatusOr<PartitionPlan> PartitionPlan::Create(std::vector<VariableSpec> variables,
                                                    const PartitionOptions& options) {
  PSFLOW_RETURN_IF_ERROR(Validate(variables, options));

  PartitionPlan plan;
  plan.variables_ = std::move(variables);
  plan.options_ = options;
  const std::vector<VariableSpec>& vars = plan.variables_;
  const int n = static_cast<int>(vars.size());

  // Cut every variable into row ranges; parts_ is then already ordered by
  // variable index and row.
  plan.first_part_.reserve(n + 1);
  for (int i = 0; i < n; ++i) {
    plan.first_part_.push_back(static_cast<int>(plan.parts_.size()));
    const VariableSpec& v = vars[i];
    const int64_t k = NumSplits(v, options);
    const int64_t rows = v.num_rows(), base = rows / k, extra = rows % k;
    int64_t row = 0;
    for (int64_t j = 0; j < k; ++j) {
      Part p;
      p.variable_index = i;
      p.row_begin = row;
      row += base + (j < extra ? 1 : 0);
      p.row_end = row;
      p.elem_begin = p.row_begin * v.row_elements();
      p.elem_end = p.row_end * v.row_elements();
      plan.parts_.push_back(p);
    }
  }
  plan.first_part_.push_back(static_cast<int>(plan.parts_.size()));

  // Greedy LPT placement in an order that depends only on sizes and names.
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&vars](int a, int b) {
    if (vars[a].num_bytes() != vars[b].num_bytes()) {
      return vars[a].num_bytes() > vars[b].num_bytes();
    }
    return vars[a].name < vars[b].name;
  });
  plan.shard_bytes_.assign(options.num_shards, 0);
  std::vector<int> used_by(options.num_shards, -1);  // last variable placed there
  for (int vi : order) {
    std::vector<int> pieces;
    for (int p = plan.first_part_[vi]; p < plan.first_part_[vi + 1]; ++p) pieces.push_back(p);
    // Stable: equal sizes keep row order (the larger parts come first anyway).
    std::stable_sort(pieces.begin(), pieces.end(), [&plan](int a, int b) {
      return plan.parts_[a].num_elements() > plan.parts_[b].num_elements();
    });
    for (int p : pieces) {
      int best = -1;
      for (int s = 0; s < options.num_shards; ++s) {
        if (used_by[s] == vi) continue;
        if (best < 0 || plan.shard_bytes_[s] < plan.shard_bytes_[best]) best = s;
      }
      // NumSplits() <= num_shards, so a free shard always exists.
      plan.parts_[p].shard = best;
      used_by[best] = vi;
      plan.shard_bytes_[best] += plan.parts_[p].num_bytes();
    }
  }

  // Fingerprint in name order, so that it matches across input orders.
  std::vector<int> by_name(n);
  std::iota(by_name.begin(), by_name.end(), 0);
  std::sort(by_name.begin(), by_name.end(),
            [&vars](int a, int b) { return vars[a].name < vars[b].name; });
  Fnv1a64 h;
  h.AddString("psflow.PartitionPlan.v1");
  h.AddInt(options.num_shards);
  h.AddInt(options.min_split_bytes);
  h.AddInt(n);
  for (int vi : by_name) {
    h.AddString(vars[vi].name);
    h.AddInt(static_cast<int64_t>(vars[vi].shape.size()));
    for (int64_t d : vars[vi].shape) h.AddInt(d);
    h.AddInt(plan.first_part_[vi + 1] - plan.first_part_[vi]);
    for (int p = plan.first_part_[vi]; p < plan.first_part_[vi + 1]; ++p) {
      h.AddInt(plan.parts_[p].row_begin);
      h.AddInt(plan.parts_[p].row_end);
      h.AddInt(plan.parts_[p].shard);
    }
  }
  plan.fingerprint_ = h.value();
  return plan;
}

std::vector<int> PartitionPlan::PartsOfVariable(int variable_index) const {
  std::vector<int> out;
  if (variable_index < 0 || variable_index >= static_cast<int>(variables_.size())) return out;
  for (int p = first_part_[variable_index]; p < first_part_[variable_index + 1]; ++p) {
    out.push_back(p);
  }
  return out;
}

std::vector<int> PartitionPlan::PartsOnShard(int shard) const {
  std::vector<int> out;
  for (int p = 0; p < static_cast<int>(parts_.size()); ++p) {
    if (parts_[p].shard == shard) out.push_back(p);
  }
  return out;
}

int64_t PartitionPlan::ShardBytes(int shard) const {
  if (shard < 0 || shard >= num_shards()) return 0;
  return shard_bytes_[shard];
}

int PartitionPlan::FindVariable(const std::string& name) const {
  for (int i = 0; i < static_cast<int>(variables_.size()); ++i) {
    if (variables_[i].name == name) return i;
  }
  return -1;
}

std::string PartitionPlan::DebugString() const {
  std::string out = absl::StrFormat(
      "PartitionPlan{num_shards=%d min_split_bytes=%d variables=%d parts=%d "
      "fingerprint=%016x}\n",
      num_shards(), options_.min_split_bytes, variables_.size(), parts_.size(), fingerprint_);
  for (const Part& p : parts_) {
    const VariableSpec& v = variables_[p.variable_index];
    absl::StrAppendFormat(&out, "  %s%s rows [%d,%d) elements [%d,%d) %d bytes -> shard %d\n",
                          v.name, ShapeString(v.shape), p.row_begin, p.row_end, p.elem_begin,
                          p.elem_end, p.num_bytes(), p.shard);
  }
  return out;
}

}  // namespace psflow
