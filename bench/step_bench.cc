// step_bench: compute-only throughput of one ComputeBackend. Runs TrainStep
// (forward + backward, gradients of the mean loss) and Evaluate (forward
// only) on random images of the data set's shape, with no data loading, no
// optimizer and no communication, and reports images/s.
//
//   step_bench --device=cpu --model=seed --batch_size=64 --threads=1
//
// Prints a table and one JSON line (prefix "JSON "). The numbers for our
// machines are in docs/BENCHMARKS.md, "Worker compute (CPU)".
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/float_buffer.h"
#include "worker/backend.h"
#include "worker/model/model_def.h"

ABSL_FLAG(std::string, device, "cpu", "backend: cpu, cuda, reference or auto");
ABSL_FLAG(std::string, model, "seed", "model spec or built-in name (seed, two_conv)");
ABSL_FLAG(int, batch_size, 64, "examples per step");
ABSL_FLAG(int, threads, 1, "CPU threads the backend may use");
ABSL_FLAG(int, steps, 200, "timed steps per phase");
ABSL_FLAG(int, warmup, 20, "untimed steps before each phase");
ABSL_FLAG(bool, pin_host_memory, true,
          "let the backend pin the parameters and gradients of 256 KiB or more, as the "
          "worker does (cuda: copies go straight from and to them, not through staging)");
ABSL_FLAG(std::string, dataset, "fashion_mnist",
          "input shape to use: fashion_mnist or mnist (28x28x1), cifar10 (32x32x3); the images "
          "are random, nothing is read");

namespace psflow::worker {
namespace {

struct PhaseResult {
  double images_per_s = 0;  // batch * steps / total time
  double median_ms = 0;     // median step time
  double p90_ms = 0;
};

template <typename StepFn>
absl::StatusOr<PhaseResult> TimePhase(int warmup, int steps, int batch, StepFn step) {
  for (int i = 0; i < warmup; ++i) {
    if (absl::Status s = step(); !s.ok()) return s;
  }
  std::vector<double> ms;
  ms.reserve(steps);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = step(); !s.ok()) return s;
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::sort(ms.begin(), ms.end());
  PhaseResult r;
  r.images_per_s = static_cast<double>(batch) * steps / total_s;
  r.median_ms =
      ms.size() % 2 == 1 ? ms[ms.size() / 2] : (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]) / 2;
  r.p90_ms = ms[std::min(ms.size() - 1, ms.size() * 9 / 10)];
  return r;
}

absl::Status Run() {
  const std::string dataset = absl::GetFlag(FLAGS_dataset);
  Shape3 input;
  if (dataset == "fashion_mnist" || dataset == "mnist") {
    input = {28, 28, 1};
  } else if (dataset == "cifar10") {
    input = {32, 32, 3};
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--dataset=", dataset, ": expected fashion_mnist, mnist or cifar10"));
  }
  const int batch = absl::GetFlag(FLAGS_batch_size);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  if (batch < 1 || steps < 1 || warmup < 0) {
    return absl::InvalidArgumentError("--batch_size and --steps must be >= 1, --warmup >= 0");
  }
  absl::StatusOr<ModelDef> model = ParseModel(absl::GetFlag(FLAGS_model), input);
  if (!model.ok()) return model.status();
  BackendOptions options;
  options.threads = absl::GetFlag(FLAGS_threads);
  absl::StatusOr<std::unique_ptr<ComputeBackend>> backend =
      CreateBackend(absl::GetFlag(FLAGS_device), options);
  if (!backend.ok()) return backend.status();
  if (absl::Status s = (*backend)->Prepare(*model, batch); !s.ok()) return s;

  // FloatBuffers as in the trainer (big ones own their pages, so they can
  // be pinned one by one).
  std::vector<FloatBuffer> params, grads;
  std::vector<const float*> param_ptrs;
  std::vector<float*> grad_ptrs;
  int64_t num_params = 0;
  for (const auto& init : InitializeVariables(*model, 1)) {
    params.emplace_back(static_cast<int64_t>(init.size()));
    std::copy(init.begin(), init.end(), params.back().data());
    grads.emplace_back(static_cast<int64_t>(init.size()));
    num_params += static_cast<int64_t>(init.size());
  }
  for (size_t v = 0; v < params.size(); ++v) {
    param_ptrs.push_back(params[v].data());
    grad_ptrs.push_back(grads[v].data());
  }
  // Declared after the buffers: unpins them before they are freed.
  PinnedTensors pins(backend->get());
  if (absl::GetFlag(FLAGS_pin_host_memory)) {
    for (auto* tensors : {&params, &grads}) {
      for (FloatBuffer& t : *tensors) {
        if (absl::Status s = pins.Pin(t.data(), t.size()); !s.ok()) {
          absl::FPrintF(stderr, "step_bench: %s\n", s.message());  // staged instead
        }
      }
    }
  }
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> label(0, model->num_classes - 1);
  std::vector<float> images(batch * input.size());
  for (float& x : images) x = pixel(gen);
  std::vector<int32_t> labels(batch);
  for (int32_t& y : labels) y = label(gen);

  StepResult sink;
  absl::StatusOr<PhaseResult> train = TimePhase(warmup, steps, batch, [&] {
    return (*backend)->TrainStep(param_ptrs, images.data(), labels.data(), batch, grad_ptrs, &sink);
  });
  if (!train.ok()) return train.status();
  absl::StatusOr<PhaseResult> eval = TimePhase(warmup, steps, batch, [&] {
    return (*backend)->Evaluate(param_ptrs, images.data(), labels.data(), batch, &sink);
  });
  if (!eval.ok()) return eval.status();

  const std::string device = (*backend)->name();
  absl::PrintF(
      "step_bench: device=%s model=\"%s\" (%d parameters) input=%dx%dx%d batch=%d "
      "threads=%d steps=%d warmup=%d pinned_tensors=%d\n",
      device, model->spec, num_params, input.h, input.w, input.c, batch, options.threads, steps,
      warmup, pins.size());
  absl::PrintF("%-22s %12s %12s %12s\n", "phase", "images/s", "median ms", "p90 ms");
  absl::PrintF("%-22s %12.0f %12.3f %12.3f\n", "train (fwd+bwd)", train->images_per_s,
               train->median_ms, train->p90_ms);
  absl::PrintF("%-22s %12.0f %12.3f %12.3f\n", "eval (fwd)", eval->images_per_s, eval->median_ms,
               eval->p90_ms);
  absl::PrintF(
      "JSON {\"bench\":\"step_bench\",\"device\":\"%s\",\"model\":\"%s\",\"batch\":%d,"
      "\"threads\":%d,\"steps\":%d,\"train_images_per_s\":%.1f,\"train_median_ms\":%.3f,"
      "\"eval_images_per_s\":%.1f,\"eval_median_ms\":%.3f}\n",
      device, model->spec, batch, options.threads, steps, train->images_per_s, train->median_ms,
      eval->images_per_s, eval->median_ms);
  return absl::OkStatus();
}

}  // namespace
}  // namespace psflow::worker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = psflow::worker::Run(); !s.ok()) {
    absl::FPrintF(stderr, "step_bench: %s\n", s.ToString());
    return 1;
  }
  return 0;
}
