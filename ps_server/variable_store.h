// VariableStore: one PS shard's parts (parameters, optimizer slots, step
// count and version) and the rules for registering, pulling and pushing them.
// It knows nothing of RPC; grpc_ps_service.cc adapts it to the wire.
//
// Thread-safe. A part's values are locked per stripe of elements, so pushes
// to different parts, and to different element ranges of one part (the
// messages of one push, applied in parallel), run in parallel; the part
// table has a reader-writer lock taken only to find a part or to add new
// ones. A pull may pin a stripe's parameters instead of copying them (Pin):
// a push to a pinned stripe then writes a copy (copy on write), so the
// pinned values stay as they were read until the pull lets go of them.
#ifndef PSFLOW_PS_SERVER_VARIABLE_STORE_H_
#define PSFLOW_PS_SERVER_VARIABLE_STORE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/float_buffer.h"
#include "ps_server/optimizer.h"

namespace psflow::server {

// The least VariableStoreOptions::request_ledger_bytes.
inline constexpr int64_t kMinRequestLedgerBytes = 64 << 10;
// The most VariableStoreOptions::max_chunk_bytes: gRPC's message limits are
// 32-bit, and the server's takes a chunk plus names and framing.
inline constexpr int64_t kMaxChunkBytesLimit = int64_t{1} << 30;

struct VariableStoreOptions {
  int shard_index = 0;
  int num_shards = 1;
  OptimizerOptions optimizer;             // Adam with Keras defaults
  bool allow_non_finite_gradients = false;  // NaN/Inf gradients are rejected by default
  // Largest segment (bytes of float data) accepted in one message: 4 to
  // kMaxChunkBytesLimit.
  int64_t max_chunk_bytes = 4 << 20;
  // How long a push request id is remembered for exactly-once retries (at
  // least that long, counted from its first call, unless the byte bound
  // below forces it out sooner), and about the most bytes the remembered
  // records may take. A finished push costs about 230 bytes plus a bit per
  // part; a push that left gaps in a part (sparse segments, a broken
  // stream) keeps its ranges until it is complete. A retry of a forgotten id
  // is applied as a new push, so the retention must outlast the clients'
  // retries: the worker starts none later than its --request_id_retention_s
  // less its --rpc_timeout_s after the push began. Ids are forgotten by age,
  // not by count, so that a busy shard does not forget the id of a push
  // whose reply was lost while its client waits out the deadline. An id
  // whose sessions are still applying is never forgotten.
  absl::Duration request_id_retention = absl::Minutes(15);
  int64_t request_ledger_bytes = 32 << 20;  // at least kMinRequestLedgerBytes
  // The most bytes of parameters and optimizer slots this shard holds. A
  // registration whose new parts would take it beyond that is refused with
  // RESOURCE_EXHAUSTED before anything is allocated (a malformed or mistaken
  // shape must not make the server allocate, or touch, more than the
  // machine has). 0: DefaultVariableBytes(MemoryLimitBytes()) (the machine's
  // RAM, or the limit of the process's cgroup where that is lower, less
  // room for the rest of the process); negative: no limit.
  int64_t max_variable_bytes = 0;
};

// The default bound on a shard's parameters and slots for a process that
// may use `memory_limit` bytes (0: unknown, no bound): that less room for
// what is not a variable (gRPC's buffers, the message pool, the ledger,
// the allocator's slack), a tenth of it but at least 64 MiB and at most half.
int64_t DefaultVariableBytes(int64_t memory_limit);

// offset + count in decimal for error messages, exact even where hostile
// input makes it overflow 64 bits.
std::string RangeEnd(int64_t offset, int64_t count);

// Where a part sits in its variable: rows [row_begin, row_end) of dimension 0.
struct PartDefinition {
  std::string variable;
  std::vector<int64_t> variable_shape;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  uint64_t plan_fingerprint = 0;

