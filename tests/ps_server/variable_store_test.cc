// VariableStore without RPC: registration, the exactly-once ledger, reads
// and the errors each names.
#include "ps_server/variable_store.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/process_stats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#if defined(__SANITIZE_ADDRESS__)
// An allocation no machine can serve returns null (and FloatBuffer throws
// std::bad_alloc) instead of ending the test: ShapesBeyondTheMachineAreRefused
// checks that the store turns that into an error.
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
#endif

namespace psflow::server {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<VariableStore> SgdStore(int shard = 0, int shards = 1,
                                        absl::Duration retention = absl::Minutes(15),
                                        int64_t ledger_bytes = 32 << 20) {
  VariableStoreOptions options;
  options.shard_index = shard;
  options.num_shards = shards;
  options.optimizer.kind = OptimizerOptions::Kind::kSgd;
  options.optimizer.learning_rate = 1.0f;
  options.request_id_retention = retention;
  options.request_ledger_bytes = ledger_bytes;
  auto store = VariableStore::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(*store);
}

PartDefinition Def(const std::string& name, std::vector<int64_t> shape, int64_t rb, int64_t re) {
  PartDefinition d;
  d.variable = name;
  d.variable_shape = std::move(shape);
  d.row_begin = rb;
  d.row_end = re;
  return d;
}

void RegisterFilled(VariableStore* store, const PartDefinition& def, float value,
                    uint64_t fingerprint = 7) {
  auto reg = store->BeginRegistration(fingerprint, store->options().num_shards,
                                      store->options().shard_index, {def});
  ASSERT_TRUE(reg.ok()) << reg.status();
  std::vector<float> values(def.num_elements(), value);
  ASSERT_TRUE((*reg)->AddValues(def.variable, 0, values.data(), values.size()).ok());
  ASSERT_TRUE((*reg)->Commit().ok());
}

std::vector<float> ReadAll(VariableStore* store, const std::string& name, int64_t n) {
  std::vector<float> out(n, -99);
  EXPECT_TRUE(store->Read(name, 0, n, out.data()).ok());
  return out;
}

// Errors name a range's end exactly, also where a hostile offset and count
// overflow 64 bits.
TEST(VariableStoreTest, RangeEndIsExactBeyondSixtyFourBits) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(RangeEnd(3, 4), "7");
  EXPECT_EQ(RangeEnd(-3, 1), "-2");
  EXPECT_EQ(RangeEnd(kMax - 1, 2), "9223372036854775808");
  EXPECT_EQ(RangeEnd(kMax, kMax), "18446744073709551614");
  EXPECT_EQ(RangeEnd(kMin, -1), "-9223372036854775809");
  EXPECT_EQ(RangeEnd(kMin, kMin), "-18446744073709551616");
  EXPECT_EQ(RangeEnd(kMin, kMax), "-1");
}

TEST(VariableStoreTest, PartOfARowRangeHasRowsTimesRowElements) {
  EXPECT_EQ(Def("w", {10, 3, 2}, 4, 7).num_elements(), 3 * 3 * 2);
  EXPECT_EQ(Def("s", {}, 0, 1).num_elements(), 1);
}

// A page of the parts: the first `limit` after a name, in name order, with
// the count of all and of those after the name.
TEST(VariableStoreTest, ListsAPageOfPartsAfterAName) {
  auto store = SgdStore();
  for (const char* name : {"d", "a", "c", "e", "b"}) {
    RegisterFilled(store.get(), Def(name, {2}, 0, 2), 0.0f);
  }
  const auto names = [](const std::vector<PartSnapshot>& parts) {
    std::vector<std::string> out;
    for (const PartSnapshot& part : parts) out.push_back(part.def.variable);
    return out;
  };
  int64_t total = -1, remaining = -1;
  EXPECT_THAT(names(store->ListParts("", 2, &total, &remaining)), ::testing::ElementsAre("a", "b"));
  EXPECT_EQ(total, 5);
  EXPECT_EQ(remaining, 5);
  EXPECT_THAT(names(store->ListParts("b", 2, &total, &remaining)),
              ::testing::ElementsAre("c", "d"));
  EXPECT_EQ(remaining, 3);
  EXPECT_THAT(names(store->ListParts("bb", 10, &total, &remaining)),
              ::testing::ElementsAre("c", "d", "e"));
  EXPECT_EQ(remaining, 3);
  EXPECT_TRUE(store->ListParts("e", 10, &total, &remaining).empty());
  EXPECT_EQ(remaining, 0);
  EXPECT_EQ(total, 5);
  EXPECT_THAT(names(store->ListParts()), ::testing::ElementsAre("a", "b", "c", "d", "e"));
  EXPECT_EQ(store->ListParts("a", 1, &total, &remaining)[0].num_elements, 2);
}

// Weight decay reaches every part of a variable whose name no excluded
// pattern is found in, and no part of the others (Keras's
// exclude_from_weight_decay), the rows of a split variable included.
TEST(VariableStoreTest, WeightDecaySkipsTheExcludedVariables) {
  VariableStoreOptions options;
  options.optimizer.kind = OptimizerOptions::Kind::kSgd;
  options.optimizer.learning_rate = 0.5;
  options.optimizer.weight_decay = 0.5;  // a decayed value goes 1 -> 0.75
  options.optimizer.exclude_from_weight_decay = {"bias$"};
  auto store = VariableStore::Create(options);
  ASSERT_TRUE(store.ok()) << store.status();
  const PartDefinition kernel = Def("dense/kernel", {4, 2}, 2, 4);  // rows 2-3 of 4
  const PartDefinition bias = Def("dense/bias", {2}, 0, 2);
  const PartDefinition biased = Def("dense/bias_scale", {2}, 0, 2);  // "bias" not at the end
  for (const PartDefinition& def : {kernel, bias, biased}) {
    RegisterFilled(store->get(), def, 1.0f);
  }
  const float zeros[4] = {0, 0, 0, 0};
  auto push = (*store)->BeginPush({1, 1, 0, 5});
  ASSERT_TRUE(push->Apply("dense/kernel", 0, zeros, 4).ok());
  ASSERT_TRUE(push->Apply("dense/bias", 0, zeros, 2).ok());
  ASSERT_TRUE(push->Apply("dense/bias_scale", 0, zeros, 2).ok());
  push->Finish(absl::OkStatus());
  EXPECT_THAT(ReadAll(store->get(), "dense/kernel", 4), ::testing::Each(0.75f));
  EXPECT_THAT(ReadAll(store->get(), "dense/bias", 2), ::testing::Each(1.0f));
  EXPECT_THAT(ReadAll(store->get(), "dense/bias_scale", 2), ::testing::Each(0.75f));
}

TEST(VariableStoreTest, RegistrationBecomesVisibleOnlyAtCommit) {
  auto store = SgdStore();
  auto reg = store->BeginRegistration(7, 1, 0, {Def("w", {4}, 0, 4)});
  ASSERT_TRUE(reg.ok());
  const float v[4] = {1, 2, 3, 4};
  ASSERT_TRUE((*reg)->AddValues("w", 0, v, 4).ok());
  EXPECT_EQ(store->GetPart("w").status().code(), absl::StatusCode::kNotFound);
  auto result = (*reg)->Commit();
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->parts_created, 1);
  EXPECT_THAT(ReadAll(store.get(), "w", 4), ::testing::ElementsAre(1, 2, 3, 4));
  EXPECT_EQ(store->plan_fingerprint(), 7u);
}

TEST(VariableStoreTest, IncompleteRegistrationRegistersNothing) {
  auto store = SgdStore();
  auto reg = store->BeginRegistration(7, 1, 0, {Def("w", {4}, 0, 4), Def("b", {2}, 0, 2)});
  ASSERT_TRUE(reg.ok());
  const float v[4] = {1, 2, 3, 4};
  ASSERT_TRUE((*reg)->AddValues("w", 0, v, 4).ok());
  ASSERT_TRUE((*reg)->AddValues("b", 0, v, 1).ok());
  auto result = (*reg)->Commit();
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(), HasSubstr("'b'"));
  EXPECT_THAT(result.status().message(), HasSubstr("1 of 2"));
  EXPECT_TRUE(store->ListParts().empty());
}

TEST(VariableStoreTest, ReRegistrationKeepsValuesAndConflictsAreRefused) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {4, 2}, 0, 4), 1.0f);
  RegisterFilled(store.get(), Def("w", {4, 2}, 0, 4), 5.0f);  // kept
  EXPECT_THAT(ReadAll(store.get(), "w", 8), ::testing::Each(1.0f));

  auto other_shape = store->BeginRegistration(7, 1, 0, {Def("w", {2, 4}, 0, 2)});
  EXPECT_EQ(other_shape.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other_shape.status().message(), HasSubstr("[4,2]"));
  EXPECT_THAT(other_shape.status().message(), HasSubstr("[2,4]"));
  auto other_rows = store->BeginRegistration(7, 1, 0, {Def("w", {4, 2}, 0, 2)});
  EXPECT_EQ(other_rows.status().code(), absl::StatusCode::kFailedPrecondition);
  auto other_plan = store->BeginRegistration(8, 1, 0, {Def("w", {4, 2}, 0, 4)});
  EXPECT_EQ(other_plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other_plan.status().message(), HasSubstr("plan"));
}

