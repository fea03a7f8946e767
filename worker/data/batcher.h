// Per-worker sharding, per-epoch shuffling and background batch assembly
// over an in-memory Dataset (dataset.h).
//
// Sharding: the examples are split once into num_shards contiguous,
// near-equal ranges ([i*N/S, (i+1)*N/S)) of an index list; the list is a
// fixed permutation of 0..N-1 when shuffling (the same whatever the seed,
// so that workers given different seeds still split the data exactly),
// else 0..N-1 in order. So across all shards every example appears exactly once per epoch,
// and a shard holds the same examples in every epoch. Shard sizes differ by
// at most one example.
//
// Shuffling: each epoch visits the shard's examples in a fresh order derived
// from (seed, epoch, shard_index). The generator (SplitMix64) and the
// Fisher-Yates shuffle are implemented here rather than taken from <random>,
// whose std::shuffle differs between standard libraries, so every process
// and build computes the same orders.
#ifndef PSFLOW_WORKER_DATA_BATCHER_H_
#define PSFLOW_WORKER_DATA_BATCHER_H_

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/data/dataset.h"

namespace psflow::worker {

struct BatcherOptions {
  int batch_size = 64;                  // examples per batch, > 0
  int num_shards = 1, shard_index = 0;  // this worker's slice of the examples
  uint64_t seed = 0;                    // same on every worker of a job
  bool shuffle = true;                  // false: shard in data set order
  bool drop_remainder = false;          // false: an epoch's last batch may be smaller
  int prefetch = 2;                     // batches assembled ahead of the consumer, > 0
};

// One assembled batch. images: size*H*W*C floats in [0, 1] (pixel / 255),
// NHWC; labels: size entries. index counts the batches of an epoch from 0.
struct Batch {
  const float* images = nullptr;
  const int32_t* labels = nullptr;
  int size = 0;
  int epoch = 0;
  int64_t index = 0;
};

// The example indices, in visit order, that shard options.shard_index
// visits in `epoch` of a data set of num_examples examples. Deterministic in
// (num_examples, num_shards, shard_index, seed, shuffle, epoch); empty when
// the shard options are out of range.
std::vector<int64_t> ShardEpochOrder(int64_t num_examples, const BatcherOptions& options,
                                     int epoch);

// Writes examples indices[0..count) of `data` to `images` (count *
// example_size floats, pixel / 255) and `labels` (count entries).
// Precondition: every index is in [0, data.num_examples).
void FillBatchFromIndices(const Dataset& data, const int64_t* indices, int count, float* images,
                          int32_t* labels);

// Writes examples [begin, begin + count) of `data`, in order, clamped to the
// end of the data set, and returns how many were written (0 when begin is
// out of range). For evaluation over a whole split.
int FillBatch(const Dataset& data, int64_t begin, int count, float* images, int32_t* labels);

// Assembles batches of one shard on a background thread into a small ring of
// buffers allocated once by Create. Next() must be called from one thread at
// a time (a single consumer); the rest is internal. The Dataset must outlive
// the Batcher.
class Batcher {
 public:
  // INVALID_ARGUMENT for a null or inconsistent data set (pixels/labels
  // sizes vs num_examples), batch_size or prefetch <= 0, num_shards <= 0,
  // shard_index outside [0, num_shards), an empty shard, or a shard smaller
  // than one batch with drop_remainder.
  static absl::StatusOr<std::unique_ptr<Batcher>> Create(const Dataset* data,
                                                         const BatcherOptions& options);
  ~Batcher();  // stops and joins the background thread

  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  int64_t examples_per_epoch() const { return shard_size_; }
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  const BatcherOptions& options() const { return options_; }

  // Returns the next batch of `epoch`, or nullptr once that epoch's batches
  // are exhausted. Epochs are consumed in increasing order: asking for a
  // later epoch skips the rest of the current one (and any epochs between,
  // e.g. when resuming at epoch 7); asking for an earlier one, or a negative
  // one, returns nullptr. The returned batch stays valid until the next call.
  const Batch* Next(int epoch);

 private:
  struct Slot {
    std::vector<float> images;
    std::vector<int32_t> labels;
    Batch batch;
  };

  Batcher(const Dataset* data, const BatcherOptions& options, int64_t shard_size);
  void ProducerLoop();

  const Dataset* const data_;
  const BatcherOptions options_;
  const int64_t shard_size_;
  const int64_t batches_per_epoch_;
  std::vector<Slot> slots_;  // a ring; slot of sequence number s is s % size

  // Consumer-only state.
  int epoch_ = 0;           // the epoch Next() is in
  int64_t next_index_ = 0;  // the next batch index of epoch_ to hand out
  int64_t consumed_ = 0;    // sequence numbers taken from the ring
  bool holding_ = false;    // slot consumed_ - 1 is lent to the caller

  absl::Mutex mu_;
  int64_t produced_ ABSL_GUARDED_BY(mu_) = 0;  // slots filled
  int64_t released_ ABSL_GUARDED_BY(mu_) = 0;  // slots the consumer is done with
  int requested_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  std::thread producer_;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_DATA_BATCHER_H_