  int64_t num_elements() const;
  std::string DebugString() const;  // "dense/kernel [21632,128] rows [0,10816)"
  bool SameLayout(const PartDefinition& other) const;  // all but the fingerprint
};

struct PartSnapshot {
  PartDefinition def;
  int64_t num_elements = 0;
  int64_t version = 0;
};

struct StoreStats {
  int64_t pushes = 0;              // push sessions finished without error
  int64_t elements_applied = 0;
  int64_t duplicate_elements = 0;  // skipped on a retried request id
  int64_t rejected_requests = 0;
  int64_t parameter_bytes = 0;
  int64_t ledger_ids = 0;    // push request ids remembered
  int64_t ledger_bytes = 0;  // about what their records take
  // Ids forgotten before request_id_retention because the records passed
  // request_ledger_bytes: a retry of one of those would apply twice.
  int64_t ledger_ids_forgotten_early = 0;
  // Stripe copies made by pushes because of pulls: a stripe copied before
  // an update because a pull still held its values (Pin), and the copy
  // back to its home in the part's buffer once no pull holds that.
  int64_t stripes_copied_on_write = 0;
  // Pushes whose client said it had checked the gradient for NaN/Inf
  // (PushHeaderInfo::gradient_checked), so the store did not scan it.
  int64_t pushes_checked_by_client = 0;
};

struct RegisterResult {
  int parts_created = 0;
  int parts_kept = 0;
};

struct PushHeaderInfo {
  int32_t worker_id = 0;
  int64_t step = 0;
  int64_t read_version = 0;
  uint64_t request_id = 0;
  // The client found the whole gradient finite: no NaN/Inf scan here.
  bool gradient_checked = false;
};

class SharedValues;
class ValuesPool;

// Parameter values held as they were read (VariableStore::Pin): `bytes`
// bytes of float32 at `data`, unchanged until VariableStore::Unpin(pin).
struct PinnedValues {
  const void* data = nullptr;
  int64_t bytes = 0;
  void* pin = nullptr;
};

class VariableStore {
 public:
  // What a part costs beside its elements, counted against
  // max_variable_bytes: its record (definition, name, lock stripes), its
  // entry in the table and the allocations of its buffers. A little more
  // than the 850 bytes measured per one-element part with Adam.
  static constexpr int64_t kPartBytes = 1024;
  // Elements per lock stripe of a part (256 KiB of parameters): a 1 MiB push
  // message covers 4-5 stripes, the seed model's big kernel 43.
  static constexpr int64_t kLockStripeElements = int64_t{1} << 16;
  // The longest variable name a registration may use (TensorFlow's are tens
  // of bytes): every answer that names variables (GetStatus pages, errors)
  // stays within gRPC's default limits.
  static constexpr size_t kMaxVariableNameBytes = 64 << 10;
  // The most dimensions a variable may have, TensorFlow's own limit
  // (TensorShape::MaxDimensions()): a part's record keeps its shape, and
  // GetStatus pages and empty pulls copy it.
  static constexpr size_t kMaxRank = 254;
  // Checks one part's definition on its own (its name, shape and rows), as
  // a registration does first. The RPC layer also checks each part as it
  // reads a registration header, so that a header of malformed parts is
  // refused at the first instead of being held whole in memory.
  static absl::Status ValidateDefinition(const PartDefinition& def);
  // What a part counts against max_variable_bytes beside its elements:
  // kPartBytes, and its name (held twice: the table's key and the record)
  // and shape byte for byte beyond the first 128 bytes of them (which
  // kPartBytes covers).
  static int64_t PartOverheadBytes(const PartDefinition& def);

 private:
  // A lock stripe's parameters: `home`, its place in the part's one
  // buffer, and `current`, where its values are now (home, or a buffer of
  // its own while home is still pinned by a pull; see WritableValues).
  struct StripeValues {
    SharedValues* home = nullptr;
    SharedValues* current = nullptr;
  };
  struct Part {
    explicit Part(PartDefinition d)
        : def(std::move(d)),
          num_elements(def.num_elements()),
          num_stripes((num_elements + kLockStripeElements - 1) / kLockStripeElements),
          stripes(new absl::Mutex[static_cast<size_t>(num_stripes)]) {}
    ~Part();
    // Copies the current values of elements [offset, offset + count) to
    // `out` (4 * count bytes, any alignment); their stripes held.
    void CopyValues(int64_t offset, int64_t count, void* out) const;
    const PartDefinition def;
    const int64_t num_elements;
    const int64_t num_stripes;
    // stripes[i] guards elements [i * kLockStripeElements, (i + 1) *
    // kLockStripeElements) of `params` and of every slot. Whoever holds several
    // takes them in increasing order (StripeLock), so no two holders
    // deadlock. (Not expressible in thread annotations.)
    const std::unique_ptr<absl::Mutex[]> stripes;
    std::unique_ptr<StripeValues[]> params;  // one per stripe
    std::vector<FloatBuffer> slots;
    // The store's optimizer, or its copy without weight decay for a
    // variable excluded from it (set before the part is visible).
    const Optimizer* optimizer = nullptr;
    // Dense, in the order parts were added (set before the part is
    // visible; never changes): its bit in a LedgerEntry's `complete`.
    int64_t index = 0;
    // Pushes begun on this part; also the optimizer's step count for it. An
    // atomic, so that a push takes its step without waiting for a stripe
    // (which another push may hold while its optimizer runs).
    std::atomic<int64_t> version{0};
  };

