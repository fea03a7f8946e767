#include "ps_server/variable_store.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <new>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/float_buffer.h"
#include "common/process_stats.h"
#include "common/status_macros.h"
#include "common/tensor_checks.h"

namespace psflow::server {

namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

}  // namespace

absl::Status VariableStore::ValidateDefinition(const PartDefinition& def) {
  if (def.variable.empty()) return absl::InvalidArgumentError("a part has an empty variable name");
  if (def.variable.size() > kMaxVariableNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "variable '", absl::string_view(def.variable).substr(0, 64), "...' has a name of ",
        def.variable.size(), " bytes; expected at most ", kMaxVariableNameBytes));
  }
  if (def.variable_shape.size() > kMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat("variable '", def.variable, "' has a shape of ", def.variable_shape.size(),
                     " dimensions; expected at most ", kMaxRank, " (TensorFlow's limit)"));
  }
  // Every count derived from the shape (elements, bytes with the optimizer's
  // slots) must fit in 64 bits: at most 2^56 elements.
  constexpr int64_t kMaxElements = int64_t{1} << 56;
  int64_t elements = 1;
  for (int64_t d : def.variable_shape) {
    if (d <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("variable '", def.variable, "' has shape ",
                                                     ShapeString(def.variable_shape),
                                                     "; every dimension must be positive"));
    }
    if (__builtin_mul_overflow(elements, d, &elements) || elements > kMaxElements) {
      return absl::InvalidArgumentError(absl::StrCat(
          "variable '", def.variable, "' has shape ", ShapeString(def.variable_shape),
          "; expected at most 2^56 elements"));
    }
  }
  const int64_t rows = def.variable_shape.empty() ? 1 : def.variable_shape[0];
  if (def.row_begin < 0 || def.row_end <= def.row_begin || def.row_end > rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("variable '", def.variable, "' part has rows [", def.row_begin, ",",
                     def.row_end, "); expected a non-empty range within [0,", rows, ")"));
  }
  return absl::OkStatus();
}

int64_t VariableStore::PartOverheadBytes(const PartDefinition& def) {
  // The name is held twice: as the table's key and in the definition.
  const int64_t described =
      static_cast<int64_t>(2 * def.variable.size() + 8 * def.variable_shape.size());
  return kPartBytes + std::max<int64_t>(0, described - 128);
}

namespace {

using Ranges = std::vector<std::pair<int64_t, int64_t>>;
using RangeMap = absl::btree_map<int64_t, int64_t>;  // as VariableStore::RangeMap

// Whether [begin, end) shares an element with any range of `ranges`.
bool OverlapsAny(const Ranges& ranges, int64_t begin, int64_t end) {
  for (const auto& [b, e] : ranges) {
    if (b < end && begin < e) return true;
  }
  return false;
}

// Usually one range: kept inline, so that a segment's claim allocates nothing.
using FewRanges = absl::InlinedVector<std::pair<int64_t, int64_t>, 2>;

// The parts of [begin, end) that `done` does not cover.
FewRanges Uncovered(const RangeMap& done, int64_t begin, int64_t end) {
  FewRanges out;
  int64_t at = begin;
  // Start at the last range beginning at or before `begin` (it may cover it).
  auto it = done.upper_bound(begin);
  if (it != done.begin()) --it;
  for (; it != done.end(); ++it) {
    const auto [b, e] = *it;
    if (e <= at) continue;
    if (b >= end) break;
    if (b > at) out.emplace_back(at, b);
    at = std::max(at, e);
    if (at >= end) break;
  }
  if (at < end) out.emplace_back(at, end);
  return out;
}

// Whether a range of `ranges` overlaps [begin, end) or touches it at either
// end (so that adding [begin, end) would merge with it).
bool Touches(const RangeMap& ranges, int64_t begin, int64_t end) {
  auto it = ranges.upper_bound(end);  // the first beginning after `end`
  if (it == ranges.begin()) return false;
  return std::prev(it)->second >= begin;  // the last beginning at or before `end`
}

// Adds [begin, end) to `ranges`, merging it with those it touches or overlaps.
void AddRange(RangeMap* ranges, int64_t begin, int64_t end) {
  auto it = ranges->upper_bound(begin);
  // A neighbour on the left that touches or overlaps.
  if (it != ranges->begin()) {
    auto left = std::prev(it);
    if (left->second >= begin) {
      begin = left->first;
      end = std::max(end, left->second);
      it = ranges->erase(left);
    }
  }
  while (it != ranges->end() && it->first <= end) {
    end = std::max(end, it->second);
    it = ranges->erase(it);
  }
  ranges->emplace_hint(it, begin, end);
}

// What the exactly-once ledger counts for a part's Progress (its hash map
// node and a tree's first node) and for each range in a tree: a little more
// than measured (84 and 19 bytes of resident memory each,
// variable_store_test's ledger tests without the bits and the bound).
constexpr int64_t kProgressBytes = 96;
constexpr int64_t kRangeBytes = 24;
// And for each remembered id: its entry with the shared_ptr's control block,
// the first word of its bits, its slot in the id table and its place in the
// queue. Measured: 213 bytes of resident memory per id with 150,000 finished
// one-part pushes (LedgerRemembersIdsByAgeNotByCount, with Abseil's
// deadlock detection off as in the binaries), of which the id table took
// 44; it takes 28 to 57 depending on how full it is.
constexpr int64_t kLedgerIdBytes = 232;

bool TestBit(const std::vector<uint64_t>& bits, int64_t i) {
  const size_t word = static_cast<size_t>(i / 64);
  return word < bits.size() && (bits[word] >> (i % 64) & 1) != 0;
}

// Sets bit i, growing `bits` as needed; returns the bytes added.
int64_t SetBit(std::vector<uint64_t>* bits, int64_t i) {
  const size_t word = static_cast<size_t>(i / 64);
  int64_t added = 0;
  if (word >= bits->size()) {
    added = static_cast<int64_t>(word + 1 - bits->size()) * 8;
    bits->resize(word + 1, 0);
  }
  (*bits)[word] |= uint64_t{1} << (i % 64);
  return added;
}

// Calls fn(stripe, at, n) for the run [at, at + n) of [begin, end) in each
// lock stripe the range crosses, in order.
template <typename Fn>
void ForEachStripe(int64_t begin, int64_t end, Fn fn) {
  constexpr int64_t kStripe = VariableStore::kLockStripeElements;
  for (int64_t at = begin; at < end;) {
    const int64_t stripe = at / kStripe;
    const int64_t n = std::min(end, (stripe + 1) * kStripe) - at;
    fn(stripe, at, n);
    at += n;
  }
}

}  // namespace

