// Factory of the CUDA backend (cuDNN + cuBLAS). This header has no CUDA
// includes: it is the only door into worker/cuda/.
#ifndef PSFLOW_WORKER_CUDA_CUDA_BACKEND_H_
#define PSFLOW_WORKER_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/backend.h"

namespace psflow::worker {

// FAILED_PRECONDITION when no GPU is visible (any CUDA error from
// cudaGetDeviceCount counts as "no GPU").
absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateCudaBackend(const BackendOptions& options);
// Number of visible GPUs; 0 on any CUDA error.
int CudaDeviceCount();

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_CUDA_CUDA_BACKEND_H_