  // Half-open element ranges [first, second).
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  // Disjoint half-open ranges by their begin: begin -> end. A tree, so that
  // a push of many small segments (a client may send hundreds of thousands
  // in one message, in any order) costs a logarithm per segment, not a scan.
  using RangeMap = absl::btree_map<int64_t, int64_t>;

  // What one request id has applied: per part, the step it was given, the
  // elements already updated and those being updated right now. A push may
  // arrive over several streams at once (each a PushSession with the same
  // request id), so a part's segments can come in any order and in parallel;
  // the entry's lock is not held while the optimizer runs.
  struct LedgerEntry {
    explicit LedgerEntry(std::chrono::steady_clock::time_point first_seen) : created(first_seen) {}
    struct Progress {
      int64_t step = 0;
      RangeMap done;     // adjacent ones merged
      Ranges in_flight;  // one entry per session applying now, in no order; disjoint
    };
    absl::Mutex mu;
    // Parts this id has begun but not finished. node_hash_map: a session
    // applying keeps a pointer to its Progress (the Progress is kept while
    // its in_flight is not empty).
    absl::node_hash_map<const Part*, Progress> progress ABSL_GUARDED_BY(mu);
    // Parts whose every element this id has applied, a bit per Part::index
    // instead of a Progress: a model of many variables pushed under
    // thousands of remembered ids costs the ledger bits, not tree nodes.
    std::vector<uint64_t> complete ABSL_GUARDED_BY(mu);
    int64_t bytes ABSL_GUARDED_BY(mu) = 0;     // about what the above and the id take
    bool evicted ABSL_GUARDED_BY(mu) = false;  // no longer counted in ledger_bytes_
    // Set when recording what a segment applied failed (an allocation):
    // what this id applied is no longer known, so nothing more is applied
    // under it, and a retry cannot apply anything twice.
    bool lost ABSL_GUARDED_BY(mu) = false;
    // The id's first call, on a clock that no time adjustment moves.
    const std::chrono::steady_clock::time_point created;
  };

 public:
  static absl::StatusOr<std::unique_ptr<VariableStore>> Create(const VariableStoreOptions& options);
  ~VariableStore();

  const VariableStoreOptions& options() const { return options_; }
  const Optimizer& optimizer() const { return *optimizer_; }

  // One RegisterVariables call. New parts are filled by AddValues and become
  // visible together at Commit, only if every element arrived; parts already
  // present with the same layout and fingerprint are kept untouched. Not
  // thread-safe; destroying it without Commit drops the new parts.
  class Registration {
   public:
    ~Registration();
    // `data` holds `count` float32 values for elements [offset, offset+count)
    // of `variable`'s part. Values for kept parts are ignored.
    absl::Status AddValues(absl::string_view variable, int64_t offset, const void* data,
                           int64_t count);
    absl::StatusOr<RegisterResult> Commit();

   private:
    friend class VariableStore;
    explicit Registration(VariableStore* store) : store_(store) {}
    VariableStore* store_;
    int64_t reserved_ = 0;  // bytes of the store's limit held until Commit or destruction
    struct Pending {
      std::unique_ptr<Part> part;  // null for a kept part
      int64_t received = 0;        // contiguous prefix of initial values
    };
    absl::flat_hash_map<std::string, Pending> pending_;
  };
  // Validates the header: shard count and index must match this store; a part
  // already present with another layout or fingerprint is
  // FAILED_PRECONDITION naming the variable and both definitions.
  absl::StatusOr<std::unique_ptr<Registration>> BeginRegistration(
      uint64_t plan_fingerprint, int num_shards, int shard_index,
      std::vector<PartDefinition> parts);