// ---- Parameters shared with pulls (copy on write) ----

// Spare buffers of a whole stripe's size, for the copies that pinned
// stripes force: fresh memory costs about 12 us per 4 KiB page on first
// touch here, about 0.8 ms for a stripe, where a copy into a reused buffer
// costs tens of microseconds. At most kMaxFree are kept (8 MiB).
class ValuesPool {
 public:
  static constexpr size_t kMaxFree = 32;
  FloatBuffer Get(int64_t size) {
    if (size == VariableStore::kLockStripeElements) {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        FloatBuffer b = std::move(free_.back());
        free_.pop_back();
        return b;
      }
    }
    return FloatBuffer(size);
  }
  void Put(FloatBuffer buffer) {
    if (buffer.size() != VariableStore::kLockStripeElements) return;
    absl::MutexLock lock(&mu_);
    if (free_.size() < kMaxFree) free_.push_back(std::move(buffer));
  }

 private:
  absl::Mutex mu_;
  std::vector<FloatBuffer> free_ ABSL_GUARDED_BY(mu_);
};

// One lock stripe's parameter values and the references to them: its part's
// (while they are the stripe's home or current values) and one per pin. The
// part writes them in place only while it holds the sole reference; the
// last reference frees them (a copy's buffer goes back to its pool).
class SharedValues {
 public:
  // `size` floats at `data`, in the part's buffer that `home` keeps alive.
  SharedValues(float* data, int64_t size, std::shared_ptr<FloatBuffer> home)
      : data_(data), size_(size), home_(std::move(home)) {}
  // A buffer of its own from `pool`, which it goes back to.
  SharedValues(int64_t size, std::shared_ptr<ValuesPool> pool)
      : own_(pool->Get(size)), pool_(std::move(pool)) {
    data_ = own_.data();
    size_ = own_.size();
  }
  float* data() const { return data_; }
  int64_t size() const { return size_; }
  // Relaxed: a new reference is taken only by one who holds one already
  // (the part, under the stripe's lock).
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    // acq_rel: whatever the releasing holder read of the values happens
    // before the part's next write (Shared's acquire) or the free.
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      if (pool_ != nullptr) pool_->Put(std::move(own_));
      delete this;
    }
  }
  // Whether anyone but the part holds them (then the part must copy them
  // before it writes). Only the part adds references, under the stripe's
  // lock, so while that lock is held exclusively the answer can only go
  // from true to false.
  bool Shared() const { return refs_.load(std::memory_order_acquire) > 1; }

 private:
  std::atomic<int32_t> refs_{1};
  float* data_;
  int64_t size_;
  FloatBuffer own_;
  std::shared_ptr<ValuesPool> pool_;
  std::shared_ptr<FloatBuffer> home_;
};

VariableStore::Part::~Part() {
  for (int64_t i = 0; params != nullptr && i < num_stripes; ++i) {
    if (params[i].home == nullptr) break;  // NewPart ran out of memory here
    if (params[i].current != params[i].home) params[i].current->Unref();
    params[i].home->Unref();
  }
}

void VariableStore::Part::CopyValues(int64_t offset, int64_t count, void* out) const {
  ForEachStripe(offset, offset + count, [&](int64_t stripe, int64_t at, int64_t n) {
    std::memcpy(static_cast<char*>(out) + 4 * (at - offset),
                params[stripe].current->data() + (at - stripe * kLockStripeElements), n * 4);
  });
}

void VariableStore::Unpin(void* pin) { static_cast<SharedValues*>(pin)->Unref(); }

float* VariableStore::WritableValues(Part& part, int64_t stripe) {
  StripeValues& v = part.params[stripe];
  SharedValues* to;
  if (v.current != v.home && !v.home->Shared()) {
    // Away, and home is free again: back home, so that a stripe holds a
    // second buffer only while a pull holds its home (the part's buffer
    // cannot give a stripe's share back).
    to = v.home;
  } else if (v.current->Shared()) {
    // Pinned, and home too: a buffer of its own.
    to = new SharedValues(v.current->size(), values_pool_);
  } else {
    return v.current->data();
  }
  std::memcpy(to->data(), v.current->data(), static_cast<size_t>(v.current->size()) * 4);
  if (v.current != v.home) v.current->Unref();  // freed when the last pull lets go
  v.current = to;
  ++stripes_copied_on_write_;
  return to->data();
}

// Holds the stripes of `part` that elements [begin, end) fall in, taken in
// increasing order; exclusively (to update) or shared (to read).
class VariableStore::StripeLock {
 public:
  StripeLock(const Part& part, int64_t begin, int64_t end, bool exclusive)
      : part_(part),
        first_(begin / kLockStripeElements),
        last_(end > begin ? (end - 1) / kLockStripeElements : first_ - 1),
        exclusive_(exclusive) {
    for (int64_t i = first_; i <= last_; ++i) {
      if (exclusive_) {
        part_.stripes[i].Lock();
      } else {
        part_.stripes[i].ReaderLock();
      }
    }
  }
  ~StripeLock() {
    for (int64_t i = last_; i >= first_; --i) {
      if (exclusive_) {
        part_.stripes[i].Unlock();
      } else {
        part_.stripes[i].ReaderUnlock();
      }
    }
  }
  StripeLock(const StripeLock&) = delete;
  StripeLock& operator=(const StripeLock&) = delete;

