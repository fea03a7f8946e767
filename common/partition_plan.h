// PartitionPlan: which rows of which model variable live on which PS shard.
//
// Every process (chief, workers, PS shards) computes the same plan from the
// same variables and options, so no service is needed to agree on it; the
// fingerprint lets a PS refuse a client whose plan differs.
//
// Rules (like TensorFlow's MinSizePartitioner plus greedy placement):
// * A variable with num_bytes() > min_split_bytes is split along dimension 0
//   into k = min(num_shards, num_rows, max(1, num_bytes / min_split_bytes))
//   contiguous row ranges, as even as possible: the first num_rows % k parts
//   get one extra row. Smaller variables, and scalars, form one part.
// * Placement is greedy longest-processing-time: variables are taken in
//   decreasing num_bytes() (ties: by name), the parts of each largest first
//   (ties: by row), and each part goes to the least-loaded shard by bytes
//   (ties: lowest index) among the shards that hold no part of the same
//   variable yet. So the parts of one variable sit on distinct shards, and a
//   part is named on its shard by its variable's name.
// * The placement of each variable depends only on the names and shapes of
//   all variables and on the options, not on the order of the input vector.
//
// A PartitionPlan is immutable once created and safe to share across threads.
#ifndef PSFLOW_COMMON_PARTITION_PLAN_H_
#define PSFLOW_COMMON_PARTITION_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/variable_spec.h"

namespace psflow {

struct PartitionOptions {
  // Number of PS shards; must be >= 1.
  int num_shards = 1;
  // Variables strictly larger than this many bytes are split (TF's
  // MinSizePartitioner default is 256 KiB); must be >= 1.
  int64_t min_split_bytes = 256 * 1024;
};

// One contiguous piece of one variable, stored on one shard.
struct Part {
  int variable_index = 0;  // into PartitionPlan::variables()
  int shard = 0;           // 0 .. num_shards - 1
  int64_t row_begin = 0;   // rows [row_begin, row_end) of dimension 0
  int64_t row_end = 0;
  int64_t elem_begin = 0;  // row_begin * row_elements(), row-major
  int64_t elem_end = 0;    // row_end * row_elements()

  int64_t num_elements() const { return elem_end - elem_begin; }
  int64_t num_bytes() const { return num_elements() * 4; }  // float32
};

class PartitionPlan {
 public:
  // Builds the plan. INVALID_ARGUMENT (naming the variable where there is
  // one) when num_shards < 1, min_split_bytes < 1, a name is empty or
  // repeated, a dimension is <= 0, or a variable's size overflows int64.
  static absl::StatusOr<PartitionPlan> Create(std::vector<VariableSpec> variables,
                                              const PartitionOptions& options);

  // The variables in the order given to Create().
  const std::vector<VariableSpec>& variables() const { return variables_; }
  int num_shards() const { return options_.num_shards; }
  const PartitionOptions& options() const { return options_; }

  // Every part, ordered by variable index, then row_begin.
  const std::vector<Part>& parts() const { return parts_; }

  // Indices into parts() of the parts of one variable, by row; empty when
  // variable_index is out of range.
  std::vector<int> PartsOfVariable(int variable_index) const;
  // Indices into parts() of the parts on one shard, ascending (so by
  // variable index); empty when shard is out of range.
  std::vector<int> PartsOnShard(int shard) const;
  // Bytes (float32) of all parts on `shard`; 0 when out of range.
  int64_t ShardBytes(int shard) const;

  // Index of the variable called `name`, or -1.
  int FindVariable(const std::string& name) const;

  // 64-bit FNV-1a over num_shards, min_split_bytes and, for each variable in
  // name order, its name, shape and every part's rows and shard. Stable
  // across processes, builds and runs; independent of the input order (as
  // the placement is).
  uint64_t fingerprint() const { return fingerprint_; }

  // A header line, then one line per part.
  std::string DebugString() const;

 private:
  PartitionPlan() = default;

  std::vector<VariableSpec> variables_;
  PartitionOptions options_;
  std::vector<Part> parts_;
  std::vector<int> first_part_;  // per variable, plus a sentinel at the end
  std::vector<int64_t> shard_bytes_;
  uint64_t fingerprint_ = 0;
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_PARTITION_PLAN_H_