TEST(VariableStoreTest, BadDefinitionsAreInvalidArgument) {
  auto store = SgdStore();
  EXPECT_EQ(store->BeginRegistration(7, 1, 0, {Def("", {4}, 0, 4)}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->BeginRegistration(7, 1, 0, {Def("w", {0, 4}, 0, 1)}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->BeginRegistration(7, 1, 0, {Def("w", {4}, 2, 6)}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      store->BeginRegistration(7, 1, 0, {Def("w", {4}, 0, 4), Def("w", {4}, 0, 4)}).status().code(),
      absl::StatusCode::kInvalidArgument);
  auto wrong_shard = store->BeginRegistration(7, 2, 1, {Def("w", {4}, 0, 4)});
  EXPECT_EQ(wrong_shard.status().code(), absl::StatusCode::kFailedPrecondition);
  // Element counts that overflow 64 bits, or come near it.
  const int64_t big = int64_t{1} << 40;
  for (const auto& shape : std::vector<std::vector<int64_t>>{
           {big, big}, {1 << 20, 1 << 20, 1 << 17}, {3, std::numeric_limits<int64_t>::max()}}) {
    auto huge = store->BeginRegistration(7, 1, 0, {Def("h", shape, 0, 1)});
    EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(huge.status().message(), HasSubstr("expected at most 2^56 elements"));
  }
  EXPECT_TRUE(store->ListParts().empty());
}

// A shape may have as many dimensions as TensorFlow allows (254), no more:
// a part's record keeps its shape, and a header of a few MiB could
// otherwise make one of millions of dimensions of 1.
TEST(VariableStoreTest, ShapesOfMoreThan254DimensionsAreRefused) {
  auto store = SgdStore();
  const std::vector<int64_t> most(VariableStore::kMaxRank, 1);
  std::vector<int64_t> too_many = most;
  too_many.push_back(1);
  auto refused = store->BeginRegistration(7, 1, 0, {Def("deep", too_many, 0, 1)});
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("'deep' has a shape of 255 dimensions; expected at most 254"));
  EXPECT_TRUE(store->ListParts().empty());
  EXPECT_TRUE(store->BeginRegistration(7, 1, 0, {Def("deep", most, 0, 1)}).ok());
}

// A registration that needs more memory than the shard may hold is refused
// before anything is allocated, naming the part and the bytes.
// Each part also counts VariableStore::kPartBytes (1024).
constexpr int64_t kLimit = 12 * 100 + 2 * VariableStore::kPartBytes;  // 3248

TEST(VariableStoreTest, RegistrationBeyondTheMemoryLimitIsResourceExhausted) {
  VariableStoreOptions options;  // Adam: 12 bytes per element with its two slots
  options.max_variable_bytes = kLimit;
  auto store = VariableStore::Create(options);
  ASSERT_TRUE(store.ok()) << store.status();
  RegisterFilled(store->get(), Def("w", {60}, 0, 60), 1.0f);
  auto over = (*store)->BeginRegistration(7, 1, 0, {Def("b", {41}, 0, 41)});
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("b [41]"));
  EXPECT_THAT(over.status().message(), HasSubstr("needs 1516 bytes"));  // 41 * 12 + 1024
  EXPECT_THAT(over.status().message(), HasSubstr("holds 1744 and may hold at most 3248"));
  ASSERT_EQ((*store)->ListParts().size(), 1u);
  // What is already held counts once: re-registering it is fine, and so is
  // a new part that just fits.
  auto fits = (*store)->BeginRegistration(7, 1, 0, {Def("w", {60}, 0, 60), Def("b", {40}, 0, 40)});
  ASSERT_TRUE(fits.ok()) << fits.status();
  std::vector<float> zeros(40, 0.0f);
  ASSERT_TRUE((*fits)->AddValues("b", 0, zeros.data(), 40).ok());
  ASSERT_TRUE((*fits)->Commit().ok());
  EXPECT_EQ((*store)->ListParts().size(), 2u);
  EXPECT_EQ((*store)->BeginRegistration(7, 1, 0, {Def("c", {1}, 0, 1)}).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// Tiny parts count what each part costs beside its elements: 450,000
// one-element parts took 850 bytes each, where 12 were counted, so the
// limit could be passed 70 times over.
TEST(VariableStoreTest, ManyTinyPartsCountTheirOwnCost) {
  VariableStoreOptions options;  // Adam
  options.max_variable_bytes = 100 * (12 + VariableStore::kPartBytes);
  auto store = VariableStore::Create(options);
  ASSERT_TRUE(store.ok()) << store.status();
  std::vector<PartDefinition> defs;
  for (int i = 0; i < 101; ++i) defs.push_back(Def(absl::StrCat("v", i), {1}, 0, 1));
  auto over = (*store)->BeginRegistration(7, 1, 0, defs);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("1024 per part"));
  defs.pop_back();
  EXPECT_TRUE((*store)->BeginRegistration(7, 1, 0, defs).ok());
}

// A long name (held twice) or shape counts its bytes beyond the 128 that
// kPartBytes covers: parts of 64 KiB names, counted as 1024 bytes each,
// passed the limit over 100 times over.
TEST(VariableStoreTest, LongNamesCountTheirBytes) {
  VariableStoreOptions options;  // Adam: 12 bytes per element
  const int64_t short_part = 12 + VariableStore::kPartBytes;
  options.max_variable_bytes = 4 * short_part;
  auto store = VariableStore::Create(options);
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string long_name(4 * short_part, 'n');
  EXPECT_EQ(VariableStore::PartOverheadBytes(Def(long_name, {1}, 0, 1)),
            VariableStore::kPartBytes + 2 * static_cast<int64_t>(long_name.size()) + 8 - 128);
  EXPECT_EQ(VariableStore::PartOverheadBytes(Def(std::string(60, 'n'), {1}, 0, 1)),
            VariableStore::kPartBytes);
  EXPECT_EQ(VariableStore::PartOverheadBytes(Def(std::string(61, 'n'), {1}, 0, 1)),
            VariableStore::kPartBytes + 2);
  auto over = (*store)->BeginRegistration(7, 1, 0, {Def(long_name, {1}, 0, 1)});
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_THAT(over.status().message(), HasSubstr("more for names and shapes over 128 bytes"));
  // Held parts count theirs too: one of a 1 KiB name takes the room of
  // almost three short parts (counted as one, three more would fit), so
  // two more no longer fit, and one does.
  RegisterFilled(store->get(), Def(std::string(1024, 'm'), {1}, 0, 1), 1.0f);
  std::vector<PartDefinition> two = {Def("v0", {1}, 0, 1), Def("v1", {1}, 0, 1)};
  EXPECT_EQ((*store)->BeginRegistration(7, 1, 0, two).status().code(),
            absl::StatusCode::kResourceExhausted);
  two.pop_back();
  EXPECT_TRUE((*store)->BeginRegistration(7, 1, 0, two).ok());
}

// Registrations open at the same moment reserve their bytes, so that
// together they cannot exceed the limit (each allocates and fills its parts
// before it commits). One that would fit but for the others is UNAVAILABLE,
// which clients retry; the second of two workers registering the same model
// then finds its parts registered and keeps them.
TEST(VariableStoreTest, RegistrationsInProgressReserveTheirBytes) {
  VariableStoreOptions options;  // Adam: 12 bytes per element
  options.max_variable_bytes = kLimit;
  auto created = VariableStore::Create(options);
  ASSERT_TRUE(created.ok()) << created.status();
  VariableStore* store = created->get();
  std::vector<float> zeros(90, 0.0f);

  auto x = store->BeginRegistration(7, 1, 0, {Def("x", {90}, 0, 90)});
  ASSERT_TRUE(x.ok()) << x.status();
  auto y = store->BeginRegistration(7, 1, 0, {Def("y", {90}, 0, 90)});
  ASSERT_EQ(y.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(y.status().message(), HasSubstr("2104 bytes of it reserved"));  // 90 * 12 + 1024
  x->reset();  // x gives up: its reservation goes with it
  y = store->BeginRegistration(7, 1, 0, {Def("y", {90}, 0, 90)});
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_TRUE((*y)->AddValues("y", 0, zeros.data(), 90).ok());
  ASSERT_TRUE((*y)->Commit().ok());
  // Held now, not reserved: a third part of the same size can never fit.
  EXPECT_EQ(store->BeginRegistration(7, 1, 0, {Def("z", {90}, 0, 90)}).status().code(),
            absl::StatusCode::kResourceExhausted);

  // Two workers registering the same model at once.
  auto first = store->BeginRegistration(7, 1, 0, {Def("w", {8}, 0, 8)});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = store->BeginRegistration(7, 1, 0, {Def("w", {8}, 0, 8)});
  ASSERT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE((*first)->AddValues("w", 0, zeros.data(), 8).ok());
  ASSERT_TRUE((*first)->Commit().ok());
  second = store->BeginRegistration(7, 1, 0, {Def("w", {8}, 0, 8)});  // the retry
  ASSERT_TRUE(second.ok()) << second.status();
  auto kept = (*second)->Commit();
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->parts_kept, 1);
  EXPECT_EQ(store->ListParts().size(), 2u);
}

// Workers registering the same model at once, the model taking more than
// half of the limit: a registration whose header was read while another
// committed must find those parts registered, not count their bytes a
// second time and refuse with RESOURCE_EXHAUSTED (which clients do not
// retry). Only UNAVAILABLE (retried) or success may come back.
TEST(VariableStoreTest, ConcurrentRegistrationsOfOneModelNeverExhaustTheLimit) {
  VariableStoreOptions options;  // Adam: 12 bytes per element
  options.max_variable_bytes = kLimit;
  std::vector<float> zeros(60, 0.0f);
  constexpr int kThreads = 3;
  for (int round = 0; round < 400; ++round) {
    auto created = VariableStore::Create(options);
    ASSERT_TRUE(created.ok()) << created.status();
    VariableStore* store = created->get();
    std::barrier start(kThreads);
    std::vector<absl::Status> results(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        start.arrive_and_wait();
        absl::Status status = absl::UnavailableError("not tried");
        for (int attempt = 0; attempt < 100000 && absl::IsUnavailable(status); ++attempt) {
          auto reg = store->BeginRegistration(7, 1, 0, {Def("w", {60}, 0, 60)});
          status = reg.status();
          if (!reg.ok()) continue;
          status = (*reg)->AddValues("w", 0, zeros.data(), 60);
          if (status.ok()) status = (*reg)->Commit().status();
        }
        results[t] = status;
      });
    }
    for (std::thread& t : threads) t.join();
    for (int t = 0; t < kThreads; ++t) {
      ASSERT_TRUE(results[t].ok()) << "round " << round << ", registration " << t << ": "
                                   << results[t];
    }
    ASSERT_EQ(store->ListParts().size(), 1u);
  }
}