 private:
  const Part& part_;
  const int64_t first_, last_;
  const bool exclusive_;
};

std::string RangeEnd(int64_t offset, int64_t count) {
  int64_t end;
  if (!__builtin_add_overflow(offset, count, &end)) return absl::StrCat(end);
  // Only two values of one sign overflow; their magnitudes add up to at
  // most 2^64, which wraps to 0 in 64 bits.
  const bool negative = count < 0;
  const uint64_t magnitude =
      negative ? (0 - static_cast<uint64_t>(offset)) + (0 - static_cast<uint64_t>(count))
               : static_cast<uint64_t>(offset) + static_cast<uint64_t>(count);
  if (magnitude == 0) return "-18446744073709551616";
  return absl::StrCat(negative ? "-" : "", magnitude);
}

int64_t DefaultVariableBytes(int64_t memory_limit) {
  if (memory_limit <= 0) return 0;
  const int64_t room =
      std::min(std::max<int64_t>(memory_limit / 10, int64_t{64} << 20), memory_limit / 2);
  return memory_limit - room;
}

int64_t PartDefinition::num_elements() const {
  int64_t row = 1;
  for (size_t i = 1; i < variable_shape.size(); ++i) row *= variable_shape[i];
  return (row_end - row_begin) * row;
}

std::string PartDefinition::DebugString() const {
  return absl::StrFormat("%s %s rows [%d,%d) plan %016x", variable, ShapeString(variable_shape),
                         row_begin, row_end, plan_fingerprint);
}

bool PartDefinition::SameLayout(const PartDefinition& other) const {
  return variable == other.variable && variable_shape == other.variable_shape &&
         row_begin == other.row_begin && row_end == other.row_end;
}

absl::StatusOr<std::unique_ptr<VariableStore>> VariableStore::Create(
    const VariableStoreOptions& options) {
  if (options.num_shards < 1 || options.shard_index < 0 ||
      options.shard_index >= options.num_shards) {
    return absl::InvalidArgumentError(absl::StrCat("shard index ", options.shard_index,
                                                   " is outside 0..", options.num_shards - 1));
  }
  if (options.max_chunk_bytes < 4 || options.max_chunk_bytes > kMaxChunkBytesLimit) {
    // gRPC's message limits are 32-bit: the receive limit is a chunk plus
    // 1 MiB for names and framing.
    return absl::InvalidArgumentError(absl::StrCat("max_chunk_bytes (--max_chunk_bytes) is ",
                                                   options.max_chunk_bytes, "; expected 4 to ",
                                                   kMaxChunkBytesLimit, " (1 GiB)"));
  }
  if (options.max_variable_bytes < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_variable_bytes (--max_variable_bytes) is ", options.max_variable_bytes,
        "; expected -1 (no limit), 0 (the machine's or the cgroup's memory) or a byte count"));
  }
  if (options.request_id_retention < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id_retention is ", absl::FormatDuration(options.request_id_retention),
                     "; expected 0 or more"));
  }
  if (options.request_ledger_bytes < kMinRequestLedgerBytes) {
    // One id may take a quarter: below this, a push's first record (the id,
    // a part's progress, a range) would not fit, and every push would fail.
    return absl::InvalidArgumentError(
        absl::StrCat("request_ledger_bytes (--request_ledger_bytes) is ",
                     options.request_ledger_bytes, "; expected at least ", kMinRequestLedgerBytes));
  }
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                          Optimizer::Create(options.optimizer));
  std::unique_ptr<Optimizer> undecayed;
  if (options.optimizer.weight_decay != 0.0) {
    OptimizerOptions without = options.optimizer;
    without.weight_decay = 0.0;
    without.exclude_from_weight_decay.clear();
    PSFLOW_ASSIGN_OR_RETURN(undecayed, Optimizer::Create(without));
  }
  return std::unique_ptr<VariableStore>(
      new VariableStore(options, std::move(optimizer), std::move(undecayed)));
}

VariableStore::VariableStore(const VariableStoreOptions& options,
                             std::unique_ptr<Optimizer> optimizer,
                             std::unique_ptr<Optimizer> undecayed_optimizer)
    : options_(options),
      optimizer_(std::move(optimizer)),
      undecayed_optimizer_(std::move(undecayed_optimizer)),
      values_pool_(std::make_shared<ValuesPool>()),
      max_variable_bytes_(options.max_variable_bytes > 0 ? options.max_variable_bytes
                          : options.max_variable_bytes == 0
                              ? DefaultVariableBytes(MemoryLimitBytes())
                              : 0) {}

VariableStore::~VariableStore() = default;

std::unique_ptr<VariableStore::Part> VariableStore::NewPart(const PartDefinition& def) const {
  // The buffers first: if memory runs out, it does so before the part's
  // lock stripes are built.
  const int64_t n = def.num_elements();
  auto params = std::make_shared<FloatBuffer>(n);
  std::vector<FloatBuffer> slots;
  for (int i = 0; i < optimizer_->num_slots(); ++i) {
    slots.emplace_back(n, optimizer_->slot_initial_value(i));
  }
  auto part = std::make_unique<Part>(def);  // not shared yet: no lock needed
  // In place at once, so that the part's destructor frees what was made
  // if memory runs out halfway.
  part->params = std::make_unique<StripeValues[]>(static_cast<size_t>(part->num_stripes));
  for (int64_t i = 0; i < part->num_stripes; ++i) {
    const int64_t begin = i * kLockStripeElements;
    part->params[i].home = part->params[i].current =
        new SharedValues(params->data() + begin, std::min(kLockStripeElements, n - begin), params);
  }
  part->slots = std::move(slots);
  part->optimizer = undecayed_optimizer_ != nullptr && !optimizer_->DecaysVariable(def.variable)
                        ? undecayed_optimizer_.get()
                        : optimizer_.get();
  return part;
}

