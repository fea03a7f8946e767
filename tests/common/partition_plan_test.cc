#include "common/partition_plan.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;

// The seed CNN: Conv2D(32, 3x3) -> Flatten -> Dense(128) -> Dense(10) on
// 28x28x1 inputs (26 * 26 * 32 = 21632 flattened features).
std::vector<VariableSpec> SeedCnn() {
  return {{"conv2d/kernel", {3, 3, 1, 32}}, {"conv2d/bias", {32}},
          {"dense/kernel", {21632, 128}},   {"dense/bias", {128}},
          {"dense_1/kernel", {128, 10}},    {"dense_1/bias", {10}}};
}

PartitionPlan MustCreate(std::vector<VariableSpec> vars, int num_shards,
                         int64_t min_split_bytes = 256 * 1024) {
  PartitionOptions options;
  options.num_shards = num_shards;
  options.min_split_bytes = min_split_bytes;
  absl::StatusOr<PartitionPlan> plan = PartitionPlan::Create(std::move(vars), options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *std::move(plan);
}

// The rule from the header, restated: the number of parts of `v`.
int64_t ExpectedSplits(const VariableSpec& v, int num_shards, int64_t min_split_bytes) {
  const int64_t bytes = v.num_elements() * 4;
  if (bytes <= min_split_bytes) return 1;
  return std::min(
      {int64_t{num_shards}, v.num_rows(), std::max<int64_t>(1, bytes / min_split_bytes)});
}

// Checks every structural promise of a plan against its own inputs.
void CheckInvariants(const PartitionPlan& plan) {
  const auto& vars = plan.variables();
  const auto& parts = plan.parts();
  // Ordered by variable index, then row_begin.
  for (size_t p = 1; p < parts.size(); ++p) {
    EXPECT_TRUE(std::make_pair(parts[p - 1].variable_index, parts[p - 1].row_begin) <
                std::make_pair(parts[p].variable_index, parts[p].row_begin))
        << "parts " << p - 1 << " and " << p << " out of order";
  }
  std::vector<int64_t> shard_bytes(plan.num_shards(), 0);
  size_t parts_seen = 0;
  for (int vi = 0; vi < static_cast<int>(vars.size()); ++vi) {
    const VariableSpec& v = vars[vi];
    const std::vector<int> mine = plan.PartsOfVariable(vi);
    parts_seen += mine.size();
    ASSERT_EQ(static_cast<int64_t>(mine.size()),
              ExpectedSplits(v, plan.num_shards(), plan.options().min_split_bytes))
        << v.name;
    // Every element covered exactly once.
    std::vector<uint8_t> covered(v.num_elements(), 0);
    std::set<int> shards;
    const int64_t k = mine.size(), base = v.num_rows() / k, extra = v.num_rows() % k;
    int64_t next_row = 0;
    for (int j = 0; j < k; ++j) {
      const Part& part = parts[mine[j]];
      EXPECT_EQ(part.variable_index, vi);
      EXPECT_EQ(part.row_begin, next_row) << v.name << " part " << j;
      EXPECT_EQ(part.row_end - part.row_begin, base + (j < extra ? 1 : 0))
          << v.name << " part " << j;
      next_row = part.row_end;
      EXPECT_EQ(part.elem_begin, part.row_begin * v.row_elements());
      EXPECT_EQ(part.elem_end, part.row_end * v.row_elements());
      ASSERT_GE(part.shard, 0);
      ASSERT_LT(part.shard, plan.num_shards());
      EXPECT_TRUE(shards.insert(part.shard).second)
          << v.name << " has two parts on shard " << part.shard;
      shard_bytes[part.shard] += (part.elem_end - part.elem_begin) * 4;
      for (int64_t e = part.elem_begin; e < part.elem_end; ++e) ++covered[e];
    }
    EXPECT_EQ(next_row, v.num_rows()) << v.name;
    EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](uint8_t c) { return c == 1; }))
        << v.name << ": some element is not covered exactly once";
  }
  EXPECT_EQ(parts_seen, parts.size());
  size_t on_shards = 0;
  for (int s = 0; s < plan.num_shards(); ++s) {
    EXPECT_EQ(plan.ShardBytes(s), shard_bytes[s]) << "shard " << s;
    for (int p : plan.PartsOnShard(s)) {
      EXPECT_EQ(parts[p].shard, s);
      ++on_shards;
    }
  }
  EXPECT_EQ(on_shards, parts.size());
}