// A registration that finds, at commit, one of its parts registered
// meanwhile with another layout adds none of its parts.
TEST(VariableStoreTest, ConflictAtCommitRegistersNothing) {
  auto store = SgdStore();
  std::vector<float> zeros(8, 0.0f);
  auto a_and_b = store->BeginRegistration(7, 1, 0, {Def("a", {4}, 0, 4), Def("b", {4}, 0, 4)});
  ASSERT_TRUE(a_and_b.ok()) << a_and_b.status();
  ASSERT_TRUE((*a_and_b)->AddValues("a", 0, zeros.data(), 4).ok());
  ASSERT_TRUE((*a_and_b)->AddValues("b", 0, zeros.data(), 4).ok());
  RegisterFilled(store.get(), Def("b", {8}, 0, 8), 1.0f);  // another worker, first
  auto result = (*a_and_b)->Commit();
  ASSERT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(result.status().message(), HasSubstr("nothing was registered"));
  ASSERT_EQ(store->ListParts().size(), 1u);
  EXPECT_EQ(store->ListParts()[0].def.variable, "b");
}

// By default the limit is the machine's memory: a shape no machine can hold
// is refused, not allocated (it used to end the server with bad_alloc, or
// page in memory until the kernel killed it). With no limit at all, the
// failed allocation is still an error, not the end of the server.
TEST(VariableStoreTest, ShapesBeyondTheMachineAreRefused) {
  auto store = SgdStore();
  const int64_t rows = int64_t{1} << 47;  // 512 TiB of float32
  auto huge = store->BeginRegistration(7, 1, 0, {Def("huge", {rows}, 0, rows)});
  ASSERT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(huge.status().message(), HasSubstr("huge ["));
  EXPECT_THAT(huge.status().message(), HasSubstr("--max_variable_bytes"));

  VariableStoreOptions options;
  options.max_variable_bytes = -1;
  auto unlimited = VariableStore::Create(options);
  ASSERT_TRUE(unlimited.ok()) << unlimited.status();
  auto failed = (*unlimited)->BeginRegistration(7, 1, 0, {Def("huge", {rows}, 0, rows)});
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(failed.status().message(), HasSubstr("could not allocate"));
  EXPECT_TRUE((*unlimited)->ListParts().empty());
}

TEST(VariableStoreTest, PushAppliesTheOptimizerAndCountsVersions) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {4}, 0, 4), 1.0f);
  const float g[4] = {0.5f, -1, 2, 0};
  auto push = store->BeginPush({1, 1, 0, 11});
  ASSERT_TRUE(push->Apply("w", 0, g, 2).ok());
  ASSERT_TRUE(push->Apply("w", 2, g + 2, 2).ok());  // same push, next segment
  push->Finish(absl::OkStatus());
  EXPECT_THAT(ReadAll(store.get(), "w", 4), ::testing::ElementsAre(0.5f, 2.0f, -1.0f, 1.0f));
  EXPECT_EQ(store->GetPart("w")->version, 1);  // one push, one version
  EXPECT_EQ(push->elements_applied(), 4);
  EXPECT_EQ(store->stats().pushes, 1);
}

TEST(VariableStoreTest, SameRequestIdIsAppliedOnceAcrossSessions) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {4}, 0, 4), 0.0f);
  const float g[4] = {1, 1, 1, 1};
  {
    auto first = store->BeginPush({1, 1, 0, 99});
    ASSERT_TRUE(first->Apply("w", 0, g, 2).ok());  // then the stream "breaks"
    first->Finish(absl::CancelledError("broken"));
  }
  auto retry = store->BeginPush({1, 1, 0, 99});
  ASSERT_TRUE(retry->Apply("w", 0, g, 2).ok());  // skipped
  ASSERT_TRUE(retry->Apply("w", 2, g + 2, 2).ok());
  EXPECT_EQ(retry->elements_skipped(), 2);
  EXPECT_EQ(retry->elements_applied(), 2);
  EXPECT_THAT(ReadAll(store.get(), "w", 4), ::testing::Each(-1.0f));
  EXPECT_EQ(store->GetPart("w")->version, 1);  // the retry kept the step
  EXPECT_EQ(store->stats().duplicate_elements, 2);
  EXPECT_EQ(store->stats().rejected_requests, 1);
}

TEST(VariableStoreTest, SegmentsInAnyOrderAreEachAppliedOnce) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {6}, 0, 6), 0.0f);
  const float g[6] = {1, 2, 3, 4, 5, 6};
  auto push = store->BeginPush({1, 1, 0, 21});
  ASSERT_TRUE(push->Apply("w", 4, g + 4, 2).ok());  // the last segment first
  ASSERT_TRUE(push->Apply("w", 0, g, 2).ok());
  // Overlapping what was applied: only elements 2 and 3 are new.
  ASSERT_TRUE(push->Apply("w", 1, g + 1, 4).ok());
  EXPECT_EQ(push->elements_applied(), 6);
  EXPECT_EQ(push->elements_skipped(), 2);
  EXPECT_THAT(ReadAll(store.get(), "w", 6), ::testing::ElementsAre(-1, -2, -3, -4, -5, -6));
  EXPECT_EQ(store->GetPart("w")->version, 1);  // one request id, one step
  // A second session of the same id (a retry, or another stream of the
  // push) finds everything applied.
  auto again = store->BeginPush({1, 1, 0, 21});
  ASSERT_TRUE(again->Apply("w", 0, g, 6).ok());
  EXPECT_EQ(again->elements_skipped(), 6);
  EXPECT_THAT(ReadAll(store.get(), "w", 6), ::testing::ElementsAre(-1, -2, -3, -4, -5, -6));
}

