// Optimizer kernels against the machine's memory bandwidth, measured in the
// same run: a STREAM triad (a[i] = b[i] + s * c[i], counted as STREAM does,
// 3 arrays x 4 bytes = 12 bytes per element) next to Adam (28 bytes per
// element: reads p, m, v, g, writes p, m, v), SGD and Adagrad.
//
// Sizes: 16M elements (far out of cache) and 2,768,896 elements (the seed
// model's dense kernel, 21632 x 128). Each benchmark with threads:T splits the
// range into T contiguous slices, one per benchmark thread (std::thread),
// as the PS's threads split a variable into parts. Arrays are allocated and
// first-touched once per size, outside the timed loop, and reused.
//
// After the runs a summary prints Adam's bandwidth as a fraction of triad's.
//
//   optimizer_bench --benchmark_repetitions=3 --benchmark_min_time=0.2
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/kernel_clones.h"
#include "common/tensor_checks.h"
#include "ps_server/optimizer.h"

namespace psflow::server {
namespace {

constexpr int64_t kOutOfCache = int64_t{1} << 24;  // 16M floats = 64 MiB per array
constexpr int64_t kModelSize = 21632 * 128;        // 2,768,896

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using FloatArray = std::unique_ptr<float[], FreeDeleter>;

// 2 MiB aligned so that transparent huge pages can back it; first-touched
// here (filled with `value`) so no page fault lands in a timed loop.
FloatArray Allocate(int64_t n, float value) {
  constexpr size_t kAlign = size_t{2} << 20;
  const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + kAlign - 1) / kAlign * kAlign;
  float* p = static_cast<float*>(std::aligned_alloc(kAlign, bytes));
  if (p == nullptr) {
    std::fprintf(stderr, "optimizer_bench: cannot allocate %zu bytes\n", bytes);
    std::abort();
  }
  madvise(p, bytes, MADV_HUGEPAGE);  // advisory; ignore failure
  std::fill(p, p + n, value);
  return FloatArray(p);
}

// Four arrays per size: param, two slots, gradient. Adam, SGD and Adagrad at
// the same size share them (each update keeps the values finite). Triad uses
// the first three as a, b, c in its own set.
struct Arrays {
  FloatArray a, b, c, d, e;  // e: a third optimizer slot (AMSGrad)
};

Arrays& GetArrays(const std::string& what, int64_t n) {
  static std::mutex mu;
  static auto* arrays = new std::map<std::pair<std::string, int64_t>, Arrays>();
  std::lock_guard<std::mutex> lock(mu);
  Arrays& arr = (*arrays)[{what, n}];
  if (arr.a == nullptr) {
    arr.a = Allocate(n, 0.5f);
    arr.b = Allocate(n, 0.0f);
    arr.c = Allocate(n, 0.0f);
    arr.d = Allocate(n, 0.0f);
    arr.e = Allocate(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      arr.d[i] = static_cast<float>((i * 2654435761u) % 2001u) / 1000.0f - 1.0f;  // in [-1, 1]
    }
    if (what == "triad") std::fill(arr.c.get(), arr.c.get() + n, 2.0f);
  }
  return arr;
}

// This thread's slice of [0, n), 16-element aligned.
std::pair<int64_t, int64_t> Slice(const benchmark::State& state, int64_t n) {
  const int64_t t = state.threads(), i = state.thread_index();
  auto edge = [&](int64_t k) { return k == t ? n : (n * k / t) & ~int64_t{15}; };
  return {edge(i), edge(i + 1)};
}

PSFLOW_KERNEL_CLONES
void Triad(float* __restrict a, const float* __restrict b, const float* __restrict c, int64_t n,
           float s) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

void SetCounters(benchmark::State& state, int64_t elements, int64_t bytes_per_element) {
  state.SetItemsProcessed(state.iterations() * elements);
  state.SetBytesProcessed(state.iterations() * elements * bytes_per_element);
}

void BM_Triad(benchmark::State& state) {
  const int64_t n = state.range(0);
  Arrays& arr = GetArrays("triad", n);
  const auto [lo, hi] = Slice(state, n);
  for (auto _ : state) {
    Triad(arr.a.get() + lo, arr.b.get() + lo, arr.c.get() + lo, hi - lo, 3.0f);
    benchmark::ClobberMemory();
  }
  SetCounters(state, hi - lo, 12);
}

OptimizerOptions Options(OptimizerOptions::Kind kind, float momentum) {
  OptimizerOptions o;
  o.kind = kind;
  o.momentum = momentum;
  return o;
}

// `call` > 0: Apply on that many elements at a time, as the shard applies
// a segment one lock stripe (64K elements) at a time.
void RunOptimizer(benchmark::State& state, const OptimizerOptions& options,
                  int64_t bytes_per_element, int64_t call = 0) {
  const int64_t n = state.range(0);
  Arrays& arr = GetArrays("optimizer", n);
  absl::StatusOr<std::unique_ptr<Optimizer>> made = Optimizer::Create(options);
  if (!made.ok()) std::abort();
  const std::unique_ptr<Optimizer> opt = *std::move(made);
  const auto [lo, hi] = Slice(state, n);
  float* slots[] = {arr.b.get() + lo, arr.c.get() + lo, arr.e.get() + lo};
  if (options.kind == OptimizerOptions::Kind::kAdagrad) {
    std::fill(slots[0], slots[0] + (hi - lo), 0.1f);
  }
  if (call <= 0) call = hi - lo;
  int64_t step = 0;
  for (auto _ : state) {
    ++step;
    for (int64_t at = lo; at < hi; at += call) {
      const int64_t k = std::min(call, hi - at);
      float* at_slots[] = {slots[0] + (at - lo), slots[1] + (at - lo), slots[2] + (at - lo)};
      opt->Apply(step, arr.a.get() + at, at_slots, arr.d.get() + at, k);
    }
    benchmark::ClobberMemory();
  }
  SetCounters(state, hi - lo, bytes_per_element);
}

void RunOptimizer(benchmark::State& state, OptimizerOptions::Kind kind, float momentum,
                  int64_t bytes_per_element) {
  RunOptimizer(state, Options(kind, momentum), bytes_per_element);
}

constexpr int64_t kStripe = int64_t{1} << 16;  // the shard's lock stripe

void BM_Adam(benchmark::State& state) {
  RunOptimizer(state, OptimizerOptions::Kind::kAdam, 0.0f, 28);
}
// The same in the shard's stripe-sized calls, against which the two below
// compare.
void BM_AdamStripes(benchmark::State& state) {
  RunOptimizer(state, Options(OptimizerOptions::Kind::kAdam, 0), 28, kStripe);
}
// AdamW: the weight decay's own pass over each stripe's parameters finds
// them in cache, so the bytes from memory are Adam's.
void BM_AdamWStripes(benchmark::State& state) {
  OptimizerOptions o = Options(OptimizerOptions::Kind::kAdam, 0);
  o.weight_decay = 0.004;
  RunOptimizer(state, o, 28, kStripe);
}
// AMSGrad reads and writes v_hat too: 36 bytes an element.
void BM_AmsgradStripes(benchmark::State& state) {
  OptimizerOptions o = Options(OptimizerOptions::Kind::kAdam, 0);
  o.amsgrad = true;
  RunOptimizer(state, o, 36, kStripe);
}
void BM_SgdPlain(benchmark::State& state) {  // reads p, g; writes p
  RunOptimizer(state, OptimizerOptions::Kind::kSgd, 0.0f, 12);
}
void BM_SgdMomentum(benchmark::State& state) {  // reads p, m, g; writes p, m
  RunOptimizer(state, OptimizerOptions::Kind::kSgd, 0.9f, 20);
}
void BM_Adagrad(benchmark::State& state) {  // reads p, acc, g; writes p, acc
  RunOptimizer(state, OptimizerOptions::Kind::kAdagrad, 0.0f, 20);
}
void BM_Rmsprop(benchmark::State& state) {  // reads p, v, g; writes p, v
  RunOptimizer(state, OptimizerOptions::Kind::kRmsprop, 0.0f, 20);
}
void BM_Lion(benchmark::State& state) {  // reads p, m, g; writes p, m
  OptimizerOptions o = Options(OptimizerOptions::Kind::kLion, 0.0f);
  o.beta_2 = 0.99;
  RunOptimizer(state, o, 20);
}
// Centered with momentum: reads p, v, u, a, g; writes p, v, u, a.
void BM_RmspropCenteredMomentum(benchmark::State& state) {
  OptimizerOptions o = Options(OptimizerOptions::Kind::kRmsprop, 0.9f);
  o.centered = true;
  RunOptimizer(state, o, 36);
}

// The NaN/Inf scan of a gradient (4 bytes read per element) as a push's
// client runs it before sending: on range(1) threads of its own
// (AnyNonFinite, the caller's among them), in parts of 1 MiB or more here
// (16 MiB by default) so that the seed model's size is split too. It
// reads the optimizer's gradient array of the same size.
void BM_NonFiniteScan(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  Arrays& arr = GetArrays("optimizer", n);
  const std::vector<FloatRange> grad = {{arr.d.get(), n}};
  for (auto _ : state) {
    if (AnyNonFinite(grad, threads, /*min_part=*/int64_t{1} << 18)) std::abort();
  }
  SetCounters(state, n, 4);
}

BENCHMARK(BM_Triad)->Arg(kOutOfCache)->Arg(kModelSize)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_NonFiniteScan)
    ->Args({kOutOfCache, 1})
    ->Args({kOutOfCache, 2})
    ->Args({kModelSize, 1})
    ->Args({kModelSize, 2})
    ->UseRealTime();