double Imbalance(const PartitionPlan& plan) {
  std::vector<int64_t> bytes(plan.num_shards(), 0);
  for (const Part& p : plan.parts()) bytes[p.shard] += (p.elem_end - p.elem_begin) * 4;
  int64_t total = 0;
  for (int64_t b : bytes) total += b;
  const double mean = static_cast<double>(total) / plan.num_shards();
  return *std::max_element(bytes.begin(), bytes.end()) / mean;
}

// Per variable name: its (row_begin, row_end, shard) list.
std::map<std::string, std::vector<std::tuple<int64_t, int64_t, int>>> Placement(
    const PartitionPlan& plan) {
  std::map<std::string, std::vector<std::tuple<int64_t, int64_t, int>>> out;
  for (const Part& p : plan.parts()) {
    out[plan.variables()[p.variable_index].name].emplace_back(p.row_begin, p.row_end, p.shard);
  }
  return out;
}

TEST(PartitionPlanTest, SeedCnnIsBalancedOnTwoAndThreeShards) {
  for (int shards : {2, 3}) {
    SCOPED_TRACE(shards);
    const PartitionPlan plan = MustCreate(SeedCnn(), shards);
    CheckInvariants(plan);
    EXPECT_LE(Imbalance(plan), 1.1);
  }
}

TEST(PartitionPlanTest, SeedCnnDenseKernelSplitsEvenly) {
  // 21632 * 128 * 4 bytes = 42.25 * 256 KiB, so it is split num_shards ways.
  const PartitionPlan two = MustCreate(SeedCnn(), 2);
  const std::vector<int> p2 = two.PartsOfVariable(2);
  ASSERT_EQ(p2.size(), 2u);
  EXPECT_EQ(two.parts()[p2[0]].row_end, 10816);
  EXPECT_EQ(two.parts()[p2[1]].row_end, 21632);

  const PartitionPlan three = MustCreate(SeedCnn(), 3);  // 21632 = 3 * 7210 + 2
  const std::vector<int> p3 = three.PartsOfVariable(2);
  ASSERT_EQ(p3.size(), 3u);
  EXPECT_EQ(three.parts()[p3[0]].row_end, 7211);
  EXPECT_EQ(three.parts()[p3[1]].row_end, 7211 + 7211);
  EXPECT_EQ(three.parts()[p3[2]].elem_end, 21632 * 128);
  // The small variables stay whole.
  for (int vi : {0, 1, 3, 4, 5}) EXPECT_EQ(three.PartsOfVariable(vi).size(), 1u);
}

TEST(PartitionPlanTest, GreedyPlacementMatchesHandComputation) {
  // Threshold 100 bytes. a: 400 bytes -> min(3 shards, 10 rows, 4) = 3 parts
  // of 4, 3, 3 rows (160, 120, 120 bytes) on shards 0, 1, 2. c: 120 bytes,
  // 120 / 100 = 1 part, goes to the lightest shard, 1 (tie with 2). b: 20
  // bytes, loads are then 160, 240, 120 -> shard 2.
  const PartitionPlan plan = MustCreate({{"b", {5}}, {"a", {10, 10}}, {"c", {30}}}, 3, 100);
  CheckInvariants(plan);
  const auto placed = Placement(plan);
  using T = std::tuple<int64_t, int64_t, int>;
  EXPECT_EQ(placed.at("a"), (std::vector<T>{{0, 4, 0}, {4, 7, 1}, {7, 10, 2}}));
  EXPECT_EQ(placed.at("c"), (std::vector<T>{{0, 30, 1}}));
  EXPECT_EQ(placed.at("b"), (std::vector<T>{{0, 5, 2}}));
  EXPECT_EQ(plan.ShardBytes(0), 160);
  EXPECT_EQ(plan.ShardBytes(1), 240);
  EXPECT_EQ(plan.ShardBytes(2), 140);
}

