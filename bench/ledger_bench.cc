// A push made of many small segments against the same elements sent as one
// segment, through VariableStore alone (no RPC). A client in another
// language may send one element per segment; the exactly-once ledger then
// records hundreds of thousands of ranges for one request id, in the order
// they come. Each iteration is one push (a fresh request id) of N
// one-element segments at every other element of a 2N-element part (SGD),
// so no two segments merge; the limit is the whole part as one segment
// (2N elements: twice the elements, so at most twice the time of N as one
// segment). Counters: ns per segment.
//
//   ledger_bench --benchmark_min_time=0.5
#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "ps_server/variable_store.h"

namespace psflow::server {
namespace {

enum Order { kIncreasing = 0, kDecreasing = 1, kRandom = 2, kOneSegment = 3 };

std::unique_ptr<VariableStore> StoreWithPart(int64_t elements) {
  VariableStoreOptions options;
  options.optimizer.kind = OptimizerOptions::Kind::kSgd;
  auto store = VariableStore::Create(options);
  if (!store.ok()) return nullptr;
  PartDefinition def;
  def.variable = "w";
  def.variable_shape = {elements};
  def.row_end = elements;
  auto reg = (*store)->BeginRegistration(1, 1, 0, {def});
  std::vector<float> zeros(elements, 0.0f);
  if (!reg.ok() || !(*reg)->AddValues("w", 0, zeros.data(), elements).ok() ||
      !(*reg)->Commit().ok()) {
    return nullptr;
  }
  return std::move(*store);
}

void BM_SmallSegments(benchmark::State& state) {
  const int64_t segments = state.range(0);
  const auto order = static_cast<Order>(state.range(1));
  auto store = StoreWithPart(2 * segments);
  if (store == nullptr) {
    state.SkipWithError("could not register the part");
    return;
  }
  std::vector<int64_t> offsets(segments);
  for (int64_t i = 0; i < segments; ++i) offsets[i] = 2 * i;
  if (order == kDecreasing) std::reverse(offsets.begin(), offsets.end());
  if (order == kRandom) std::shuffle(offsets.begin(), offsets.end(), std::mt19937_64(1));
  const std::vector<float> grad(2 * segments, 1e-3f);
  uint64_t request_id = 0;
  for (auto _ : state) {
    PushHeaderInfo header;
    header.request_id = ++request_id;
    auto push = store->BeginPush(header);
    if (order == kOneSegment) {
      if (!push->Apply("w", 0, grad.data(), 2 * segments).ok()) state.SkipWithError("apply");
    } else {
      for (int64_t offset : offsets) {
        if (!push->Apply("w", offset, grad.data(), 1).ok()) state.SkipWithError("apply");
      }
    }
  }
  state.counters["ns_per_segment"] = benchmark::Counter(
      static_cast<double>(segments), benchmark::Counter::kIsIterationInvariantRate |
                                         benchmark::Counter::kInvert);
  state.SetLabel(order == kIncreasing   ? "increasing"
                 : order == kDecreasing ? "decreasing"
                 : order == kRandom     ? "random"
                                        : "one segment (limit)");
}

// 350,000 one-element segments fill one 5 MiB message.
BENCHMARK(BM_SmallSegments)
    ->ArgsProduct({{40000, 350000}, {kIncreasing, kDecreasing, kRandom, kOneSegment}})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace psflow::server

BENCHMARK_MAIN();