BENCHMARK(BM_Adam)->Arg(kOutOfCache)->Arg(kModelSize)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_AdamStripes)->Arg(kOutOfCache)->Threads(1)->UseRealTime();
BENCHMARK(BM_AdamWStripes)->Arg(kOutOfCache)->Threads(1)->UseRealTime();
BENCHMARK(BM_AmsgradStripes)->Arg(kOutOfCache)->Threads(1)->UseRealTime();
BENCHMARK(BM_SgdPlain)->Arg(kOutOfCache)->Threads(1)->UseRealTime();
BENCHMARK(BM_SgdMomentum)->Arg(kOutOfCache)->Threads(1)->UseRealTime();
BENCHMARK(BM_Adagrad)->Arg(kOutOfCache)->Threads(1)->UseRealTime();
BENCHMARK(BM_Rmsprop)->Arg(kOutOfCache)->Threads(1)->UseRealTime();
BENCHMARK(BM_Lion)->Arg(kOutOfCache)->Threads(1)->UseRealTime();
BENCHMARK(BM_RmspropCenteredMomentum)->Arg(kOutOfCache)->Threads(1)->UseRealTime();

// Prints as usual and keeps every repetition's rates for the summary, which
// gives the median and the best repetition (STREAM reports its best of N).
// "on-CPU" is the benchmark threads' CPU time over their wall time: below
// ~95% the machine was shared and the wall-clock rates understate it.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  SummaryReporter() : ConsoleReporter(isatty(fileno(stdout)) ? OO_Defaults : OO_Tabular) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred || run.run_type != Run::RT_Iteration) continue;
      Sample s;
      s.bytes_per_second = run.counters.at("bytes_per_second");
      s.items_per_second = run.counters.at("items_per_second");
      s.on_cpu = run.cpu_accumulated_time / static_cast<double>(run.threads) /
                 run.real_accumulated_time;
      samples_[Key(run.run_name.function_name, run.run_name.args, run.run_name.threads)]
          .push_back(s);
    }
  }

  void PrintSummary() const {
    std::printf(
        "\nAdam vs STREAM triad (GB = 1e9 bytes). wall: median|best of the repetitions;\n"
        "cpu: the median's bytes per second of CPU time (1 thread); on-CPU: triad|Adam\n"
        "CPU time over wall time per thread, below ~95%% the machine was shared.\n");
    std::printf("%-9s %-3s %13s %13s %11s | %8s %8s %6s | %11s %9s %9s\n", "elements", "thr",
                "triad wall", "Adam wall", "ratio", "triad cpu", "Adam cpu", "ratio",
                "Adam Melem/s", "ms/update", "on-CPU");
    for (int64_t n : {kOutOfCache, kModelSize}) {
      for (int threads : {1, 2}) {
        const std::string t = "threads:" + std::to_string(threads);
        const Stats triad = Get(Key("BM_Triad", std::to_string(n), t));
        const Stats adam = Get(Key("BM_Adam", std::to_string(n), t));
        if (triad.count == 0 || adam.count == 0) continue;
        // With 2 threads the CPU-time rate is only meaningful if they ran at
        // the same time, which their CPU time cannot tell: shown for 1 only.
        char cpu[64] = "       -        -      -";
        if (threads == 1) {
          std::snprintf(cpu, sizeof(cpu), "%8.2f %8.2f %5.0f%%", triad.median.CpuRate() / 1e9,
                        adam.median.CpuRate() / 1e9,
                        100 * adam.median.CpuRate() / triad.median.CpuRate());
        }
        std::printf("%-9lld %-3d %13s %13s %11s | %s | %11s %9.3f %9s\n",
                    static_cast<long long>(n), threads,
                    Pair(triad.median.bytes_per_second / 1e9, triad.best.bytes_per_second / 1e9,
                         "%.2f").c_str(),
                    Pair(adam.median.bytes_per_second / 1e9, adam.best.bytes_per_second / 1e9,
                         "%.2f").c_str(),
                    Pair(100 * adam.median.bytes_per_second / triad.median.bytes_per_second,
                         100 * adam.best.bytes_per_second / triad.best.bytes_per_second, "%.0f%%")
                        .c_str(),
                    cpu, Pair(adam.median.items_per_second / 1e6, adam.best.items_per_second / 1e6,
                         "%.0f").c_str(),
                    1e3 * static_cast<double>(n) / adam.median.items_per_second,
                    Pair(100 * triad.median.on_cpu, 100 * adam.median.on_cpu, "%.0f%%").c_str());
      }
    }
    std::printf("\nAll kernels at %lld elements, 1 thread\n", static_cast<long long>(kOutOfCache));
    std::printf("%-15s %6s %13s %11s | %8s %6s | %11s %6s\n", "kernel", "B/elem", "GB/s wall",
                "vs triad", "GB/s cpu", "vs triad", "Melem/s", "on-CPU");
    const Stats triad = Get(Key("BM_Triad", std::to_string(kOutOfCache), "threads:1"));
    const std::pair<const char*, int> kernels[] = {
        {"BM_Triad", 12}, {"BM_Adam", 28}, {"BM_SgdPlain", 12}, {"BM_SgdMomentum", 20},
        {"BM_Adagrad", 20}};
    for (const auto& [name, bytes] : kernels) {
      const Stats k = Get(Key(name, std::to_string(kOutOfCache), "threads:1"));
      if (k.count == 0 || triad.count == 0) continue;
      std::printf(
          "%-15s %6d %13s %11s | %8.2f %5.0f%% | %11s %5.0f%%\n", name, bytes,
          Pair(k.median.bytes_per_second / 1e9, k.best.bytes_per_second / 1e9, "%.2f").c_str(),
          Pair(100 * k.median.bytes_per_second / triad.median.bytes_per_second,
               100 * k.best.bytes_per_second / triad.best.bytes_per_second, "%.0f%%")
              .c_str(),
          k.median.CpuRate() / 1e9, 100 * k.median.CpuRate() / triad.median.CpuRate(),
          Pair(k.median.items_per_second / 1e6, k.best.items_per_second / 1e6, "%.0f").c_str(),
          100 * k.median.on_cpu);
    }
  }

 private:
  struct Sample {
    double bytes_per_second = 0, items_per_second = 0, on_cpu = 0;
    double CpuRate() const { return bytes_per_second / on_cpu; }
  };
  static std::string Pair(double a, double b, const char* format) {
    char buf[64];
    const std::string f = std::string(format) + "|" + format;
    std::snprintf(buf, sizeof(buf), f.c_str(), a, b);
    return buf;
  }
  struct Stats {
    size_t count = 0;
    Sample median, best;  // by bytes_per_second
  };
  static std::string Key(const std::string& function, const std::string& args,
                         const std::string& threads) {
    return function + "/" + args + "/" + threads;
  }
  Stats Get(const std::string& key) const {
    Stats st;
    auto it = samples_.find(key);
    if (it == samples_.end() || it->second.empty()) return st;
    std::vector<Sample> v = it->second;
    std::sort(v.begin(), v.end(), [](const Sample& a, const Sample& b) {
      return a.bytes_per_second < b.bytes_per_second;
    });
    st.count = v.size();
    st.median = v[v.size() / 2];
    st.best = v.back();
    return st;
  }
  std::map<std::string, std::vector<Sample>> samples_;
};

}  // namespace
}  // namespace psflow::server

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  psflow::server::SummaryReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintSummary();
  benchmark::Shutdown();
  return 0;
}