  // One Push call. Apply() validates a segment fully before touching any
  // value and applies the optimizer to it at once; see proto/psflow.proto for
  // the exactly-once rule per request id: each element of a part is updated
  // at most once per request id, whatever the order of the segments and
  // however many sessions (streams) carry them at once. Elements already
  // applied under the id are skipped; a segment overlapping one that another
  // call is applying right now waits for it. Thread-safe: the messages of
  // one session may be applied from several threads at once, and sessions
  // of the same request id may run in parallel.
  class PushSession {
   public:
    ~PushSession();
    // `data` holds `count` float32 gradient values (any byte alignment) for
    // elements [offset, offset+count) of `variable`'s part. With
    // `values_checked` the caller has passed the same data to Validate()
    // already, and the NaN/Inf scan is not repeated (ranges still are).
    // With `read_back` (4 * count bytes, any alignment) the same elements'
    // values right after the update are copied there, under the same lock
    // hold, and `*version` gets the part's version (also when the elements
    // were applied before under this request id and are skipped now).
    absl::Status Apply(absl::string_view variable, int64_t offset, const void* data,
                       int64_t count, bool values_checked = false, void* read_back = nullptr,
                       int64_t* version = nullptr);
    // Checks a segment without applying it (used to validate a whole message
    // before any of its segments is applied).
    absl::Status Validate(absl::string_view variable, int64_t offset, const void* data,
                          int64_t count);
    // Checks only that the variable exists and that elements
    // [offset, offset+count) lie in its part and fit one segment.
    absl::Status ValidateRange(absl::string_view variable, int64_t offset, int64_t count);
    // Records the outcome: a session that saw an error counts as rejected.
    void Finish(const absl::Status& status);
    int64_t elements_applied() const { return applied_; }
    int64_t elements_skipped() const { return skipped_; }

   private:
    friend class VariableStore;
    PushSession(VariableStore* store, uint64_t request_id, bool scan_values)
        : store_(store), request_id_(request_id), scan_values_(scan_values) {}
    absl::StatusOr<Part*> Find(absl::string_view variable);
    // The request id's record, found or made on the first call: only a
    // segment that passed its checks gets there, so a push refused by them
    // leaves nothing in the ledger (nor pushes a real id out of it). One
    // whose first segment then finds no memory for a pull's copy leaves the
    // id's record (about 230 bytes), not the part's.
    LedgerEntry& Entry();
    // Adds `delta` to the entry's bytes (and the store's, unless evicted);
    // entry_->mu held.
    void Account(int64_t delta);
    VariableStore* store_;
    const uint64_t request_id_;
    absl::once_flag entry_once_;
    std::shared_ptr<LedgerEntry> entry_;  // set once, by Entry()
    // Gradients are scanned for NaN/Inf: neither allowed by the store nor
    // checked by the client (PushHeaderInfo::gradient_checked).
    const bool scan_values_;
    absl::Mutex cache_mu_;
    absl::flat_hash_map<std::string, Part*> cache_ ABSL_GUARDED_BY(cache_mu_);
    std::atomic<int64_t> applied_{0};
    std::atomic<int64_t> skipped_{0};
  };
  std::unique_ptr<PushSession> BeginPush(const PushHeaderInfo& header);
  // Counts a push refused before its session began (its header names
  // another start of this shard) among the rejected ones.
  void CountRejectedPush() { ++rejected_requests_; }

  // Copies `count` parameter values of `variable`'s part starting at
  // `offset` into `out` (4 * count bytes); returns the part's version.
  absl::StatusOr<int64_t> Read(absl::string_view variable, int64_t offset, int64_t count,
                               void* out) const;
  // The same values without a copy: appends one PinnedValues per lock stripe
  // the range crosses, in order, each to be released with Unpin; returns the
  // part's version. Until then a push to those stripes updates a copy of
  // them (a 256 KiB copy per stripe, each time an update finds it pinned),
  // so the pinned values stay as read, one moment as with Read. For a pull
  // that sends the values from where they lie (a gRPC slice whose release
  // calls Unpin).
  absl::StatusOr<int64_t> Pin(absl::string_view variable, int64_t offset, int64_t count,
                              std::vector<PinnedValues>* out) const;
  // Releases a PinnedValues::pin; any thread, any time, also after the store
  // is gone.
  static void Unpin(void* pin);

