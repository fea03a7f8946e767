#include "worker/data/batcher.h"

#include <algorithm>
#include <array>
#include <numeric>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace psflow::worker {
namespace {

// SplitMix64 (Steele, Lea, Flood 2014): tiny, fully specified, and good
// enough to shuffle; also used as the mixer that derives per-epoch seeds.
uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return Mix64(state_ += 0x9e3779b97f4a7c15ULL); }
  // Uniform in [0, bound), bound > 0, without modulo bias (Lemire 2019).
  uint64_t Below(uint64_t bound) {
    unsigned __int128 m = static_cast<unsigned __int128>(Next()) * bound;
    if (static_cast<uint64_t>(m) < bound) {
      const uint64_t threshold = (0 - bound) % bound;
      while (static_cast<uint64_t>(m) < threshold) {
        m = static_cast<unsigned __int128>(Next()) * bound;
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

 private:
  uint64_t state_;
};

// Distinct streams for the one-time partition and the per-epoch orders.
constexpr uint64_t kPartitionTag = 0x70617274ULL;  // "part"
constexpr uint64_t kEpochTag = 0x65706f63ULL;      // "epoc"

void Shuffle(std::vector<int64_t>& v, uint64_t seed) {
  SplitMix64 rng(seed);
  for (size_t i = v.size(); i > 1; --i) {
    std::swap(v[i - 1], v[rng.Below(i)]);
  }
}

const std::array<float, 256>& PixelToFloat() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t;
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(i) / 255.0f;
    return t;
  }();
  return table;
}

void FillOne(const Dataset& data, int64_t example, float* images, int32_t* label) {
  const std::array<float, 256>& lut = PixelToFloat();
  const int64_t n = data.example_size();
  const uint8_t* src = data.pixels.data() + example * n;
  for (int64_t j = 0; j < n; ++j) images[j] = lut[src[j]];
  *label = data.labels[example];
}

bool ShardInRange(const BatcherOptions& o) {
  return o.num_shards > 0 && o.shard_index >= 0 && o.shard_index < o.num_shards;
}

}  // namespace

std::vector<int64_t> ShardEpochOrder(int64_t num_examples, const BatcherOptions& options,
                                     int epoch) {
  if (!ShardInRange(options) || num_examples <= 0) return {};
  const int64_t begin = num_examples * options.shard_index / options.num_shards;
  const int64_t end = num_examples * (options.shard_index + 1) / options.num_shards;
  std::vector<int64_t> order(static_cast<size_t>(end - begin));
  if (!options.shuffle) {
    std::iota(order.begin(), order.end(), begin);
    return order;
  }
  // The partition permutation is recomputed each epoch (O(N), a few ms for
  // 60k examples) so that nothing but the options needs to be stored.
  std::vector<int64_t> all(static_cast<size_t>(num_examples));
  std::iota(all.begin(), all.end(), int64_t{0});
  // Not from the seed: workers given different --seed values (nothing
  // checks that they agree) would split the data differently, and drop or
  // repeat examples without a word. As TensorFlow's Dataset.shard, the
  // split depends only on the data and the workers.
  Shuffle(all, Mix64(kPartitionTag));
  std::copy(all.begin() + begin, all.begin() + end, order.begin());
  const uint64_t epoch_seed =
      Mix64(Mix64(Mix64(Mix64(options.seed) ^ kEpochTag) ^ static_cast<uint64_t>(epoch)) ^
            static_cast<uint64_t>(options.shard_index));
  Shuffle(order, epoch_seed);
  return order;
}

void FillBatchFromIndices(const Dataset& data, const int64_t* indices, int count, float* images,
                          int32_t* labels) {
  const int64_t n = data.example_size();
  for (int i = 0; i < count; ++i) FillOne(data, indices[i], images + i * n, labels + i);
}

int FillBatch(const Dataset& data, int64_t begin, int count, float* images, int32_t* labels) {
  if (begin < 0 || begin >= data.num_examples || count <= 0) return 0;
  const int n = static_cast<int>(std::min<int64_t>(count, data.num_examples - begin));
  const int64_t size = data.example_size();
  for (int i = 0; i < n; ++i) FillOne(data, begin + i, images + i * size, labels + i);
  return n;
}