absl::StatusOr<VariableStore::Part*> VariableStore::FindPart(absl::string_view variable) const {
  absl::ReaderMutexLock lock(&parts_mu_);
  auto it = parts_.find(variable);
  if (it != parts_.end()) return it->second.get();
  // The first 8 names in order: views and a partial sort, as a shard may
  // hold hundreds of thousands (copying and sorting them all took 0.55 s
  // for 450,000, on every such request).
  std::vector<absl::string_view> names;
  names.reserve(parts_.size());
  for (const auto& [name, part] : parts_) names.push_back(name);
  const size_t shown = std::min<size_t>(names.size(), 8);
  std::partial_sort(names.begin(), names.begin() + shown, names.end());
  if (names.size() > shown) {
    names.resize(shown);
    names.push_back("...");
  }
  return absl::NotFoundError(absl::StrCat("variable '", variable, "' is not on ps shard ",
                                          options_.shard_index, " (it holds ",
                                          names.empty() ? "no variables: the chief has not "
                                                          "registered the model yet, or this "
                                                          "shard restarted and lost them, as "
                                                          "it keeps no checkpoint yet"
                                                        : absl::StrJoin(names, ", "),
                                          ")"));
}

absl::Status VariableStore::CheckSegment(const Part& part, int64_t offset, const void* data,
                                         int64_t count, bool check_values) const {
  if (count * 4 > options_.max_chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment of '", part.def.variable, "' carries ", count * 4,
        " bytes; this server accepts at most ", options_.max_chunk_bytes,
        " per segment (ps_server --max_chunk_bytes): send smaller segments (psflow's worker: "
        "--max_chunk_bytes no larger than the shards')"));
  }
  if (offset < 0 || count < 0 || count > part.num_elements - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment of '", part.def.variable, "' covers elements [", offset, ",",
        RangeEnd(offset, count),
        ") but its part on ps shard ", options_.shard_index, " has ", part.num_elements,
        " elements (", part.def.DebugString(), ")"));
  }
  if (check_values) {
    const int64_t bad = FirstNonFinite(data, count);
    if (bad >= 0) {
      float v;
      std::memcpy(&v, static_cast<const char*>(data) + 4 * bad, 4);
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient for '", part.def.variable, "' has a non-finite value (", v, ") at element ",
          offset + bad, " of its part; rejected (start ps_server with "
                        "--allow_non_finite_gradients to accept such values)"));
    }
  }
  return absl::OkStatus();
}

// ---- Registration ----

absl::StatusOr<std::unique_ptr<VariableStore::Registration>> VariableStore::BeginRegistration(
    uint64_t plan_fingerprint, int num_shards, int shard_index, std::vector<PartDefinition> parts) {
  if (num_shards != options_.num_shards || shard_index != options_.shard_index) {
    return absl::FailedPreconditionError(absl::StrCat(
        "registration is for shard ", shard_index, " of ", num_shards,
        ", but this server is shard ", options_.shard_index, " of ", options_.num_shards,
        " (check --ps_hosts / TF_CONFIG: every process must list the same ps tasks in the "
        "same order)"));
  }
  auto reg = std::unique_ptr<Registration>(new Registration(this));
  // First check every definition and find the new parts; nothing is
  // allocated before the whole header has passed.
  std::vector<const PartDefinition*> new_parts;
  // Bytes per element of a part: its parameter and the optimizer's slots.
  const int64_t element_bytes = 4 * (1 + optimizer_->num_slots());
  for (PartDefinition& def : parts) {
    def.plan_fingerprint = plan_fingerprint;
    PSFLOW_RETURN_IF_ERROR(ValidateDefinition(def));
    if (reg->pending_.contains(def.variable)) {
      return absl::InvalidArgumentError(
          absl::StrCat("variable '", def.variable, "' appears twice in one registration"));
    }
    bool exists = false;
    {
      absl::ReaderMutexLock lock(&parts_mu_);
      auto it = parts_.find(def.variable);
      if (it != parts_.end()) {
        const PartDefinition& have = it->second->def;
        if (!have.SameLayout(def) || have.plan_fingerprint != def.plan_fingerprint) {
          return absl::FailedPreconditionError(absl::StrCat(
              "variable '", def.variable, "' is registered on ps shard ", options_.shard_index,
              " as ", have.DebugString(), " but this registration has ", def.DebugString(),
              "; every worker must build the same model and plan (a shard keeps its variables "
              "until "
              "it restarts: to train another model, restart the ps shards)"));
        }
        exists = true;
      }
    }
    reg->pending_.emplace(def.variable, Registration::Pending{});
    if (exists) continue;
    new_parts.push_back(&def);
  }
  if (max_variable_bytes_ > 0 && !new_parts.empty()) {
    absl::MutexLock lock(&parts_mu_);
    // Another registration may have committed some of these parts since
    // they were looked up: those are now held (and counted in `held`), and
    // Commit keeps them, so they must not be counted again here. (Counted
    // twice, a model of more than half the limit was refused for good.) A
    // part registered meanwhile with another layout stays, for Commit to
    // refuse.
    std::erase_if(new_parts, [&](const PartDefinition* def) {
      auto it = parts_.find(def->variable);
      return it != parts_.end() && it->second->def.SameLayout(*def) &&
             it->second->def.plan_fingerprint == def->plan_fingerprint;
    });
    // ValidateDefinition bounds a part by 2^56 elements, so none of this
    // overflows until a header lists thousands of such parts.
    // Each part also costs its record, name, locks and allocations: counted,
    // so that a model of many tiny parts cannot pass the limit (450,000
    // one-element parts took 850 bytes each, where 12 were counted), and
    // long names and shapes count their bytes (PartOverheadBytes).
    int64_t new_bytes = 0;
    for (const PartDefinition* def : new_parts) {
      if (__builtin_add_overflow(new_bytes,
                                 def->num_elements() * element_bytes + PartOverheadBytes(*def),
                                 &new_bytes)) {
        new_bytes = INT64_MAX;
      }
    }
    const int64_t held = parameter_bytes_.load() / 4 * element_bytes + part_overhead_bytes_;
    const int64_t room = max_variable_bytes_ - std::min(held, max_variable_bytes_);
    const int64_t unreserved = room - std::min(reserved_bytes_, room);
    if (new_bytes > unreserved) {
      const PartDefinition& largest = **std::max_element(
          new_parts.begin(), new_parts.end(), [](const PartDefinition* a, const PartDefinition* b) {
            return a->num_elements() < b->num_elements();
          });
      const std::string what = absl::StrCat(
          "registering ", new_parts.size(), " new part(s) (the largest ", largest.DebugString(),
          ") needs ", new_bytes, " bytes of parameters and optimizer slots (", element_bytes,
          " per element with ", optimizer_->DebugString(), ", and ", kPartBytes,
          " per part, more for names and shapes over 128 bytes) on ps shard ", options_.shard_index,
          ", which holds ", held, " and may hold at most ", max_variable_bytes_,
          " (--max_variable_bytes; by default the machine's memory or its cgroup's limit)");
      if (new_bytes > room) {
        return absl::ResourceExhaustedError(absl::StrCat(
            what, "; nothing was registered. Use more ps shards, or check the model's shapes"));
      }
      // It would fit but for registrations in progress. Most often another
      // worker registering the same model: a retry (UNAVAILABLE is retried
      // by clients) finds its parts registered and keeps them.
      return absl::UnavailableError(absl::StrCat(
          what, ", but registrations in progress have ", reserved_bytes_,
          " bytes of it reserved; nothing was registered, try again once they have finished"));
    }
    reserved_bytes_ += new_bytes;
    reg->reserved_ = new_bytes;
  }
  for (const PartDefinition* def : new_parts) {
    // Allocated outside the table lock. The limit above stops what no
    // machine of this size could hold; an allocation can still fail (when
    // the limit is off, or the address space runs out), and that must not
    // end the call with gRPC's uninformative UNKNOWN.
    try {
      reg->pending_[def->variable].part = NewPart(*def);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "ps shard ", options_.shard_index, " could not allocate ",
          def->num_elements() * element_bytes, " bytes for ", def->DebugString(),
          "; nothing was registered"));
    }
  }
  return reg;
}