// Tens of thousands of small segments in random order, overlapping, some
// adjacent: the ledger of applied ranges (a tree of merged ranges) must
// still apply every element exactly once per request id. Checked against a
// bitmap of what each segment newly covers.
TEST(VariableStoreTest, ManySmallSegmentsInAnyOrderAreEachAppliedOnce) {
  constexpr int64_t kElements = 50000;
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  std::mt19937_64 rng(5);
  std::vector<float> ones(kElements, 1.0f);
  std::vector<bool> covered(kElements, false);
  auto push = store->BeginPush({1, 1, 0, 31});
  int64_t want_applied = 0, want_skipped = 0;
  for (int i = 0; i < 30000; ++i) {
    const int64_t offset = static_cast<int64_t>(rng() % kElements);
    const int64_t count = std::min<int64_t>(1 + static_cast<int64_t>(rng() % 3), kElements - offset);
    for (int64_t e = offset; e < offset + count; ++e) {
      (covered[e] ? want_skipped : want_applied) += 1;
      covered[e] = true;
    }
    ASSERT_TRUE(push->Apply("w", offset, ones.data(), count).ok());
  }
  EXPECT_EQ(push->elements_applied(), want_applied);
  EXPECT_EQ(push->elements_skipped(), want_skipped);
  std::vector<float> values = ReadAll(store.get(), "w", kElements);
  for (int64_t e = 0; e < kElements; ++e) {
    ASSERT_EQ(values[e], covered[e] ? -1.0f : 0.0f) << "element " << e;
  }
  // A retry of the whole part fills exactly the gaps.
  auto retry = store->BeginPush({1, 1, 0, 31});
  ASSERT_TRUE(retry->Apply("w", 0, ones.data(), kElements).ok());
  EXPECT_EQ(retry->elements_applied(), kElements - want_applied);
  values = ReadAll(store.get(), "w", kElements);
  EXPECT_TRUE(std::all_of(values.begin(), values.end(), [](float v) { return v == -1.0f; }));
  EXPECT_EQ(store->GetPart("w")->version, 1);
}

TEST(VariableStoreTest, ParallelSessionsOfOneRequestIdApplyEachElementOnce) {
  // Several sessions of one request id (streams of one push, or a retry
  // racing the original) each send the whole part, cut into chunks of a
  // different size and in a different order. Every element must be updated
  // exactly once per id: with SGD lr 1 and a gradient of 1, -1 per id.
  constexpr int kElements = 5000, kSessions = 4, kIds = 200;
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  const std::vector<float> g(kElements, 1.0f);
  std::vector<int64_t> applied(kSessions, 0);
  for (int id = 1; id <= kIds; ++id) {
    std::vector<std::thread> threads;
    for (int t = 0; t < kSessions; ++t) {
      threads.emplace_back([&, t] {
        auto push = store->BeginPush({t, id, 0, static_cast<uint64_t>(id)});
        const int64_t chunk = 97 + 211 * t;  // chunk edges differ between sessions
        std::vector<int64_t> starts;
        for (int64_t o = 0; o < kElements; o += chunk) starts.push_back(o);
        if (t % 2 == 1) std::reverse(starts.begin(), starts.end());
        for (int64_t o : starts) {
          const int64_t n = std::min<int64_t>(chunk, kElements - o);
          ASSERT_TRUE(push->Apply("w", o, g.data() + o, n).ok());
        }
        EXPECT_EQ(push->elements_applied() + push->elements_skipped(), kElements);
        applied[t] += push->elements_applied();
      });
    }
    for (auto& th : threads) th.join();
  }
  EXPECT_THAT(ReadAll(store.get(), "w", kElements), ::testing::Each(-1.0f * kIds));
  EXPECT_EQ(store->GetPart("w")->version, kIds);
  int64_t total = 0;
  for (int64_t a : applied) total += a;
  EXPECT_EQ(total, int64_t{kElements} * kIds);
  EXPECT_EQ(store->stats().duplicate_elements, int64_t{kElements} * kIds * (kSessions - 1));
}

TEST(VariableStoreTest, ApplyReadsBackTheUpdatedValuesAlsoWhenSkipped) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {4}, 0, 4), 1.0f);
  const float g[4] = {1, 2, 3, 4};
  char back[4 * 3 + 1];  // read back at an odd address: any alignment
  int64_t version = -1;
  {
    auto push = store->BeginPush({1, 1, 0, 5});
    ASSERT_TRUE(push->Apply("w", 0, g, 3, false, back + 1, &version).ok());
  }
  float values[3];
  std::memcpy(values, back + 1, sizeof(values));
  EXPECT_THAT(values, ::testing::ElementsAre(0.0f, -1.0f, -2.0f));
  EXPECT_EQ(version, 1);
  // Another push moves the part on; a retry of the first one is skipped but
  // still reads back the values as they are now.
  {
    auto other = store->BeginPush({2, 1, 0, 6});
    ASSERT_TRUE(other->Apply("w", 0, g, 4).ok());
  }
  std::memset(back, 0, sizeof(back));
  version = -1;
  auto retry = store->BeginPush({1, 1, 0, 5});
  ASSERT_TRUE(retry->Apply("w", 0, g, 3, false, back + 1, &version).ok());
  EXPECT_EQ(retry->elements_skipped(), 3);
  std::memcpy(values, back + 1, sizeof(values));
  EXPECT_THAT(values, ::testing::ElementsAre(-1.0f, -3.0f, -5.0f));
  EXPECT_EQ(version, 2);
  EXPECT_THAT(ReadAll(store.get(), "w", 4), ::testing::ElementsAre(-1.0f, -3.0f, -5.0f, -3.0f));
}

// Ids are forgotten once past their retention (here none at all), oldest
// first, when a new id arrives; a retry of a forgotten id is a new push.
TEST(VariableStoreTest, LedgerForgetsIdsPastTheirRetention) {
  auto store = SgdStore(0, 1, /*retention=*/absl::ZeroDuration());
  RegisterFilled(store.get(), Def("w", {1}, 0, 1), 0.0f);
  const float g = 1;
  for (uint64_t id : {1, 2, 3}) {
    auto p = store->BeginPush({0, 0, 0, id});
    ASSERT_TRUE(p->Apply("w", 0, &g, 1).ok());
  }
  EXPECT_EQ(store->stats().ledger_ids, 1);  // only the newest
  EXPECT_EQ(store->stats().ledger_ids_forgotten_early, 0);
  // Id 3 is still remembered (nothing newer came); id 1 is a new push again.
  auto again3 = store->BeginPush({0, 0, 0, 3});
  ASSERT_TRUE(again3->Apply("w", 0, &g, 1).ok());
  EXPECT_EQ(again3->elements_skipped(), 1);
  auto again1 = store->BeginPush({0, 0, 0, 1});
  ASSERT_TRUE(again1->Apply("w", 0, &g, 1).ok());
  EXPECT_EQ(again1->elements_applied(), 1);
  EXPECT_THAT(ReadAll(store.get(), "w", 1), ::testing::ElementsAre(-4.0f));
}

// However many pushes a busy shard takes while a client waits out a
// deadline, the id of a push whose reply was lost is still remembered when
// its retry comes: ids are kept for their retention (15 minutes by
// default), not by count. (With a count of 8,192 ids, 8 workers at 100
// steps a second made a shard forget an id in 10 s, and the retry after a
// 60 s deadline was applied twice.)
TEST(VariableStoreTest, LedgerRemembersIdsByAgeNotByCount) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {1}, 0, 1), 0.0f);
  const float g = 1;
  constexpr uint64_t kPushes = 100000;
  for (uint64_t id = 1; id <= kPushes; ++id) {
    auto p = store->BeginPush({0, 0, 0, id});
    ASSERT_TRUE(p->Apply("w", 0, &g, 1).ok());
  }
  const StoreStats stats = store->stats();
  EXPECT_EQ(stats.ledger_ids, static_cast<int64_t>(kPushes));
  EXPECT_EQ(stats.ledger_ids_forgotten_early, 0);
  // About 240 bytes an id, well under the 32 MiB bound.
  EXPECT_LE(stats.ledger_bytes, static_cast<int64_t>(kPushes) * 256);
  auto retry = store->BeginPush({0, 0, 0, 1});
  ASSERT_TRUE(retry->Apply("w", 0, &g, 1).ok());
  EXPECT_EQ(retry->elements_skipped(), 1);
  EXPECT_EQ(ReadAll(store.get(), "w", 1)[0], -float{kPushes});
}