absl::StatusOr<std::unique_ptr<Batcher>> Batcher::Create(const Dataset* data,
                                                         const BatcherOptions& options) {
  if (data == nullptr) return absl::InvalidArgumentError("Batcher: data set is null");
  const int64_t n = data->num_examples;
  if (n < 0 || data->example_size() <= 0 ||
      data->pixels.size() != static_cast<size_t>(n * data->example_size()) ||
      data->labels.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Batcher: data set ", data->name, " is inconsistent: ", n, " examples of ",
        data->height, "x", data->width, "x", data->channels, " need ",
        n * data->example_size(), " pixels and ", n, " labels, found ", data->pixels.size(),
        " pixels and ", data->labels.size(), " labels"));
  }
  if (options.batch_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Batcher: batch_size must be > 0, got ", options.batch_size));
  }
  if (options.prefetch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Batcher: prefetch must be > 0, got ", options.prefetch));
  }
  if (options.num_shards <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Batcher: num_shards must be > 0, got ", options.num_shards));
  }
  if (!ShardInRange(options)) {
    return absl::InvalidArgumentError(absl::StrCat("Batcher: shard_index must be in [0, ",
                                                   options.num_shards, "), got ",
                                                   options.shard_index));
  }
  const int64_t shard_size = n * (options.shard_index + 1) / options.num_shards -
                             n * options.shard_index / options.num_shards;
  if (shard_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Batcher: shard ", options.shard_index, " of ", options.num_shards, " of data set ",
        data->name, " (", n, " examples) is empty"));
  }
  if (options.drop_remainder && shard_size < options.batch_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Batcher: shard ", options.shard_index, " of ", options.num_shards, " of data set ",
        data->name, " holds ", shard_size, " examples, fewer than one batch of ",
        options.batch_size, " with drop_remainder"));
  }
  try {
    return std::unique_ptr<Batcher>(new Batcher(data, options, shard_size));
  } catch (const std::system_error& e) {  // its thread could not be started
    return absl::ResourceExhaustedError(
        absl::StrCat("Batcher: could not start the thread that assembles the batches of ",
                     data->name, ": ", e.what(), " (is the process out of threads?)"));
  }
}

Batcher::Batcher(const Dataset* data, const BatcherOptions& options, int64_t shard_size)
    : data_(data),
      options_(options),
      shard_size_(shard_size),
      batches_per_epoch_(options.drop_remainder
                             ? shard_size / options.batch_size
                             : (shard_size + options.batch_size - 1) / options.batch_size),
      slots_(static_cast<size_t>(options.prefetch) + 1) {
  for (Slot& slot : slots_) {
    slot.images.resize(static_cast<size_t>(options.batch_size) * data->example_size());
    slot.labels.resize(static_cast<size_t>(options.batch_size));
    slot.batch.images = slot.images.data();
    slot.batch.labels = slot.labels.data();
  }
  producer_ = std::thread([this] { ProducerLoop(); });
}

Batcher::~Batcher() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  producer_.join();
}

void Batcher::ProducerLoop() {
  const int64_t ring = static_cast<int64_t>(slots_.size());
  int epoch = 0;
  int64_t index = 0;
  std::vector<int64_t> order = ShardEpochOrder(data_->num_examples, options_, epoch);
  while (true) {
    int64_t seq;
    bool jumped = false;
    {
      absl::MutexLock lock(&mu_);
      auto can_fill = [this, ring]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || produced_ < released_ + ring;
      };
      mu_.Await(absl::Condition(&can_fill));
      if (stop_) return;
      if (requested_epoch_ > epoch) {  // the consumer skipped ahead
        epoch = requested_epoch_;
        index = 0;
        jumped = true;
      }
      seq = produced_;
    }
    if (jumped) order = ShardEpochOrder(data_->num_examples, options_, epoch);

    Slot& slot = slots_[static_cast<size_t>(seq % ring)];
    const int64_t begin = index * options_.batch_size;
    const int size = static_cast<int>(std::min<int64_t>(options_.batch_size, shard_size_ - begin));
    FillBatchFromIndices(*data_, order.data() + begin, size, slot.images.data(),
                         slot.labels.data());
    slot.batch.size = size;
    slot.batch.epoch = epoch;
    slot.batch.index = index;
    {
      absl::MutexLock lock(&mu_);
      ++produced_;
    }
    if (++index == batches_per_epoch_) {
      ++epoch;
      index = 0;
      order = ShardEpochOrder(data_->num_examples, options_, epoch);
    }
  }
}

const Batch* Batcher::Next(int epoch) {
  if (holding_) {
    absl::MutexLock lock(&mu_);
    released_ = consumed_;
    holding_ = false;
  }
  if (epoch < epoch_ || (epoch == epoch_ && next_index_ >= batches_per_epoch_)) return nullptr;
  if (epoch > epoch_) {
    epoch_ = epoch;
    next_index_ = 0;
    absl::MutexLock lock(&mu_);
    requested_epoch_ = epoch;
  }
  const int64_t ring = static_cast<int64_t>(slots_.size());
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return consumed_ < produced_; };
      mu_.Await(absl::Condition(&ready));
    }
    Slot& slot = slots_[static_cast<size_t>(consumed_ % ring)];
    ++consumed_;
    const Batch& b = slot.batch;
    // Batches of epochs the caller skipped are dropped; the producer only
    // moves forward, so the first one not dropped is (epoch_, next_index_).
    if (b.epoch < epoch_ || (b.epoch == epoch_ && b.index < next_index_)) {
      absl::MutexLock lock(&mu_);
      released_ = consumed_;
      continue;
    }
    ++next_index_;
    holding_ = true;
    return &b;
  }
}

}  // namespace psflow::worker