VariableStore::Registration::~Registration() {
  if (reserved_ > 0) {
    absl::MutexLock lock(&store_->parts_mu_);
    store_->reserved_bytes_ -= reserved_;
  }
}

absl::Status VariableStore::Registration::AddValues(absl::string_view variable, int64_t offset,
                                                    const void* data, int64_t count) {
  auto it = pending_.find(variable);
  if (it == pending_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "initial values for '", variable, "' arrived, but the registration header has no part "
        "of that variable"));
  }
  Pending& p = it->second;
  if (p.part == nullptr) return absl::OkStatus();  // kept part: its values stay
  Part& part = *p.part;
  PSFLOW_RETURN_IF_ERROR(store_->CheckSegment(part, offset, data, count, false));
  if (offset != p.received) {
    return absl::InvalidArgumentError(absl::StrCat("initial values of '", variable,
                                                   "' must arrive in order: expected offset ",
                                                   p.received, ", got ", offset));
  }
  // The part is this registration's own until Commit: no lock needed.
  ForEachStripe(offset, offset + count, [&](int64_t stripe, int64_t at, int64_t n) {
    std::memcpy(part.params[stripe].current->data() + (at - stripe * kLockStripeElements),
                static_cast<const char*>(data) + 4 * (at - offset), n * 4);
  });
  p.received += count;
  return absl::OkStatus();
}

absl::StatusOr<RegisterResult> VariableStore::Registration::Commit() {
  RegisterResult result;
  for (const auto& [name, p] : pending_) {
    if (p.part != nullptr && p.received != p.part->num_elements) {
      return absl::InvalidArgumentError(absl::StrCat(
          "registration of '", name, "' ended after ", p.received, " of ", p.part->num_elements,
          " initial values; nothing was registered"));
    }
  }
  absl::MutexLock lock(&store_->parts_mu_);
  // Every conflict first, so that a refused registration adds nothing.
  for (const auto& [name, p] : pending_) {
    auto it = store_->parts_.find(name);
    if (it == store_->parts_.end() || p.part == nullptr) continue;
    // Registered meanwhile by another registration.
    const PartDefinition& have = it->second->def;
    const PartDefinition& want = p.part->def;
    if (!have.SameLayout(want) || have.plan_fingerprint != want.plan_fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "variable '", name, "' was registered concurrently as ", have.DebugString(),
          " which differs from ", want.DebugString(), "; nothing was registered"));
    }
  }
  for (auto& [name, p] : pending_) {
    if (store_->parts_.contains(name)) {  // kept, or registered meanwhile alike
      ++result.parts_kept;
      continue;
    }
    if (p.part == nullptr) continue;
    store_->parameter_bytes_ += p.part->num_elements * 4;
    store_->part_overhead_bytes_ += PartOverheadBytes(p.part->def);
    p.part->index = static_cast<int64_t>(store_->parts_.size());
    store_->plan_fingerprint_ = p.part->def.plan_fingerprint;
    store_->parts_.emplace(name, std::move(p.part));
    ++result.parts_created;
  }
  pending_.clear();
  store_->reserved_bytes_ -= reserved_;  // now held, or kept from another registration
  reserved_ = 0;
  return result;
}

// ---- Push ----

std::shared_ptr<VariableStore::LedgerEntry> VariableStore::LedgerFor(uint64_t request_id) {
  const auto now = std::chrono::steady_clock::now();
  if (request_id == 0) {  // no retry protection asked: a record of its own, never counted
    auto entry = std::make_shared<LedgerEntry>(now);
    absl::MutexLock entry_lock(&entry->mu);
    entry->evicted = true;
    return entry;
  }
  std::shared_ptr<LedgerEntry> entry;
  int64_t forgotten_early = 0;
  {
    absl::MutexLock lock(&ledger_mu_);
    auto [it, inserted] = ledger_.try_emplace(request_id);
    if (!inserted) return it->second;
    entry = std::make_shared<LedgerEntry>(now);
    {
      absl::MutexLock entry_lock(&entry->mu);
      entry->bytes = kLedgerIdBytes;
    }
    ledger_bytes_ += kLedgerIdBytes;
    it->second = entry;
    ledger_order_.push_back(request_id);
    forgotten_early = TrimLedgerLocked(now);
  }
  ReportForgottenEarly(forgotten_early);
  return entry;
}