  // Definitions and versions of every part, in name order.
  std::vector<PartSnapshot> ListParts() const;
  // The same of the first `limit` parts whose names sort after `after` (all
  // names sort after ""), copying no others: a page of a long list costs
  // a pointer per part, not a definition. `*total` gets the number of parts,
  // `*remaining` the number after `after` (so whether more follow the page).
  std::vector<PartSnapshot> ListParts(absl::string_view after, size_t limit, int64_t* total,
                                      int64_t* remaining) const;
  absl::StatusOr<PartSnapshot> GetPart(absl::string_view variable) const;
  // The elements of `variable`'s part, or GetPart's NOT_FOUND; allocates
  // nothing (a pull checks every range it is asked for).
  absl::StatusOr<int64_t> PartElements(absl::string_view variable) const;
  // OK if elements [offset, offset + count) lie in `variable`'s part, else
  // NOT_FOUND, or INVALID_ARGUMENT "`what` of 'variable' covers elements
  // [a,b) but its part ... has n elements"; allocates nothing on success.
  absl::Status CheckRange(absl::string_view variable, int64_t offset, int64_t count,
                          const char* what) const;
  uint64_t plan_fingerprint() const;
  StoreStats stats() const;
  // The bound on parameters and slots that registration enforces, resolved
  // from the options (0: none).
  int64_t max_variable_bytes() const { return max_variable_bytes_; }

 private:
  class StripeLock;
  VariableStore(const VariableStoreOptions& options, std::unique_ptr<Optimizer> optimizer,
                std::unique_ptr<Optimizer> undecayed_optimizer);
  absl::StatusOr<Part*> FindPart(absl::string_view variable) const;
  std::unique_ptr<Part> NewPart(const PartDefinition& def) const;
  std::shared_ptr<LedgerEntry> LedgerFor(uint64_t request_id);
  // Forgets the ids past their retention and, beyond request_ledger_bytes,
  // the oldest ones early (none still in use); returns how many went early.
  int64_t TrimLedgerLocked(std::chrono::steady_clock::time_point now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ledger_mu_);
  // The same, for a record that grew (a push that left gaps): without it an
  // old id could grow after the newer ones came, and many of them beyond
  // the bound.
  void TrimLedger() ABSL_LOCKS_EXCLUDED(ledger_mu_);
  void ReportForgottenEarly(int64_t forgotten);
  absl::Status CheckSegment(const Part& part, int64_t offset, const void* data, int64_t count,
                            bool check_values) const;
  absl::StatusOr<Part*> FindRange(absl::string_view variable, int64_t offset, int64_t count,
                                  const char* what) const;
  // Stripe `stripe`'s values, ready to be written in place: copied first if
  // a pull still pins them, or back home once no pull holds home. The
  // stripe's lock held exclusively; throws std::bad_alloc if a copy finds
  // no memory.
  float* WritableValues(Part& part, int64_t stripe);

  const VariableStoreOptions options_;
  const std::unique_ptr<Optimizer> optimizer_;
  // The same without weight decay, for the variables excluded from it; null
  // when the optimizer decays none.
  const std::unique_ptr<Optimizer> undecayed_optimizer_;
  // Buffers for stripes copied on write; shared with the copies, which may
  // outlive the store in a pull that gRPC is still sending.
  const std::shared_ptr<ValuesPool> values_pool_;

  mutable absl::Mutex parts_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<Part>> parts_ ABSL_GUARDED_BY(parts_mu_);
  uint64_t plan_fingerprint_ ABSL_GUARDED_BY(parts_mu_) = 0;
  // Bytes that registrations in progress will add (their new parts'
  // parameters and slots), counted against max_variable_bytes_ so that
  // registrations open at once cannot together exceed it.
  int64_t reserved_bytes_ ABSL_GUARDED_BY(parts_mu_) = 0;
  // The held parts' PartOverheadBytes, summed.
  int64_t part_overhead_bytes_ ABSL_GUARDED_BY(parts_mu_) = 0;

  mutable absl::Mutex ledger_mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<LedgerEntry>> ledger_ ABSL_GUARDED_BY(ledger_mu_);
  std::deque<uint64_t> ledger_order_ ABSL_GUARDED_BY(ledger_mu_);
  // The sum of the remembered entries' `bytes`.
  std::atomic<int64_t> ledger_bytes_{0};
  std::atomic<int64_t> ledger_forgotten_early_{0};

  std::atomic<int64_t> pushes_{0};
  std::atomic<int64_t> pushes_checked_by_client_{0};
  std::atomic<int64_t> elements_applied_{0};
  std::atomic<int64_t> duplicate_elements_{0};
  std::atomic<int64_t> rejected_requests_{0};
  std::atomic<int64_t> parameter_bytes_{0};
  std::atomic<int64_t> stripes_copied_on_write_{0};
  int64_t max_variable_bytes_ = 0;  // resolved from the options; 0 = no limit
};

}  // namespace psflow::server

#endif  // PSFLOW_PS_SERVER_VARIABLE_STORE_H_