// An id whose push is still being applied is never forgotten, past its
// retention or not: a retry (or another stream of the same push) arriving
// meanwhile finds its record. It is forgotten once its sessions end.
TEST(VariableStoreTest, LedgerKeepsIdsWhosePushesAreStillApplying) {
  auto store = SgdStore(0, 1, /*retention=*/absl::ZeroDuration());
  RegisterFilled(store.get(), Def("w", {2}, 0, 2), 0.0f);
  const float g[2] = {1, 1};
  auto open = store->BeginPush({0, 0, 0, 7});
  ASSERT_TRUE(open->Apply("w", 0, g, 1).ok());  // half of the part, and still open
  for (uint64_t id = 100; id < 110; ++id) {
    auto p = store->BeginPush({0, 0, 0, id});
    ASSERT_TRUE(p->Apply("w", 0, g, 2).ok());
  }
  auto retry = store->BeginPush({0, 0, 0, 7});  // the same record as `open`
  ASSERT_TRUE(retry->Apply("w", 0, g, 2).ok());
  EXPECT_EQ(retry->elements_skipped(), 1);
  EXPECT_EQ(retry->elements_applied(), 1);
  EXPECT_THAT(ReadAll(store.get(), "w", 2), ::testing::ElementsAre(-11.0f, -11.0f));
  open.reset();
  retry.reset();
  auto next = store->BeginPush({0, 0, 0, 200});
  ASSERT_TRUE(next->Apply("w", 0, g, 2).ok());
  EXPECT_EQ(store->stats().ledger_ids, 1);  // 7 went with the others
  auto late = store->BeginPush({0, 0, 0, 7});
  ASSERT_TRUE(late->Apply("w", 0, g, 2).ok());
  EXPECT_EQ(late->elements_applied(), 2);
}

// A finished push costs the ledger a bit per part, not a record of ranges:
// thousands of remembered ids over a model of many variables stay small,
// and are still applied exactly once on retry.
TEST(VariableStoreTest, FinishedPushesCostTheLedgerABitPerPart) {
  auto store = SgdStore();
  constexpr int kParts = 300;
  constexpr int kPushes = 1000;
  for (int p = 0; p < kParts; ++p) {
    RegisterFilled(store.get(), Def(absl::StrCat("v", p), {3}, 0, 3), 0.0f);
  }
  const float g[3] = {1, 1, 1};
  for (uint64_t id = 1; id <= kPushes; ++id) {
    auto push = store->BeginPush({0, 0, 0, id});
    for (int p = 0; p < kParts; ++p) {
      // Two segments per part, the second completing it.
      ASSERT_TRUE(push->Apply(absl::StrCat("v", p), 0, g, 2).ok());
      ASSERT_TRUE(push->Apply(absl::StrCat("v", p), 2, g + 2, 1).ok());
    }
    push->Finish(absl::OkStatus());
  }
  const StoreStats stats = store->stats();
  EXPECT_EQ(stats.ledger_ids, kPushes);
  // 232 bytes for the id and 40 bytes of bits (300 parts), where a record
  // per part would be 300 * 96 bytes or more.
  EXPECT_LE(stats.ledger_bytes, kPushes * (232 + 40));
  EXPECT_GT(stats.ledger_bytes, 0);
  // The oldest id is still remembered: its retry changes nothing.
  auto retry = store->BeginPush({0, 0, 0, 1});
  ASSERT_TRUE(retry->Apply("v7", 0, g, 3).ok());
  EXPECT_EQ(retry->elements_skipped(), 3);
  EXPECT_THAT(ReadAll(store.get(), "v7", 3), ::testing::Each(-float{kPushes}));
  EXPECT_EQ(store->GetPart("v7")->version, kPushes);
}

// Pushes that leave gaps (sparse segments) keep ranges; the ledger forgets
// the oldest ids to stay near request_ledger_bytes, and the newest are still
// applied once.
TEST(VariableStoreTest, LedgerStaysNearItsByteBound) {
  auto store = SgdStore(0, 1, absl::Minutes(15), /*ledger_bytes=*/64 << 10);
  constexpr int64_t kElements = 1000;
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  const float g = 1;
  constexpr uint64_t kPushes = 200;  // 500 ranges each: 12 KB or more per id
  int64_t most = 0;
  for (uint64_t id = 1; id <= kPushes; ++id) {
    auto push = store->BeginPush({0, 0, 0, id});
    for (int64_t e = 0; e < kElements; e += 2) ASSERT_TRUE(push->Apply("w", e, &g, 1).ok());
    push->Finish(absl::OkStatus());
    most = std::max(most, store->stats().ledger_bytes);
  }
  // The bound plus the one id that is always kept.
  EXPECT_LE(most, (64 << 10) + (16 << 10));
  EXPECT_LT(store->stats().ledger_ids, static_cast<int64_t>(kPushes));
  EXPECT_GE(store->stats().ledger_ids, 1);
  // All of them within their retention: counted, and said on stderr.
  EXPECT_EQ(store->stats().ledger_ids_forgotten_early,
            static_cast<int64_t>(kPushes) - store->stats().ledger_ids);
  // The newest id is remembered; the first was forgotten and applies again.
  auto newest = store->BeginPush({0, 0, 0, kPushes});
  ASSERT_TRUE(newest->Apply("w", 0, &g, 1).ok());
  EXPECT_EQ(newest->elements_skipped(), 1);
  auto first = store->BeginPush({0, 0, 0, 1});
  ASSERT_TRUE(first->Apply("w", 0, &g, 1).ok());
  EXPECT_EQ(first->elements_applied(), 1);
  EXPECT_EQ(ReadAll(store.get(), "w", 1)[0], -float{kPushes + 1});
}

// An id passed over because its push was still applying keeps its place
// as the oldest: once idle, it is the first forgotten, not the newer ones.
TEST(VariableStoreTest, AnIdPassedOverWhileInUseIsStillTheOldest) {
  auto store = SgdStore(0, 1, absl::Minutes(15), /*ledger_bytes=*/64 << 10);
  RegisterFilled(store.get(), Def("w", {2}, 0, 2), 0.0f);
  const float g[2] = {1, 1};
  auto open = store->BeginPush({0, 0, 0, 1});
  ASSERT_TRUE(open->Apply("w", 0, g, 2).ok());
  // About 280 ids fit the bound: the older ones go, never id 1.
  for (uint64_t id = 2; id <= 400; ++id) {
    auto p = store->BeginPush({0, 0, 0, id});
    ASSERT_TRUE(p->Apply("w", 0, g, 2).ok());
  }
  open.reset();
  auto next = store->BeginPush({0, 0, 0, 401});
  ASSERT_TRUE(next->Apply("w", 0, g, 2).ok());  // id 1 goes now
  next.reset();
  auto again1 = store->BeginPush({0, 0, 0, 1});
  ASSERT_TRUE(again1->Apply("w", 0, g, 2).ok());
  EXPECT_EQ(again1->elements_applied(), 2);
  auto again400 = store->BeginPush({0, 0, 0, 400});
  ASSERT_TRUE(again400->Apply("w", 0, g, 2).ok());
  EXPECT_EQ(again400->elements_skipped(), 2);
}

// The bound holds when old records grow, not only when new ids come: ids
// created cheaply and then retried with sparse segments each grow a record
// of their own, and the shard forgets others to stay near the bound.
TEST(VariableStoreTest, LedgerStaysNearItsByteBoundWhenOldRecordsGrow) {
  auto store = SgdStore(0, 1, absl::Minutes(15), /*ledger_bytes=*/64 << 10);
  constexpr int64_t kElements = 4000;
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  const float g = 1;
  constexpr uint64_t kIds = 40;
  for (uint64_t id = 1; id <= kIds; ++id) {
    auto push = store->BeginPush({0, 0, 0, id});
    ASSERT_TRUE(push->Apply("w", 0, &g, 1).ok());
  }
  int64_t most = 0;
  for (uint64_t id = 1; id <= kIds; ++id) {
    auto retry = store->BeginPush({0, 0, 0, id});
    for (int64_t e = 2; e < 600; e += 2) ASSERT_TRUE(retry->Apply("w", e, &g, 1).ok());
    most = std::max(most, store->stats().ledger_bytes);
  }
  // 300 gaps (7 KB) in each of 40 records would be 290 KB; the bound plus
  // the record being written (at most a quarter of the bound) is 80 KiB.
  EXPECT_LE(most, (64 << 10) + (16 << 10));
  EXPECT_LT(store->stats().ledger_ids, static_cast<int64_t>(kIds));
  EXPECT_GT(store->stats().ledger_ids_forgotten_early, 0);
}

// One request id's record may take a quarter of the ledger's bytes: a push
// leaving more gaps is refused before the segment that would pass it, and
// what came before stays applied (as after any bad segment).
TEST(VariableStoreTest, PushLeavingTooManyGapsIsResourceExhausted) {
  auto store = SgdStore(0, 1, absl::Minutes(15), /*ledger_bytes=*/64 << 10);  // 16 KiB a record
  constexpr int64_t kElements = 4000;
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  const float g = 1;
  auto push = store->BeginPush({0, 0, 0, 42});
  absl::Status refused;
  int64_t e = 0;
  for (; e < kElements && refused.ok(); e += 2) refused = push->Apply("w", e, &g, 1);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("'w'"));
  EXPECT_THAT(refused.message(), HasSubstr("fewer, larger segments"));
  const int64_t applied = push->elements_applied();
  EXPECT_GT(applied, 500);
  EXPECT_LT(applied, kElements / 2);
  EXPECT_EQ(ReadAll(store.get(), "w", kElements)[e - 2], 0.0f);  // the refused one
  EXPECT_LE(store->stats().ledger_bytes, 64 << 10);
  // Filling the gaps merges ranges: the same id can still complete the part.
  std::vector<float> ones(kElements, 1.0f);
  ASSERT_TRUE(push->Apply("w", 0, ones.data(), kElements).ok());
  EXPECT_THAT(ReadAll(store.get(), "w", kElements), ::testing::Each(-1.0f));
}

