#include "worker/data/batcher.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/data/dataset.h"

namespace psflow::worker {
namespace {

using ::testing::HasSubstr;

// A data set whose example e carries its id in its first two pixels (low
// byte, high byte), a third pixel of 255 and label e % 10.
Dataset IdDataset(int64_t n, int height = 2, int width = 2, int channels = 1) {
  Dataset d;
  d.name = "ids";
  d.height = height;
  d.width = width;
  d.channels = channels;
  d.num_examples = n;
  const int64_t size = d.example_size();
  d.pixels.assign(static_cast<size_t>(n * size), 0);
  d.labels.resize(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    d.pixels[e * size + 0] = static_cast<uint8_t>(e % 256);
    d.pixels[e * size + 1] = static_cast<uint8_t>(e / 256);
    d.pixels[e * size + 2] = 255;
    d.labels[e] = static_cast<int32_t>(e % 10);
  }
  return d;
}

// Decodes the example id of image i of a batch, checking the other pixels.
int64_t DecodeId(const Dataset& d, const float* images, int i) {
  const float* img = images + i * d.example_size();
  const auto byte = [](float v) {
    EXPECT_GE(v, 0.0f);
    EXPECT_LE(v, 1.0f);
    return static_cast<int64_t>(std::lround(v * 255.0f));
  };
  EXPECT_EQ(img[2], 1.0f);
  return byte(img[0]) + 256 * byte(img[1]);
}

// All example ids of one epoch of a batcher, in order, checking batch
// metadata and labels on the way.
std::vector<int64_t> DrainEpoch(const Dataset& d, Batcher& batcher, int epoch) {
  std::vector<int64_t> ids;
  int64_t expected_index = 0;
  while (const Batch* b = batcher.Next(epoch)) {
    EXPECT_EQ(b->epoch, epoch);
    EXPECT_EQ(b->index, expected_index++);
    EXPECT_GT(b->size, 0);
    for (int i = 0; i < b->size; ++i) {
      const int64_t id = DecodeId(d, b->images, i);
      EXPECT_EQ(b->labels[i], id % 10) << "id " << id;
      ids.push_back(id);
    }
  }
  EXPECT_EQ(expected_index, batcher.batches_per_epoch());
  return ids;
}

std::unique_ptr<Batcher> MakeBatcher(const Dataset* d, const BatcherOptions& o) {
  absl::StatusOr<std::unique_ptr<Batcher>> b = Batcher::Create(d, o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

TEST(FillBatchTest, NormalizesPixelsToUnitRange) {
  Dataset d;
  d.height = 1;
  d.width = 2;
  d.channels = 2;
  d.num_examples = 2;
  d.pixels = {0, 255, 128, 1, 51, 204, 17, 254};
  d.labels = {4, 6};
  std::vector<float> images(8, -1.0f);
  std::vector<int32_t> labels(2, -1);
  ASSERT_EQ(FillBatch(d, 0, 2, images.data(), labels.data()), 2);
  EXPECT_EQ(images[0], 0.0f);
  EXPECT_EQ(images[1], 1.0f);
  EXPECT_FLOAT_EQ(images[2], 0.50196081f);  // 128 / 255
  EXPECT_FLOAT_EQ(images[3], 0.0039215689f);
  EXPECT_FLOAT_EQ(images[4], 0.2f);  // 51 / 255
  EXPECT_FLOAT_EQ(images[5], 0.8f);
  EXPECT_FLOAT_EQ(images[6], 0.06666667f);
  EXPECT_FLOAT_EQ(images[7], 0.99607843f);
  EXPECT_EQ(labels, (std::vector<int32_t>{4, 6}));
}

TEST(FillBatchTest, IteratesInOrderAndClampsAtTheEnd) {
  const Dataset d = IdDataset(10);
  std::vector<float> images(4 * 4);
  std::vector<int32_t> labels(4);
  std::vector<int64_t> seen;
  for (int64_t begin = 0; begin < d.num_examples; begin += 4) {
    const int n = FillBatch(d, begin, 4, images.data(), labels.data());
    EXPECT_EQ(n, begin == 8 ? 2 : 4);
    for (int i = 0; i < n; ++i) seen.push_back(DecodeId(d, images.data(), i));
  }
  std::vector<int64_t> expected(10);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(seen, expected);
  EXPECT_EQ(FillBatch(d, 10, 4, images.data(), labels.data()), 0);
  EXPECT_EQ(FillBatch(d, -1, 4, images.data(), labels.data()), 0);
}

TEST(FillBatchTest, FromIndicesKeepsTheGivenOrder) {
  const Dataset d = IdDataset(300);  // ids above 255 use the high byte
  const std::vector<int64_t> indices = {299, 0, 256, 7};
  std::vector<float> images(4 * 4);
  std::vector<int32_t> labels(4);
  FillBatchFromIndices(d, indices.data(), 4, images.data(), labels.data());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(DecodeId(d, images.data(), i), indices[i]);
    EXPECT_EQ(labels[i], indices[i] % 10);
  }
}

TEST(BatcherTest, ShardsCoverEveryExampleOncePerEpoch) {
  const Dataset d = IdDataset(100);
  for (int num_shards : {1, 2, 3}) {
    for (bool shuffle : {true, false}) {
      std::vector<std::set<int64_t>> shard_sets(num_shards);
      for (int epoch = 0; epoch < 3; ++epoch) {
        std::vector<int> count(100, 0);
        for (int s = 0; s < num_shards; ++s) {
          BatcherOptions o;
          o.batch_size = 7;
          o.num_shards = num_shards;
          o.shard_index = s;
          o.seed = 42;
          o.shuffle = shuffle;
          std::unique_ptr<Batcher> b = MakeBatcher(&d, o);
          ASSERT_NE(b, nullptr);
          // Balanced shards: 100 / num_shards, rounded either way.
          EXPECT_GE(b->examples_per_epoch(), 100 / num_shards);
          EXPECT_LE(b->examples_per_epoch(), (100 + num_shards - 1) / num_shards);
          for (int skip = 0; skip < epoch; ++skip) {
            while (b->Next(skip) != nullptr) {
            }
          }
          const std::vector<int64_t> ids = DrainEpoch(d, *b, epoch);
          EXPECT_EQ(static_cast<int64_t>(ids.size()), b->examples_per_epoch());
          for (int64_t id : ids) {
            ASSERT_GE(id, 0);
            ASSERT_LT(id, 100);
            ++count[id];
          }
          // A shard holds the same examples in every epoch.
          const std::set<int64_t> set(ids.begin(), ids.end());
          if (epoch == 0) {
            shard_sets[s] = set;
          } else {
            EXPECT_EQ(set, shard_sets[s]) << "shard " << s << " epoch " << epoch;
          }
        }
        for (int id = 0; id < 100; ++id) {
          EXPECT_EQ(count[id], 1) << "id " << id << ", " << num_shards << " shards, epoch "
                                  << epoch << (shuffle ? ", shuffled" : "");
        }
      }
    }
  }
}

// Workers whose --seed differs (nothing checks that they agree) still split
// the data exactly: the split does not depend on the seed, only the order
// within a shard does.
TEST(BatcherTest, WorkersWithDifferentSeedsStillSplitTheDataExactly) {
  const Dataset d = IdDataset(100);
  std::vector<int> count(100, 0);
  for (int s = 0; s < 3; ++s) {
    BatcherOptions o;
    o.batch_size = 8;
    o.num_shards = 3;
    o.shard_index = s;
    o.seed = 1000 + s;
    for (int64_t id : ShardEpochOrder(100, o, 0)) ++count[id];
  }
  EXPECT_THAT(count, ::testing::Each(1));
}

TEST(BatcherTest, WithoutShuffleVisitsTheShardInOrder) {
  const Dataset d = IdDataset(10);
  BatcherOptions o;
  o.batch_size = 3;
  o.num_shards = 3;
  o.shard_index = 1;  // [10*1/3, 10*2/3) = [3, 6)
  o.shuffle = false;
  std::unique_ptr<Batcher> b = MakeBatcher(&d, o);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(DrainEpoch(d, *b, 0), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(DrainEpoch(d, *b, 1), (std::vector<int64_t>{3, 4, 5}));
}

TEST(BatcherTest, EpochsDifferAndSeedsReproduce) {
  const Dataset d = IdDataset(200);
  BatcherOptions o;
  o.batch_size = 16;
  o.seed = 7;
  std::unique_ptr<Batcher> a = MakeBatcher(&d, o);
  std::unique_ptr<Batcher> b = MakeBatcher(&d, o);
  o.seed = 8;
  std::unique_ptr<Batcher> c = MakeBatcher(&d, o);
  ASSERT_TRUE(a && b && c);
  std::vector<int64_t> in_order(200);
  std::iota(in_order.begin(), in_order.end(), 0);
  std::vector<std::vector<int64_t>> orders;
  for (int epoch = 0; epoch < 3; ++epoch) {
    const std::vector<int64_t> ea = DrainEpoch(d, *a, epoch);
    const std::vector<int64_t> eb = DrainEpoch(d, *b, epoch);
    const std::vector<int64_t> ec = DrainEpoch(d, *c, epoch);
    EXPECT_EQ(ea, eb) << "same seed, epoch " << epoch;
    EXPECT_NE(ea, ec) << "different seeds, epoch " << epoch;
    EXPECT_NE(ea, in_order) << "epoch " << epoch << " not shuffled";
    for (const auto& earlier : orders) EXPECT_NE(ea, earlier) << "epoch " << epoch;
    orders.push_back(ea);
  }
}

TEST(BatcherTest, MatchesShardEpochOrder) {
  const Dataset d = IdDataset(50);
  BatcherOptions o;
  o.batch_size = 8;
  o.num_shards = 3;
  o.shard_index = 2;
  o.seed = 123;
  std::unique_ptr<Batcher> b = MakeBatcher(&d, o);
  ASSERT_NE(b, nullptr);
  for (int epoch = 0; epoch < 4; ++epoch) {
    const std::vector<int64_t> order = ShardEpochOrder(50, o, epoch);
    EXPECT_EQ(static_cast<int64_t>(order.size()), b->examples_per_epoch());
    EXPECT_EQ(DrainEpoch(d, *b, epoch), order) << "epoch " << epoch;
    EXPECT_EQ(ShardEpochOrder(50, o, epoch), order);  // a pure function
  }
  o.shard_index = 3;
  EXPECT_TRUE(ShardEpochOrder(50, o, 0).empty());
}

TEST(BatcherTest, LastPartialBatchAndDropRemainder) {
  const Dataset d = IdDataset(23);
  BatcherOptions o;
  o.batch_size = 5;
  std::unique_ptr<Batcher> keep = MakeBatcher(&d, o);
  o.drop_remainder = true;
  std::unique_ptr<Batcher> drop = MakeBatcher(&d, o);
  ASSERT_TRUE(keep && drop);
  EXPECT_EQ(keep->batches_per_epoch(), 5);  // 4 of 5 and one of 3
  EXPECT_EQ(drop->batches_per_epoch(), 4);  // 3 examples dropped
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<int> keep_sizes, drop_sizes;
    std::vector<int64_t> keep_ids, drop_ids;
    while (const Batch* b = keep->Next(epoch)) {
      keep_sizes.push_back(b->size);
      for (int i = 0; i < b->size; ++i) keep_ids.push_back(DecodeId(d, b->images, i));
    }
    while (const Batch* b = drop->Next(epoch)) {
      drop_sizes.push_back(b->size);
      for (int i = 0; i < b->size; ++i) drop_ids.push_back(DecodeId(d, b->images, i));
    }
    EXPECT_EQ(keep_sizes, (std::vector<int>{5, 5, 5, 5, 3}));
    EXPECT_EQ(drop_sizes, (std::vector<int>{5, 5, 5, 5}));
    EXPECT_EQ(std::set<int64_t>(keep_ids.begin(), keep_ids.end()).size(), 23u);
    // Same options but drop_remainder: the same order, minus the tail.
    ASSERT_EQ(drop_ids.size(), 20u);
    EXPECT_TRUE(std::equal(drop_ids.begin(), drop_ids.end(), keep_ids.begin()));
  }
}

TEST(BatcherTest, ExhaustedEpochKeepsReturningNull) {
  const Dataset d = IdDataset(6);
  BatcherOptions o;
  o.batch_size = 4;
  std::unique_ptr<Batcher> b = MakeBatcher(&d, o);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(b->Next(0), nullptr);
  ASSERT_NE(b->Next(0), nullptr);
  EXPECT_EQ(b->Next(0), nullptr);
  EXPECT_EQ(b->Next(0), nullptr);
  const Batch* next = b->Next(1);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->epoch, 1);
  EXPECT_EQ(next->index, 0);
  EXPECT_EQ(b->Next(0), nullptr);  // an earlier epoch is over
  EXPECT_EQ(b->Next(-1), nullptr);
}

TEST(BatcherTest, SkippingAheadStartsTheRequestedEpoch) {
  const Dataset d = IdDataset(40);
  BatcherOptions o;
  o.batch_size = 6;
  o.seed = 99;
  o.prefetch = 3;
  std::unique_ptr<Batcher> b = MakeBatcher(&d, o);
  ASSERT_NE(b, nullptr);
  const Batch* first = b->Next(0);  // leave epoch 0 (and 1..4) unfinished
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(DrainEpoch(d, *b, 5), ShardEpochOrder(40, o, 5));
  EXPECT_EQ(DrainEpoch(d, *b, 6), ShardEpochOrder(40, o, 6));
}

TEST(BatcherTest, ManyEpochsThroughASmallRing) {
  const Dataset d = IdDataset(30, 4, 4, 3);
  BatcherOptions o;
  o.batch_size = 4;
  o.num_shards = 2;
  o.shard_index = 1;
  o.seed = 5;
  o.prefetch = 1;
  std::unique_ptr<Batcher> b = MakeBatcher(&d, o);
  ASSERT_NE(b, nullptr);
  for (int epoch = 0; epoch < 40; ++epoch) {
    // The order is computed before each batch is checked, so the producer
    // has every chance to run ahead and clobber a batch still in use.
    const std::vector<int64_t> expected = ShardEpochOrder(30, o, epoch);
    size_t pos = 0;
    while (const Batch* batch = b->Next(epoch)) {
      const std::vector<int64_t> again = ShardEpochOrder(30, o, epoch);
      ASSERT_EQ(again, expected);
      for (int i = 0; i < batch->size; ++i, ++pos) {
        ASSERT_LT(pos, expected.size());
        ASSERT_EQ(DecodeId(d, batch->images, i), expected[pos]) << "epoch " << epoch;
      }
    }
    ASSERT_EQ(pos, expected.size());
  }
}

TEST(BatcherTest, DestroyMidEpoch) {
  const Dataset d = IdDataset(100);
  BatcherOptions o;
  o.batch_size = 3;
  std::unique_ptr<Batcher> b = MakeBatcher(&d, o);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(b->Next(0), nullptr);
  b.reset();  // joins a producer blocked on a full ring
  std::unique_ptr<Batcher> untouched = MakeBatcher(&d, o);
  untouched.reset();  // and one that was never asked for anything
}

TEST(BatcherTest, CreateRejectsBadOptions) {
  const Dataset d = IdDataset(5);
  auto code_of = [&](const Dataset* data, BatcherOptions o) {
    return Batcher::Create(data, o).status();
  };
  BatcherOptions o;
  EXPECT_EQ(code_of(nullptr, o).code(), absl::StatusCode::kInvalidArgument);

  o.batch_size = 0;
  absl::Status s = code_of(&d, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("batch_size"));

  o = BatcherOptions();
  o.num_shards = 3;
  o.shard_index = 3;
  s = code_of(&d, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("[0, 3)"));
  o.shard_index = -1;
  EXPECT_EQ(code_of(&d, o).code(), absl::StatusCode::kInvalidArgument);

  o = BatcherOptions();
  o.num_shards = 0;
  EXPECT_EQ(code_of(&d, o).code(), absl::StatusCode::kInvalidArgument);

  o = BatcherOptions();
  o.prefetch = 0;
  EXPECT_EQ(code_of(&d, o).code(), absl::StatusCode::kInvalidArgument);

  const Dataset tiny = IdDataset(2);  // 3 shards of 2 examples: one is empty
  o = BatcherOptions();
  o.num_shards = 3;
  o.shard_index = 0;
  s = code_of(&tiny, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("empty"));

  o = BatcherOptions();
  o.batch_size = 6;
  o.drop_remainder = true;  // 5 examples, no whole batch
  EXPECT_EQ(code_of(&d, o).code(), absl::StatusCode::kInvalidArgument);

  Dataset broken = IdDataset(5);
  broken.labels.pop_back();
  EXPECT_EQ(code_of(&broken, BatcherOptions()).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace psflow::worker