void VariableStore::TrimLedger() {
  int64_t forgotten_early = 0;
  {
    absl::MutexLock lock(&ledger_mu_);
    forgotten_early = TrimLedgerLocked(std::chrono::steady_clock::now());
  }
  ReportForgottenEarly(forgotten_early);
}

int64_t VariableStore::TrimLedgerLocked(std::chrono::steady_clock::time_point now) {
  // Forget the ids past their retention, oldest first, and beyond the byte
  // bound the oldest ones early. Never an id whose sessions are still
  // applying (a retry of it, or a late stream of the same push, would find
  // no record and apply twice): it is passed over and stays where it is in
  // the queue. (A session holds its id's record from its first segment
  // that passed the checks; one that has applied none yet does not.) Each
  // id is looked at once at most, and the newest is always kept.
  int64_t forgotten_early = 0;
  absl::InlinedVector<uint64_t, 4> in_use;  // passed over, oldest first
  for (size_t older = ledger_order_.size() - 1; older > 0 && !ledger_order_.empty(); --older) {
    auto old = ledger_.find(ledger_order_.front());
    const bool expired =
        absl::FromChrono(now - old->second->created) >= options_.request_id_retention;
    const bool too_big = ledger_bytes_.load() > options_.request_ledger_bytes;
    if (!expired && !too_big) break;
    ledger_order_.pop_front();
    if (old->second.use_count() > 1) {
      in_use.push_back(old->first);
      continue;
    }
    if (!expired) ++forgotten_early;
    {
      absl::MutexLock entry_lock(&old->second->mu);
      old->second->evicted = true;
      ledger_bytes_ -= old->second->bytes;
    }
    ledger_.erase(old);
  }
  for (auto it = in_use.rbegin(); it != in_use.rend(); ++it) ledger_order_.push_front(*it);
  return forgotten_early;
}

