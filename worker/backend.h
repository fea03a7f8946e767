// ComputeBackend: forward and backward passes of a whole ModelDef on one
// device. Implementations: "reference" (plain loops, the tests' yardstick),
// "cpu" (oneDNN) and "cuda" (cuDNN + cuBLAS, built when CMake finds CUDA).
// The training loop sees only this interface, so neither it nor the tests
// need CUDA headers or a GPU.
#ifndef PSFLOW_WORKER_BACKEND_H_
#define PSFLOW_WORKER_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/model/model_def.h"

namespace psflow::worker {

struct StepResult {
  double loss_sum = 0;  // sum over the batch of the per-example loss
  int64_t correct = 0;  // examples whose arg-max logit equals the label
};

struct BackendOptions {
  int threads = 1;              // CPU threads the backend may use
  int device_index = 0;         // CUDA device
  double gpu_memory_limit_mb = 0;  // CUDA: cap on device memory (0 = no cap)
};

// Not thread-safe: one backend per training thread.
class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;
  virtual std::string name() const = 0;
  // Whether a batch's activations live in this process's memory (the CPU
  // backends) rather than a device's (which Prepare checks itself).
  virtual bool ActivationsInHostMemory() const { return true; }

  // Sets the backend up for `model` and batches of at most `max_batch`
  // examples; all buffers are allocated here, once, and reused by every step.
  virtual absl::Status Prepare(const ModelDef& model, int max_batch) = 0;

  // One forward and backward pass. `params[i]` points at variable i of the
  // model (host memory, row-major, Keras layout); `images` holds `batch` NHWC
  // float examples, `labels` their classes. Writes into `grads[i]` (host
  // memory, same layout as params[i]) the gradient of the MEAN loss over the
  // batch, and adds the batch's loss sum and correct count to `result`.
  virtual absl::Status TrainStep(absl::Span<const float* const> params, const float* images,
                                 const int32_t* labels, int batch,
                                 absl::Span<float* const> grads, StepResult* result) = 0;

  // Forward pass only (evaluation); adds to `result`.
  virtual absl::Status Evaluate(absl::Span<const float* const> params, const float* images,
                                const int32_t* labels, int batch, StepResult* result) = 0;

  // Optional: [data, data + bytes) is host memory the caller will pass as
  // params or grads, step after step. A GPU backend page-locks ("pins") it so
  // that steps copy straight between it and the device instead of through
  // staging buffers. The memory must stay allocated until UnpinHostMemory
  // (data) is called. An error means it was not pinned (steps still work
  // with it, through the staging buffers). CPU backends do nothing.
  virtual absl::Status PinHostMemory(void* data, size_t bytes) { return absl::OkStatus(); }
  virtual void UnpinHostMemory(void* data) {}
};

// Pins caller tensors for a backend (PinHostMemory) and unpins them when
// destroyed: declare it after the memory it pins, so that it goes first.
class PinnedTensors {
 public:
  explicit PinnedTensors(ComputeBackend* backend) : backend_(backend) {}
  ~PinnedTensors();
  PinnedTensors(const PinnedTensors&) = delete;
  PinnedTensors& operator=(const PinnedTensors&) = delete;

  // Pins `floats` floats at `data` when they fill at least
  // FloatBuffer::kOwnPagesBytes (held in a FloatBuffer, such a tensor owns
  // its pages; smaller ones cost little to stage). The backend's error when
  // it refuses: the tensor then goes through its staging buffers.
  absl::Status Pin(float* data, int64_t floats);
  size_t size() const { return pinned_.size(); }

 private:
  ComputeBackend* const backend_;
  std::vector<void*> pinned_;
};

// name: "reference", "cpu", "cuda" or "auto" (cuda when a GPU is visible,
// else cpu). Asking for "cuda" without a GPU or without a CUDA build is
// FAILED_PRECONDITION with a message saying which.
absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateBackend(const std::string& name,
                                                              const BackendOptions& options);

// True when the binary has the CUDA backend and a GPU is visible.
bool CudaAvailable();

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_BACKEND_H_