TEST(PartitionPlanTest, PartsOfOneVariableGoToDistinctShards) {
  // big (4000 bytes, one row) -> shard 0. split: 2400 bytes -> 2 parts of
  // 1200; the first goes to shard 1, the second would also fit best on shard
  // 1 (1200 < 4000) but that shard holds a part of it already -> shard 0.
  const PartitionPlan plan = MustCreate({{"big", {1, 1000}}, {"split", {2, 300}}}, 2, 1000);
  CheckInvariants(plan);
  using T = std::tuple<int64_t, int64_t, int>;
  EXPECT_EQ(Placement(plan).at("split"), (std::vector<T>{{0, 1, 1}, {1, 2, 0}}));
}

TEST(PartitionPlanTest, SameInputGivesSamePlan) {
  const PartitionPlan a = MustCreate(SeedCnn(), 3);
  const PartitionPlan b = MustCreate(SeedCnn(), 3);
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  EXPECT_EQ(Placement(a), Placement(b));
  EXPECT_EQ(a.DebugString(), b.DebugString());
}

TEST(PartitionPlanTest, PermutedInputGivesSamePlacementAndFingerprint) {
  std::vector<VariableSpec> vars = SeedCnn();
  vars.push_back({"embedding", {5000, 64}});
  vars.push_back({"same_size_a", {128}});  // ties with dense/bias: broken by name
  const PartitionPlan reference = MustCreate(vars, 3);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 5; ++trial) {
    std::shuffle(vars.begin(), vars.end(), rng);
    const PartitionPlan permuted = MustCreate(vars, 3);
    CheckInvariants(permuted);
    EXPECT_EQ(Placement(permuted), Placement(reference));
    EXPECT_EQ(permuted.fingerprint(), reference.fingerprint());
  }
}

TEST(PartitionPlanTest, FingerprintChangesWithShapeNameShardsAndThreshold) {
  const uint64_t base = MustCreate(SeedCnn(), 2).fingerprint();
  std::vector<VariableSpec> shape = SeedCnn();
  shape[5].shape = {11};
  std::vector<VariableSpec> name = SeedCnn();
  name[5].name = "dense_1/bias2";
  std::vector<VariableSpec> rank = SeedCnn();
  rank[5].shape = {10, 1};  // same element count, different shape
  std::vector<VariableSpec> fewer = SeedCnn();
  fewer.pop_back();
  const std::set<uint64_t> all = {base,
                                  MustCreate(shape, 2).fingerprint(),
                                  MustCreate(name, 2).fingerprint(),
                                  MustCreate(rank, 2).fingerprint(),
                                  MustCreate(fewer, 2).fingerprint(),
                                  MustCreate(SeedCnn(), 3).fingerprint(),
                                  MustCreate(SeedCnn(), 2, 1 << 20).fingerprint()};
  EXPECT_EQ(all.size(), 7u);
}

// The test vectors of docs/PROTOCOL.md ("The partition plan"), printed by
// tests/common/plan_reference.py, an implementation written from that page
// alone: a client in another language computes the plan and fingerprint
// from the page, so the C++ must agree with it to the bit.
TEST(PartitionPlanTest, SeedModelMatchesThePublishedTestVectors) {
  struct Vector {
    int shards;
    uint64_t fingerprint;
    // Per variable of SeedCnn(), in its order: (row_begin, row_end, shard) of each part.
    std::vector<std::vector<std::tuple<int64_t, int64_t, int>>> parts;
  };
  const Vector vectors[] = {
      {1,
       0x0a304cd826b95721ULL,
       {{{0, 3, 0}}, {{0, 32, 0}}, {{0, 21632, 0}}, {{0, 128, 0}}, {{0, 128, 0}}, {{0, 10, 0}}}},
      {2,
       0x77f111f7072000d6ULL,
       {{{0, 3, 1}},
        {{0, 32, 1}},
        {{0, 10816, 0}, {10816, 21632, 1}},
        {{0, 128, 1}},
        {{0, 128, 0}},
        {{0, 10, 1}}}},
      {3,
       0x0e71908ffc392193ULL,
       {{{0, 3, 0}},
        {{0, 32, 1}},
        {{0, 7211, 0}, {7211, 14422, 1}, {14422, 21632, 2}},
        {{0, 128, 1}},
        {{0, 128, 2}},
        {{0, 10, 1}}}},
  };
  for (const Vector& want : vectors) {
    const PartitionPlan plan = MustCreate(SeedCnn(), want.shards);
    EXPECT_EQ(plan.fingerprint(), want.fingerprint) << want.shards << " shards";
    for (int v = 0; v < static_cast<int>(want.parts.size()); ++v) {
      std::vector<std::tuple<int64_t, int64_t, int>> got;
      for (int p : plan.PartsOfVariable(v)) {
        const Part& part = plan.parts()[p];
        got.emplace_back(part.row_begin, part.row_end, part.shard);
      }
      EXPECT_EQ(got, want.parts[v]) << plan.variables()[v].name << ", " << want.shards << " shards";
    }
  }
}