void VariableStore::ReportForgottenEarly(int64_t forgotten) {
  if (forgotten == 0) return;
  const int64_t before = ledger_forgotten_early_.fetch_add(forgotten);
  // Said at the first, then each time the count doubles: a retry of such an
  // id is applied twice, which the operator should hear of.
  if (before != 0 && std::bit_width(static_cast<uint64_t>(before)) ==
                         std::bit_width(static_cast<uint64_t>(before + forgotten))) {
    return;
  }
  const std::string line = absl::StrCat(
      "ps_server: shard ", options_.shard_index, " forgot ", before + forgotten,
      " push request id(s) before their ", absl::FormatDuration(options_.request_id_retention),
      " retention, to keep the exactly-once records under ", options_.request_ledger_bytes,
      " bytes; a retry of one of those pushes is applied twice. Raise --request_ledger_bytes, "
      "or lower --request_id_retention_s on the shards and the workers\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

std::unique_ptr<VariableStore::PushSession> VariableStore::BeginPush(const PushHeaderInfo& header) {
  if (header.gradient_checked) ++pushes_checked_by_client_;
  const bool scan = !options_.allow_non_finite_gradients && !header.gradient_checked;
  return std::unique_ptr<PushSession>(new PushSession(this, header.request_id, scan));
}

VariableStore::PushSession::~PushSession() = default;

VariableStore::LedgerEntry& VariableStore::PushSession::Entry() {
  absl::call_once(entry_once_, [this] { entry_ = store_->LedgerFor(request_id_); });
  return *entry_;
}

void VariableStore::PushSession::Account(int64_t delta) {
  entry_->bytes += delta;
  if (!entry_->evicted) store_->ledger_bytes_ += delta;
}

absl::StatusOr<VariableStore::Part*> VariableStore::PushSession::Find(absl::string_view variable) {
  {
    absl::MutexLock lock(&cache_mu_);
    auto it = cache_.find(variable);
    if (it != cache_.end()) return it->second;
  }
  PSFLOW_ASSIGN_OR_RETURN(Part * part, store_->FindPart(variable));
  absl::MutexLock lock(&cache_mu_);
  cache_.emplace(std::string(variable), part);
  return part;
}

absl::Status VariableStore::PushSession::Validate(absl::string_view variable, int64_t offset,
                                                  const void* data, int64_t count) {
  PSFLOW_ASSIGN_OR_RETURN(Part * part, Find(variable));
  return store_->CheckSegment(*part, offset, data, count, scan_values_);
}

absl::Status VariableStore::PushSession::ValidateRange(absl::string_view variable,
                                                       int64_t offset, int64_t count) {
  PSFLOW_ASSIGN_OR_RETURN(Part * part, Find(variable));
  return store_->CheckSegment(*part, offset, nullptr, count, false);
}

absl::Status VariableStore::PushSession::Apply(absl::string_view variable, int64_t offset,
                                               const void* data, int64_t count,
                                               bool values_checked, void* read_back,
                                               int64_t* version) {
  PSFLOW_ASSIGN_OR_RETURN(Part * part, Find(variable));
  PSFLOW_RETURN_IF_ERROR(
      store_->CheckSegment(*part, offset, data, count, !values_checked && scan_values_));
  if (count == 0) {
    if (version != nullptr) *version = part->version.load();
    return absl::OkStatus();
  }
  // Claim the elements of [offset, offset + count) that this request id has
  // not applied yet, after any other session of the id has finished with
  // overlapping ones; then update them outside the entry's lock.
  Entry();
  FewRanges todo;
  LedgerEntry::Progress* progress = nullptr;
  bool created_progress = false;  // by this segment
  {
    absl::MutexLock entry_lock(&entry_->mu);
    // Looked up on every evaluation: a Progress is dropped once its part is
    // complete.
    struct Claim {
      LedgerEntry* entry;
      const Part* part;
      int64_t begin, end;
    } claim{entry_.get(), part, offset, offset + count};
    entry_->mu.Await(absl::Condition(
        +[](Claim* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {  // entry->mu is held
          auto it = c->entry->progress.find(c->part);
          return it == c->entry->progress.end() ||
                 !OverlapsAny(it->second.in_flight, c->begin, c->end);
        },
        &claim));
    if (entry_->lost) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "push: ps shard ", store_->options_.shard_index,
          " lost its record of what this request id applied (it ran out of memory while "
          "recording it), so it applies nothing more under this id and nothing twice; the "
          "push may be partly applied"));
    }
    if (!TestBit(entry_->complete, part->index)) {
      auto found = entry_->progress.find(part);
      const bool known = found != entry_->progress.end();
      if (known) {
        todo = Uncovered(found->second.done, offset, offset + count);
      } else {
        todo.emplace_back(offset, offset + count);
      }
      // One id's record may take a quarter of the ledger's bytes: a push
      // that leaves more gaps than that is refused before this segment is
      // applied (and before its part's record is made), so no client grows
      // one record without end. Once applied, the segment merges with every
      // range it touches, so only one that touches none adds a range.
      const int64_t most = store_->options_.request_ledger_bytes / 4;
      const int64_t grown = entry_->bytes + (known ? 0 : kProgressBytes) + kRangeBytes;
      if (!todo.empty() && !(known && Touches(found->second.done, offset, offset + count)) &&
          grown > most) {
        return absl::ResourceExhaustedError(
            absl::StrCat("push: the segments of this request id leave more gaps in '", variable,
                         "' and its other parts than ps shard ", store_->options_.shard_index,
                         " keeps track of for one id (its record has reached ", entry_->bytes,
                         " of at most ", most, " bytes, ", kRangeBytes,
                         " a gap); send each part's elements in fewer, larger segments"));
      }
      if (!known) {
        found = entry_->progress.try_emplace(part).first;
        Account(kProgressBytes);
        created_progress = true;
      }
      progress = &found->second;
      // The whole segment, one entry however many pieces of it are new.
      if (!todo.empty()) progress->in_flight.emplace_back(offset, offset + count);
    }
  }
  int64_t applied = 0;
  if (todo.empty()) {
    if (read_back != nullptr) {
      StripeLock lock(*part, offset, offset + count, /*exclusive=*/false);
      part->CopyValues(offset, count, read_back);
      if (version != nullptr) *version = part->version.load();
    }
  } else {
    // Only this segment's stripes: other messages of the push (other
    // ranges of the part) are applied beside it.
    StripeLock lock(*part, offset, offset + count, /*exclusive=*/true);
    // Every stripe ready to be written before any is: a copy that finds no
    // memory then leaves the segment unapplied and the server up.
    bool out_of_memory = false;
    try {
      for (const auto& [begin, end] : todo) {
        ForEachStripe(begin, end, [&](int64_t stripe, int64_t, int64_t) {
          store_->WritableValues(*part, stripe);
        });
      }
    } catch (const std::bad_alloc&) {
      out_of_memory = true;
    }
    int64_t step = 0;
    {
      absl::MutexLock entry_lock(&entry_->mu);
      if (out_of_memory) {
        progress->in_flight.erase(std::find(progress->in_flight.begin(), progress->in_flight.end(),
                                            std::make_pair(offset, offset + count)));
        // The part's record goes again if this segment made it and no other
        // has used it since.
        if (created_progress && progress->done.empty() && progress->in_flight.empty() &&
            progress->step == 0) {
          entry_->progress.erase(part);
          Account(-kProgressBytes);
        }
        return absl::ResourceExhaustedError(absl::StrCat(
            "push: ps shard ", store_->options_.shard_index, " has no memory for a copy of '",
            variable, "' that a pull still holds; nothing of elements [", offset, ",",
            offset + count, ") was applied"));
      }
      // The part's step for this push, taken by its first segment that is
      // sure to be applied: a segment refused above leaves the version (and
      // so Adam's bias correction) as it was.
      if (progress->step == 0) progress->step = ++part->version;
      step = progress->step;
    }
    for (const auto& [begin, end] : todo) {
      float* slots[4];
      for (size_t i = 0; i < part->slots.size(); ++i) slots[i] = part->slots[i].data() + begin;
      // The kernels read the gradient at any alignment.
      const char* grad = static_cast<const char*>(data) + 4 * (begin - offset);
      // Stripe by stripe. The pass above made each writable, so this call
      // allocates nothing: it returns the stripe's values, or takes them
      // home if the last pull of home let go meanwhile.
      ForEachStripe(begin, end, [&](int64_t stripe, int64_t at, int64_t n) {
        float* params = store_->WritableValues(*part, stripe) + (at - stripe * kLockStripeElements);
        part->optimizer->Apply(step, params, slots, grad, n);
        for (size_t i = 0; i < part->slots.size(); ++i) slots[i] += n;
        grad += 4 * n;
      });
      applied += end - begin;
    }
    if (read_back != nullptr) {  // the values are in cache now: the copy is cheap
      part->CopyValues(offset, count, read_back);
      if (version != nullptr) *version = part->version.load();
    }
  }
  if (!todo.empty()) {
    absl::MutexLock entry_lock(&entry_->mu);
    progress->in_flight.erase(std::find(progress->in_flight.begin(), progress->in_flight.end(),
                                        std::make_pair(offset, offset + count)));
    // The segment is applied: should recording it fail to allocate (a
    // B-tree node, the bits), the id is marked lost, and a retry of it is
    // refused instead of applied again.
    try {
      const int64_t ranges_before = static_cast<int64_t>(progress->done.size());
      for (const auto& range : todo) AddRange(&progress->done, range.first, range.second);
      const int64_t ranges = static_cast<int64_t>(progress->done.size());
      int64_t delta = (ranges - ranges_before) * kRangeBytes;
      if (progress->in_flight.empty() && ranges == 1 && progress->done.begin()->first == 0 &&
          progress->done.begin()->second == part->num_elements) {
        // Every element applied: a bit instead of the Progress (the bit
        // first, so that the Progress goes only once the bit is set).
        delta += SetBit(&entry_->complete, part->index);
        delta -= kProgressBytes + ranges * kRangeBytes;
        entry_->progress.erase(part);
        // An emptied hash map keeps its table: give it back, as most ids end
        // here and are then remembered for minutes.
        if (entry_->progress.empty()) entry_->progress = {};
      }
      Account(delta);
    } catch (const std::bad_alloc&) {
      entry_->lost = true;
      return absl::ResourceExhaustedError(absl::StrCat(
          "push: ps shard ", store_->options_.shard_index, " applied a segment of '", variable,
          "' but ran out of memory recording it; it applies nothing more under this request "
          "id, so that nothing is applied twice"));
    }
  }
  // A record that grew may take the ledger past its bound even though no new
  // id came: forget others now (never this one, which is in use).
  if (!todo.empty() && store_->ledger_bytes_.load() > store_->options_.request_ledger_bytes) {
    store_->TrimLedger();
  }
  applied_ += applied;
  skipped_ += count - applied;
  store_->elements_applied_ += applied;
  store_->duplicate_elements_ += count - applied;
  return absl::OkStatus();
}