// A push refused before anything of it is applied leaves no record: enough
// of them used to push a real push's id out of a small ledger, so that its
// retry was applied twice.
TEST(VariableStoreTest, RefusedPushesLeaveNoRecordAndForgetNoRealId) {
  auto store = SgdStore(0, 1, absl::Minutes(15), /*ledger_bytes=*/64 << 10);
  RegisterFilled(store.get(), Def("w", {4}, 0, 4), 0.0f);
  const float g[4] = {1, 1, 1, 1};
  const float nan[1] = {std::numeric_limits<float>::quiet_NaN()};
  {
    auto push = store->BeginPush({0, 0, 0, 1});
    ASSERT_TRUE(push->Apply("w", 0, g, 4).ok());
    push->Finish(absl::OkStatus());
  }
  for (uint64_t id = 100; id < 500; ++id) {
    auto push = store->BeginPush({0, 0, 0, id});
    absl::Status refused = id % 2 == 0 ? push->Apply("v", 0, g, 1)     // NOT_FOUND
                                       : push->Apply("w", 0, nan, 1);  // INVALID_ARGUMENT
    ASSERT_FALSE(refused.ok());
    push->Finish(refused);
  }
  const StoreStats stats = store->stats();
  EXPECT_EQ(stats.rejected_requests, 400);
  EXPECT_EQ(stats.ledger_ids, 1);
  EXPECT_EQ(stats.ledger_ids_forgotten_early, 0);
  // The first push's response was lost: its retry is skipped.
  auto retry = store->BeginPush({0, 0, 0, 1});
  ASSERT_TRUE(retry->Apply("w", 0, g, 4).ok());
  EXPECT_EQ(retry->elements_skipped(), 4);
  EXPECT_THAT(ReadAll(store.get(), "w", 4), ::testing::Each(-1.0f));
  EXPECT_EQ(store->GetPart("w")->version, 1);
}

// A segment refused for the gaps it would leave changes nothing, not even
// the ledger's count of the id's record.
TEST(VariableStoreTest, SegmentRefusedForGapsLeavesTheLedgerAsItWas) {
  auto store = SgdStore(0, 1, absl::Minutes(15), /*ledger_bytes=*/64 << 10);  // 16 KiB a record
  RegisterFilled(store.get(), Def("a", {100000}, 0, 100000), 0.0f);
  RegisterFilled(store.get(), Def("b", {10}, 0, 10), 0.0f);
  auto push = store->BeginPush({0, 0, 0, 9});
  const float g = 1;
  absl::Status refused;
  for (int64_t e = 0; refused.ok(); e += 2) refused = push->Apply("a", e, &g, 1);
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  const int64_t bytes = store->stats().ledger_bytes;
  // A part the id has not touched yet: its record would have to be made.
  refused = push->Apply("b", 0, &g, 1);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_EQ(store->stats().ledger_bytes, bytes);
  EXPECT_EQ(store->GetPart("b")->version, 0);
  EXPECT_EQ(ReadAll(store.get(), "b", 10)[0], 0.0f);
}

// The process's address space (VmSize), 0 where /proc has none.
int64_t VirtualBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmSize:")) return std::stoll(line.substr(7)) * 1024;
  }
  return 0;
}

// A segment that finds no memory for the copy a pull needs is refused and
// leaves the part as it was, its version (Adam's step count) and its record
// under the request id included; with
// memory again, the same id applies it as the part's first step. Prints what
// it saw.
void PushIntoAFullAddressSpace() {
  auto store = SgdStore();
  constexpr int64_t kStripe = VariableStore::kLockStripeElements;
  RegisterFilled(store.get(), Def("u", {4}, 0, 4), 0.0f);
  RegisterFilled(store.get(), Def("w", {kStripe}, 0, kStripe), 0.0f);
  std::vector<float> g(16, 1.0f);
  auto push = store->BeginPush({0, 0, 0, 3});
  // The id's record is made here, and the pull holds w's values: an update
  // of w needs a copy of its stripe.
  const bool first = push->Apply("u", 0, g.data(), 4).ok();
  std::vector<PinnedValues> pins;
  const bool pinned = store->Pin("w", 0, 16, &pins).ok();
  // Room for a record or two, not for the stripe's copy (256 KiB).
  rlimit before;
  getrlimit(RLIMIT_AS, &before);
  rlimit low = before;
  low.rlim_cur = static_cast<rlim_t>(VirtualBytes() + (64 << 10));
  const bool limited = setrlimit(RLIMIT_AS, &low) == 0;
  const int64_t ledger_before = store->stats().ledger_bytes;
  const absl::Status refused = push->Apply("w", 0, g.data(), 16);
  setrlimit(RLIMIT_AS, &before);
  const int64_t ledger_grew = store->stats().ledger_bytes - ledger_before;
  for (const PinnedValues& pin : pins) VariableStore::Unpin(pin.pin);
  const int64_t version = store->GetPart("w")->version;
  const float value = ReadAll(store.get(), "w", 1)[0];
  const bool again = push->Apply("w", 0, g.data(), 16).ok();
  std::fprintf(stderr,
               "first=%d pinned=%d limited=%d refused: %s; ledger +%lld, version %lld, w[0] %g; "
               "again=%d: version %lld, w[0] %g\n",
               first, pinned, limited, refused.ToString().c_str(),
               static_cast<long long>(ledger_grew), static_cast<long long>(version), value, again,
               static_cast<long long>(store->GetPart("w")->version),
               ReadAll(store.get(), "w", 1)[0]);
}

TEST(VariableStoreDeathTest, SegmentWithoutMemoryForACopyLeavesTheVersion) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's own mappings make an address-space limit meaningless";
#else
  // In a fresh process, whose heap has no free 256 KiB block to give.
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  EXPECT_EXIT((PushIntoAFullAddressSpace(), std::_Exit(0)), ::testing::ExitedWithCode(0),
              "first=1 pinned=1 limited=1 refused: RESOURCE_EXHAUSTED: .*nothing of elements "
              "\\[0,16\\) was applied; ledger \\+0, version 0, w\\[0\\] 0; again=1: version 1, "
              "w\\[0\\] -1\n");
#endif
}

// A push without a request id (0) has no retry protection and leaves nothing
// in the ledger.
TEST(VariableStoreTest, PushesWithoutRequestIdCostTheLedgerNothing) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {10}, 0, 10), 0.0f);
  const float g[10] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  for (int i = 0; i < 50; ++i) {
    auto push = store->BeginPush({0, 0, 0, 0});
    ASSERT_TRUE(push->Apply("w", 0, g, 4).ok());  // left unfinished: ranges
    push->Finish(absl::OkStatus());
  }
  EXPECT_EQ(store->stats().ledger_bytes, 0);
  EXPECT_EQ(store->stats().ledger_ids, 0);
  EXPECT_EQ(ReadAll(store.get(), "w", 10)[0], -50.0f);
}

