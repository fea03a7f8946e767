#include "worker/backend.h"

#include "absl/strings/str_cat.h"
#include "common/float_buffer.h"
#include "common/status_macros.h"
#include "worker/cpu/cpu_backend.h"
#ifdef PSFLOW_HAVE_CUDA
#include "worker/cuda/cuda_backend.h"
#endif

namespace psflow::worker {

PinnedTensors::~PinnedTensors() {
  for (void* p : pinned_) backend_->UnpinHostMemory(p);
}

absl::Status PinnedTensors::Pin(float* data, int64_t floats) {
  const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
  if (bytes < FloatBuffer::kOwnPagesBytes) return absl::OkStatus();
  PSFLOW_RETURN_IF_ERROR(backend_->PinHostMemory(data, bytes));
  pinned_.push_back(data);
  return absl::OkStatus();
}

bool CudaAvailable() {
#ifdef PSFLOW_HAVE_CUDA
  return CudaDeviceCount() > 0;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateBackend(const std::string& name,
                                                              const BackendOptions& options) {
  if (name == "reference") return CreateReferenceBackend(options);
  if (name == "cpu") return CreateOneDnnBackend(options);
  if (name == "auto") {
    if (CudaAvailable()) {
#ifdef PSFLOW_HAVE_CUDA
      return CreateCudaBackend(options);
#endif
    }
    return CreateOneDnnBackend(options);
  }
  if (name == "cuda") {
#ifdef PSFLOW_HAVE_CUDA
    return CreateCudaBackend(options);
#else
    return absl::FailedPreconditionError(
        "--device=cuda: this worker was built without CUDA (CMake did not find nvcc and "
        "cuDNN); use --device=cpu or rebuild on a machine with the CUDA toolkit");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device \"", name, "\"; expected auto, cpu, cuda or reference"));
}

}  // namespace psflow::worker