void VariableStore::PushSession::Finish(const absl::Status& status) {
  if (status.ok()) {
    ++store_->pushes_;
  } else {
    ++store_->rejected_requests_;
  }
}

// ---- Reads ----

absl::StatusOr<VariableStore::Part*> VariableStore::FindRange(absl::string_view variable,
                                                              int64_t offset, int64_t count,
                                                              const char* what) const {
  PSFLOW_ASSIGN_OR_RETURN(Part * part, FindPart(variable));
  if (offset < 0 || count < 0 || count > part->num_elements - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of '", variable, "' covers elements [", offset, ",",
                     RangeEnd(offset, count), ") but its part on ps shard ", options_.shard_index,
                     " has ", part->num_elements, " elements"));
  }
  return part;
}

absl::StatusOr<int64_t> VariableStore::Read(absl::string_view variable, int64_t offset,
                                            int64_t count, void* out) const {
  PSFLOW_ASSIGN_OR_RETURN(Part * part, FindRange(variable, offset, count, "read"));
  StripeLock lock(*part, offset, offset + count, /*exclusive=*/false);
  part->CopyValues(offset, count, out);
  return part->version.load();
}

absl::StatusOr<int64_t> VariableStore::Pin(absl::string_view variable, int64_t offset,
                                           int64_t count, std::vector<PinnedValues>* out) const {
  PSFLOW_ASSIGN_OR_RETURN(Part * part, FindRange(variable, offset, count, "pin"));
  // Room first: no allocation may fail between a Ref and its record.
  out->reserve(out->size() + static_cast<size_t>(count / kLockStripeElements + 2));
  StripeLock lock(*part, offset, offset + count, /*exclusive=*/false);
  ForEachStripe(offset, offset + count, [&](int64_t stripe, int64_t at, int64_t n) {
    SharedValues* values = part->params[stripe].current;
    values->Ref();
    out->push_back({values->data() + (at - stripe * kLockStripeElements), n * 4, values});
  });
  return part->version.load();
}

std::vector<PartSnapshot> VariableStore::ListParts() const {
  int64_t total, remaining;
  return ListParts("", std::numeric_limits<size_t>::max(), &total, &remaining);
}

std::vector<PartSnapshot> VariableStore::ListParts(absl::string_view after, size_t limit,
                                                   int64_t* total, int64_t* remaining) const {
  absl::ReaderMutexLock lock(&parts_mu_);
  std::vector<const Part*> later;
  later.reserve(parts_.size());
  for (const auto& [name, part] : parts_) {
    if (absl::string_view(name) > after) later.push_back(part.get());
  }
  const size_t shown = std::min(limit, later.size());
  std::partial_sort(later.begin(), later.begin() + shown, later.end(),
                    [](const Part* a, const Part* b) { return a->def.variable < b->def.variable; });
  std::vector<PartSnapshot> out;
  out.reserve(shown);
  for (size_t i = 0; i < shown; ++i) {
    out.push_back({later[i]->def, later[i]->num_elements, later[i]->version.load()});
  }
  *total = static_cast<int64_t>(parts_.size());
  *remaining = static_cast<int64_t>(later.size());
  return out;
}

absl::StatusOr<PartSnapshot> VariableStore::GetPart(absl::string_view variable) const {
  PSFLOW_ASSIGN_OR_RETURN(Part * part, FindPart(variable));
  return PartSnapshot{part->def, part->num_elements, part->version.load()};
}

absl::Status VariableStore::CheckRange(absl::string_view variable, int64_t offset, int64_t count,
                                       const char* what) const {
  return FindRange(variable, offset, count, what).status();
}

absl::StatusOr<int64_t> VariableStore::PartElements(absl::string_view variable) const {
  PSFLOW_ASSIGN_OR_RETURN(Part * part, FindPart(variable));
  return part->num_elements;
}

uint64_t VariableStore::plan_fingerprint() const {
  absl::ReaderMutexLock lock(&parts_mu_);
  return plan_fingerprint_;
}

StoreStats VariableStore::stats() const {
  StoreStats s;
  s.pushes = pushes_;
  s.elements_applied = elements_applied_;
  s.duplicate_elements = duplicate_elements_;
  s.rejected_requests = rejected_requests_;
  s.parameter_bytes = parameter_bytes_;
  {
    absl::MutexLock lock(&ledger_mu_);
    s.ledger_ids = static_cast<int64_t>(ledger_order_.size());
  }
  s.ledger_bytes = ledger_bytes_;
  s.ledger_ids_forgotten_early = ledger_forgotten_early_;
  s.stripes_copied_on_write = stripes_copied_on_write_;
  s.pushes_checked_by_client = pushes_checked_by_client_;
  return s;
}

}  // namespace psflow::server