TEST(VariableStoreTest, BadSegmentsChangeNothing) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {4}, 0, 4), 2.0f);
  const float g[5] = {1, 1, 1, 1, 1};
  const float nan[1] = {std::numeric_limits<float>::quiet_NaN()};
  auto push = store->BeginPush({0, 0, 0, 5});
  absl::Status unknown = push->Apply("v", 0, g, 1);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.message(), HasSubstr("holds w"));
  absl::Status too_long = push->Apply("w", 0, g, 5);
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_long.message(), HasSubstr("4 elements"));
  EXPECT_EQ(push->Apply("w", 0, nan, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ReadAll(store.get(), "w", 4), ::testing::Each(2.0f));
  EXPECT_EQ(store->GetPart("w")->version, 0);
  std::vector<float> out(2);
  EXPECT_EQ(store->Read("w", 3, 2, out.data()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(VariableStoreTest, NonFiniteGradientsCanBeAllowed) {
  VariableStoreOptions options;
  options.allow_non_finite_gradients = true;
  options.optimizer.kind = OptimizerOptions::Kind::kSgd;
  auto store = VariableStore::Create(options);
  ASSERT_TRUE(store.ok());
  RegisterFilled(store->get(), Def("w", {1}, 0, 1), 0.0f);
  const float inf = std::numeric_limits<float>::infinity();
  auto push = (*store)->BeginPush({0, 0, 0, 1});
  EXPECT_TRUE(push->Apply("w", 0, &inf, 1).ok());
  EXPECT_TRUE(std::isinf(ReadAll(store->get(), "w", 1)[0]));
}

// A push whose client says it found the gradient finite is not scanned
// again: the store trusts the header (a NaN under it is applied, which
// psflow's client never sends), and counts such pushes. Without the word,
// the same NaN is refused.
TEST(VariableStoreTest, GradientCheckedByTheClientIsNotScannedAgain) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {2}, 0, 2), 0.0f);
  const float g[2] = {1.0f, std::numeric_limits<float>::quiet_NaN()};
  PushHeaderInfo header{0, 0, 0, 1};
  EXPECT_EQ(store->BeginPush(header)->Apply("w", 0, g, 2).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->BeginPush(header)->Validate("w", 0, g, 2).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->stats().pushes_checked_by_client, 0);
  EXPECT_THAT(ReadAll(store.get(), "w", 2), ::testing::Each(0.0f));

  header.gradient_checked = true;
  auto push = store->BeginPush(header);
  EXPECT_TRUE(push->Validate("w", 0, g, 2).ok());
  EXPECT_TRUE(push->Apply("w", 0, g, 2).ok());
  const std::vector<float> values = ReadAll(store.get(), "w", 2);
  EXPECT_EQ(values[0], -1.0f);
  EXPECT_TRUE(std::isnan(values[1]));
  EXPECT_EQ(store->stats().pushes_checked_by_client, 1);
  // Ranges are still checked.
  EXPECT_EQ(push->Apply("w", 1, g, 2).code(), absl::StatusCode::kInvalidArgument);
}

TEST(VariableStoreTest, ConcurrentPushesToDifferentPartsAndTheSamePart) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("a", {1000}, 0, 1000), 0.0f);
  RegisterFilled(store.get(), Def("b", {1000}, 0, 1000), 0.0f);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> g(1000, 1.0f);
      for (int k = 0; k < 100; ++k) {
        auto p = store->BeginPush({t, k, 0, static_cast<uint64_t>(t * 1000 + k + 1)});
        ASSERT_TRUE(p->Apply("a", 0, g.data(), 1000).ok());
        ASSERT_TRUE(p->Apply("b", 0, g.data(), 1000).ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_THAT(ReadAll(store.get(), "a", 1000), ::testing::Each(-400.0f));
  EXPECT_THAT(ReadAll(store.get(), "b", 1000), ::testing::Each(-400.0f));
  EXPECT_EQ(store->GetPart("a")->version, 400);
}

TEST(VariableStoreTest, OneSessionAppliedFromSeveralThreadsEqualsInOrder) {
  // The server applies the messages of one push on several threads at once:
  // under Adam the result must be bit-identical to applying them in order,
  // with one step per push and every element counted once. (The chunks are
  // disjoint; that an update locks every stripe it writes is the next
  // test's.)
  constexpr int64_t kElements = 3 * VariableStore::kLockStripeElements + 1001;
  constexpr int64_t kChunk = 50'000;  // not a multiple of the stripe
  auto adam_store = [] {
    VariableStoreOptions options;  // Adam, Keras defaults
    auto store = VariableStore::Create(options);
    EXPECT_TRUE(store.ok()) << store.status();
    return std::move(*store);
  };
  auto in_order = adam_store(), parallel = adam_store();
  RegisterFilled(in_order.get(), Def("w", {kElements}, 0, kElements), 0.5f);
  RegisterFilled(parallel.get(), Def("w", {kElements}, 0, kElements), 0.5f);
  std::vector<float> g(kElements);
  for (int step = 1; step <= 3; ++step) {
    for (int64_t i = 0; i < kElements; ++i) g[i] = static_cast<float>((i * 7 + step) % 19) - 9.0f;
    const uint64_t id = step * 2 + 1;  // also with id 0 (no ledger) below
    for (uint64_t request_id : {id, uint64_t{0}}) {
      if (request_id == 0 && step != 3) continue;
      auto push = in_order->BeginPush({0, step, 0, request_id});
      for (int64_t o = 0; o < kElements; o += kChunk) {
        ASSERT_TRUE(push->Apply("w", o, g.data() + o, std::min(kChunk, kElements - o)).ok());
      }
      auto session = parallel->BeginPush({0, step, 0, request_id});
      std::vector<std::thread> threads;
      for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
          for (int64_t o = t * kChunk; o < kElements; o += 4 * kChunk) {
            ASSERT_TRUE(session->Apply("w", o, g.data() + o, std::min(kChunk, kElements - o)).ok());
          }
        });
      }
      for (auto& th : threads) th.join();
      EXPECT_EQ(session->elements_applied(), kElements);
      EXPECT_EQ(session->elements_skipped(), 0);
    }
  }
  EXPECT_EQ(ReadAll(parallel.get(), "w", kElements), ReadAll(in_order.get(), "w", kElements));
  EXPECT_NE(ReadAll(parallel.get(), "w", kElements)[0], 0.5f);
  EXPECT_EQ(parallel->GetPart("w")->version, 4);
}