// The edge-case vector of docs/PROTOCOL.md (plan_reference.py's EDGE_MODEL,
// 4 shards): a variable of exactly min_split_bytes stays whole; k is limited
// by the rows (b), the bytes (c) and the shards, with uneven rows (g); a
// scalar; equal sizes placed in the UTF-8 byte order of their names, which
// sends "\xc3\xa9" to another shard than "e" and "f".
TEST(PartitionPlanTest, EdgeCasesMatchThePublishedTestVector) {
  using Parts = std::vector<std::tuple<int64_t, int64_t, int>>;
  const std::vector<VariableSpec> vars = {
      {"a", {256, 256}}, {"b", {3, 100000}}, {"c", {1000, 200}}, {"g", {7, 65536}},
      {"s", {}},         {"f", {1000}},      {"e", {1000}},      {"\xc3\xa9", {1000}}};
  const std::vector<Parts> want = {{{0, 256, 2}},
                                   {{0, 1, 3}, {1, 2, 0}, {2, 3, 1}},
                                   {{0, 334, 2}, {334, 667, 3}, {667, 1000, 0}},
                                   {{0, 2, 0}, {2, 4, 1}, {4, 6, 2}, {6, 7, 3}},
                                   {{0, 1, 1}},
                                   {{0, 1000, 1}},
                                   {{0, 1000, 1}},
                                   {{0, 1000, 3}}};
  const PartitionPlan plan = MustCreate(vars, 4);
  EXPECT_EQ(plan.fingerprint(), 0x7ed9d7a19fbdf0c4ULL);
  for (int v = 0; v < static_cast<int>(want.size()); ++v) {
    Parts got;
    for (int p : plan.PartsOfVariable(v)) {
      const Part& part = plan.parts()[p];
      got.emplace_back(part.row_begin, part.row_end, part.shard);
    }
    EXPECT_EQ(got, want[v]) << vars[v].name;
  }
}