TEST(VariableStoreTest, PushesAcrossLockStripesLoseNoUpdate) {
  // Pushes of different ids to overlapping ranges that start in different
  // lock stripes, from several threads released together each round, while
  // another reads: with SGD lr 1 and a gradient of 1 every element ends at
  // minus the number of pushes that covered it. An update that locks fewer
  // stripes than it writes loses some of them.
  constexpr int64_t kStripe = VariableStore::kLockStripeElements;
  constexpr int64_t kElements = 8 * kStripe;
  constexpr int kThreads = 4, kRounds = 60;
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  const std::vector<float> g(kElements, 1.0f);
  const int64_t begins[kThreads] = {0, kStripe + 5, 3 * kStripe - 1, 5 * kStripe + kStripe / 2};
  const int64_t ends[kThreads] = {kElements, kElements, 7 * kStripe + 1, kElements};
  std::atomic<bool> done{false};
  std::thread reader([&] {
    std::vector<float> out(kElements);
    while (!done) {
      ASSERT_TRUE(store->Read("w", 0, kElements, out.data()).ok());
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::barrier round(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < kRounds; ++k) {
        round.arrive_and_wait();
        auto p = store->BeginPush({t, k, 0, static_cast<uint64_t>(t * 1000 + k + 1)});
        EXPECT_TRUE(p->Apply("w", begins[t], g.data(), ends[t] - begins[t]).ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  done = true;
  reader.join();
  const std::vector<float> values = ReadAll(store.get(), "w", kElements);
  for (int64_t i = 0; i < kElements; ++i) {
    int covered = 0;
    for (int t = 0; t < kThreads; ++t) covered += begins[t] <= i && i < ends[t];
    ASSERT_EQ(values[i], -1.0f * kRounds * covered) << "element " << i;
  }
}

// Pinned values, released by Unpin when the holder goes out of scope.
class Pins {
 public:
  ~Pins() { Release(); }
  std::vector<PinnedValues>* out() { return &pins_; }
  void Release() {
    for (const PinnedValues& p : pins_) VariableStore::Unpin(p.pin);
    pins_.clear();
  }
  // The pinned values, in order.
  std::vector<float> Values() const {
    std::vector<float> out;
    for (const PinnedValues& p : pins_) {
      const size_t at = out.size();
      out.resize(at + p.bytes / 4);
      std::memcpy(out.data() + at, p.data, p.bytes);
    }
    return out;
  }
  size_t size() const { return pins_.size(); }

 private:
  std::vector<PinnedValues> pins_;
};

void PushOnes(VariableStore* store, const std::string& name, int64_t n, uint64_t id) {
  const std::vector<float> g(n, 1.0f);
  auto push = store->BeginPush({0, 0, 0, id});
  ASSERT_TRUE(push->Apply(name, 0, g.data(), n).ok());
  push->Finish(absl::OkStatus());
}

TEST(VariableStoreTest, PinnedValuesStayAsReadWhilePushesUpdateThem) {
  // Two and a half stripes with SGD lr 1: each push of ones takes 1 off.
  constexpr int64_t kElements = 5 * VariableStore::kLockStripeElements / 2;
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  Pins pins;
  auto version = store->Pin("w", 0, kElements, pins.out());
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 0);
  ASSERT_EQ(pins.size(), 3u);  // one per stripe
  EXPECT_EQ(pins.out()->back().bytes, VariableStore::kLockStripeElements / 2 * 4);

  PushOnes(store.get(), "w", kElements, 1);
  EXPECT_EQ(store->stats().stripes_copied_on_write, 3);
  EXPECT_EQ(ReadAll(store.get(), "w", kElements), std::vector<float>(kElements, -1.0f));
  EXPECT_EQ(pins.Values(), std::vector<float>(kElements, 0.0f));
  // The copies are the part's own: the next push writes them in place.
  PushOnes(store.get(), "w", kElements, 2);
  EXPECT_EQ(store->stats().stripes_copied_on_write, 3);
  EXPECT_EQ(pins.Values(), std::vector<float>(kElements, 0.0f));
  EXPECT_EQ(ReadAll(store.get(), "w", kElements), std::vector<float>(kElements, -2.0f));

  // Once no pull holds home, the next push brings the values back there,
  // so that a stripe keeps a second buffer only while a pull holds it.
  pins.Release();
  PushOnes(store.get(), "w", kElements, 3);
  EXPECT_EQ(store->stats().stripes_copied_on_write, 6);
  PushOnes(store.get(), "w", kElements, 4);
  EXPECT_EQ(store->stats().stripes_copied_on_write, 6);
  EXPECT_EQ(ReadAll(store.get(), "w", kElements), std::vector<float>(kElements, -4.0f));
}

TEST(VariableStoreTest, EachPinHoldsTheValuesItRead) {
  // Pins taken between pushes, held together and released out of order:
  // each keeps its own version, whichever buffer the stripe's values have
  // moved to since (home, copies, home again, a copy whose buffer another
  // copy had before).
  constexpr int64_t kStripe = VariableStore::kLockStripeElements;
  constexpr int64_t kElements = 2 * kStripe + 7;
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  constexpr int kPins = 5;
  Pins pins[kPins];
  for (int k = 0; k < kPins; ++k) {
    // A range that starts and ends inside stripes.
    ASSERT_TRUE(store->Pin("w", 3, kElements - 5, pins[k].out()).ok());
    PushOnes(store.get(), "w", kElements, k + 1);
    if (k == 2) pins[0].Release();  // home is free again
  }
  for (int k = 1; k < kPins; ++k) {
    EXPECT_EQ(pins[k].Values(), std::vector<float>(kElements - 5, -1.0f * k)) << "pin " << k;
  }
  EXPECT_EQ(ReadAll(store.get(), "w", kElements), std::vector<float>(kElements, -1.0f * kPins));
  EXPECT_EQ(store->stats().stripes_copied_on_write, 3 * kPins);
  pins[3].Release();
  pins[1].Release();  // their copies' buffers go back to the pool
  Pins last;
  ASSERT_TRUE(store->Pin("w", 0, kElements, last.out()).ok());
  PushOnes(store.get(), "w", kElements, kPins + 1);  // a copy again: home is held by pins[4]
  EXPECT_EQ(store->stats().stripes_copied_on_write, 3 * kPins + 3);
  EXPECT_EQ(pins[2].Values(), std::vector<float>(kElements - 5, -2.0f));
  EXPECT_EQ(pins[4].Values(), std::vector<float>(kElements - 5, -4.0f));
  EXPECT_EQ(last.Values(), std::vector<float>(kElements, -1.0f * kPins));
  EXPECT_EQ(ReadAll(store.get(), "w", kElements),
            std::vector<float>(kElements, -1.0f * (kPins + 1)));
}

TEST(VariableStoreTest, PinOutOfRangeIsRefusedAndPinsNothing) {
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {10}, 0, 10), 0.0f);
  Pins pins;
  auto past_end = store->Pin("w", 8, 3, pins.out());
  EXPECT_EQ(past_end.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(past_end.status().message(), HasSubstr("'w' covers elements [8,11)"));
  EXPECT_THAT(past_end.status().message(), HasSubstr("has 10 elements"));
  EXPECT_EQ(store->Pin("ghost", 0, 1, pins.out()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pins.size(), 0u);
  PushOnes(store.get(), "w", 10, 1);
  EXPECT_EQ(store->stats().stripes_copied_on_write, 0);
}

TEST(VariableStoreTest, PinnedValuesOutliveTheStore) {
  // gRPC may let go of a pulled message's slices after the server, and the
  // store, are gone.
  constexpr int64_t kElements = VariableStore::kLockStripeElements + 1;
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  Pins home, copy;
  ASSERT_TRUE(store->Pin("w", 0, kElements, home.out()).ok());
  PushOnes(store.get(), "w", kElements, 1);
  ASSERT_TRUE(store->Pin("w", 0, kElements, copy.out()).ok());
  store.reset();
  EXPECT_EQ(home.Values(), std::vector<float>(kElements, 0.0f));
  EXPECT_EQ(copy.Values(), std::vector<float>(kElements, -1.0f));
}

TEST(VariableStoreTest, PinsAndPushesFromManyThreadsNeverShareAWrite) {
  // Pushers update the whole part (one stripe lock hold each) while readers
  // pin it, check that the pinned values are one version (every element
  // equal), wait, and check that they have not changed. A push that wrote a
  // pinned stripe in place would change them (and ThreadSanitizer, which
  // runs this test, would report the race).
  constexpr int64_t kElements = 4 * VariableStore::kLockStripeElements;
  constexpr int kPushers = 2, kPinners = 2, kPushes = 40;
  auto store = SgdStore();
  RegisterFilled(store.get(), Def("w", {kElements}, 0, kElements), 0.0f);
  // However the threads are scheduled, the first pin is held until a push
  // has been applied: the pushers start once it is taken.
  std::atomic<int> pushing{kPushers}, pushes_done{0};
  std::atomic<bool> first_pin_taken{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kPushers; ++t) {
    threads.emplace_back([&, t] {
      while (!first_pin_taken) std::this_thread::yield();
      for (int k = 0; k < kPushes; ++k) {
        PushOnes(store.get(), "w", kElements, t * 1000 + k + 1);
        ++pushes_done;
      }
      --pushing;
    });
  }
  for (int t = 0; t < kPinners; ++t) {
    threads.emplace_back([&] {
      // Lets the pushers go however this thread ends (a failed ASSERT
      // returns from it), so that a failure is not a hang.
      struct Release {
        std::atomic<bool>* taken;
        ~Release() { *taken = true; }
      } release{&first_pin_taken};
      do {
        Pins pins;
        ASSERT_TRUE(store->Pin("w", 0, kElements, pins.out()).ok());
        const std::vector<float> first = pins.Values();
        ASSERT_EQ(std::count(first.begin(), first.end(), first[0]), kElements);
        if (!first_pin_taken.exchange(true)) {
          while (pushes_done == 0) std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(300));
        }
        ASSERT_EQ(pins.Values(), first);
      } while (pushing > 0);
    });
  }
  for (auto& th : threads) th.join();
  // At least the first push found its stripes pinned and copied them.
  EXPECT_GE(store->stats().stripes_copied_on_write, 4);
  EXPECT_EQ(ReadAll(store.get(), "w", kElements),
            std::vector<float>(kElements, -1.0f * kPushers * kPushes));
}

TEST(VariableStoreTest, DefaultVariableBytesLeavesRoomForTheRestOfTheProcess) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  EXPECT_EQ(DefaultVariableBytes(16384 * kMiB), 16384 * kMiB - 16384 * kMiB / 10);
  EXPECT_EQ(DefaultVariableBytes(512 * kMiB), 448 * kMiB);  // 64 MiB, more than a tenth
  EXPECT_EQ(DefaultVariableBytes(100 * kMiB), 50 * kMiB);    // never more than half
  EXPECT_EQ(DefaultVariableBytes(0), 0);                     // unknown: no bound
  // The store resolves 0 to it.
  auto store = SgdStore();
  EXPECT_EQ(store->max_variable_bytes(), DefaultVariableBytes(MemoryLimitBytes()));
  EXPECT_GT(store->max_variable_bytes(), 0);
}

TEST(VariableStoreTest, CreateValidatesOptions) {
  VariableStoreOptions options;
  options.shard_index = 2;
  options.num_shards = 2;
  EXPECT_EQ(VariableStore::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.shard_index = 0;
  options.optimizer.learning_rate = -1;
  EXPECT_EQ(VariableStore::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.optimizer.learning_rate = 0.1f;
  ASSERT_TRUE(VariableStore::Create(options).ok());
  options.request_ledger_bytes = 0;
  const absl::Status no_ledger = VariableStore::Create(options).status();
  EXPECT_EQ(no_ledger.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_ledger.message(), HasSubstr("request_ledger_bytes"));
  options.request_ledger_bytes = 1000;  // every push's first record would be refused
  EXPECT_THAT(VariableStore::Create(options).status().message(),
              HasSubstr("request_ledger_bytes (--request_ledger_bytes) is 1000; expected at "
                        "least 65536"));
  options.request_ledger_bytes = 1 << 20;
  options.request_id_retention = absl::Seconds(-1);
  const absl::Status negative = VariableStore::Create(options).status();
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.message(), HasSubstr("request_id_retention"));
}

}  // namespace
}  // namespace psflow::server