TEST(PartitionPlanTest, FewerRowsThanShardsGivesOnePartPerRow) {
  // 3 * 200000 * 4 = 2.4 MB = 9 * 256 KiB, but only 3 rows.
  const PartitionPlan plan = MustCreate({{"wide", {3, 200000}}}, 8);
  CheckInvariants(plan);
  ASSERT_EQ(plan.parts().size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(plan.parts()[i].row_end - plan.parts()[i].row_begin, 1);
  int empty_shards = 0;
  for (int s = 0; s < 8; ++s) empty_shards += plan.PartsOnShard(s).empty() ? 1 : 0;
  EXPECT_EQ(empty_shards, 5);
}

TEST(PartitionPlanTest, OneShardHoldsEverythingWhole) {
  const PartitionPlan plan = MustCreate(SeedCnn(), 1);
  CheckInvariants(plan);
  EXPECT_EQ(plan.parts().size(), 6u);
  int64_t total = 0;
  for (const VariableSpec& v : SeedCnn()) total += v.num_elements() * 4;
  EXPECT_EQ(plan.ShardBytes(0), total);
}

TEST(PartitionPlanTest, ScalarIsOneWholePart) {
  // Even with a 1-byte threshold a scalar (4 bytes, one row) stays whole.
  const PartitionPlan plan = MustCreate({{"step", {}}, {"w", {8, 2}}}, 4, 1);
  CheckInvariants(plan);
  const std::vector<int> p = plan.PartsOfVariable(0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(plan.parts()[p[0]].row_begin, 0);
  EXPECT_EQ(plan.parts()[p[0]].row_end, 1);
  EXPECT_EQ(plan.parts()[p[0]].num_elements(), 1);
  EXPECT_EQ(plan.PartsOfVariable(1).size(), 4u);  // 64 bytes / 1 -> 4 shards
}

TEST(PartitionPlanTest, ThresholdIsExclusive) {
  // [256, 256] floats are exactly 256 KiB: not split. Twice that: 2 parts.
  const PartitionPlan at = MustCreate({{"at", {256, 256}}}, 4);
  EXPECT_EQ(at.parts().size(), 1u);
  const PartitionPlan twice = MustCreate({{"twice", {512, 256}}}, 4);
  CheckInvariants(twice);
  EXPECT_EQ(twice.parts().size(), 2u);
}

TEST(PartitionPlanTest, RandomModelsKeepEveryInvariant) {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<VariableSpec> vars;
    const int n = 1 + rng() % 12;
    for (int i = 0; i < n; ++i) {
      VariableSpec v{absl::StrCat("v", i), {}};
      const int rank = rng() % 4;
      for (int d = 0; d < rank; ++d) v.shape.push_back(1 + rng() % 60);
      vars.push_back(v);
    }
    const int shards = 1 + rng() % 7;
    const int64_t threshold = 1 + rng() % 2000;
    SCOPED_TRACE(testing::Message() << "trial " << trial << " shards " << shards);
    CheckInvariants(MustCreate(vars, shards, threshold));
  }
}

TEST(PartitionPlanTest, OutOfRangeQueriesAreEmpty) {
  const PartitionPlan plan = MustCreate(SeedCnn(), 2);
  EXPECT_TRUE(plan.PartsOfVariable(-1).empty());
  EXPECT_TRUE(plan.PartsOfVariable(6).empty());
  EXPECT_TRUE(plan.PartsOnShard(2).empty());
  EXPECT_EQ(plan.ShardBytes(-1), 0);
  EXPECT_EQ(plan.ShardBytes(2), 0);
  EXPECT_EQ(plan.FindVariable("dense/kernel"), 2);
  EXPECT_EQ(plan.FindVariable("nope"), -1);
}

TEST(PartitionPlanTest, DebugStringHasOneLinePerPart) {
  const PartitionPlan plan = MustCreate(SeedCnn(), 3);
  const std::string s = plan.DebugString();
  EXPECT_EQ(std::count(s.begin(), s.end(), '\n'), 1 + static_cast<long>(plan.parts().size()));
  for (const VariableSpec& v : SeedCnn()) EXPECT_THAT(s, HasSubstr(v.name));
}

void ExpectInvalid(std::vector<VariableSpec> vars, PartitionOptions options,
                   const std::string& fragment) {
  absl::StatusOr<PartitionPlan> plan = PartitionPlan::Create(std::move(vars), options);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr(fragment));
}

TEST(PartitionPlanTest, RejectsBadOptionsAndVariables) {
  PartitionOptions ok;
  ok.num_shards = 2;
  PartitionOptions zero_shards = ok;
  zero_shards.num_shards = 0;
  ExpectInvalid(SeedCnn(), zero_shards, "num_shards is 0");
  PartitionOptions zero_threshold = ok;
  zero_threshold.min_split_bytes = 0;
  ExpectInvalid(SeedCnn(), zero_threshold, "min_split_bytes is 0");
  ExpectInvalid({{"a", {2}}, {"", {3}}}, ok, "variable #1");
  ExpectInvalid({{"a", {2}}, {"b", {3}}, {"a", {4}}}, ok, "\"a\" appears twice");
  ExpectInvalid({{"w", {4, 0}}}, ok, "\"w\" has shape [4,0]: dimension 1 is 0");
  ExpectInvalid({{"w", {-3}}}, ok, "\"w\" has shape [-3]");
  ExpectInvalid({{"huge", {int64_t{1} << 40, int64_t{1} << 30}}}, ok, "\"huge\"");
  // Each fits a 64-bit byte count, their sum does not (a shard's load
  // used to wrap to a negative number).
  ExpectInvalid({{"a", {int64_t{1} << 60}}, {"b", {int64_t{1} << 60}}}, ok,
                "the variables up to \"b\" (#1) hold more bytes than a 64-bit count");
  ExpectInvalid({}, zero_shards, "num_shards");
}

TEST(PartitionPlanTest, EmptyModelIsAnEmptyPlan) {
  const PartitionPlan plan = MustCreate({}, 2);
  EXPECT_TRUE(plan.parts().empty());
  EXPECT_EQ(plan.ShardBytes(0), 0);
  EXPECT_NE(plan.fingerprint(), MustCreate({}, 3).fingerprint());
}

}  // namespace
}  // namespace psflow
