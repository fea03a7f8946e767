// Factories of the CPU backends: "reference" (plain C++ loops, the yardstick
// every other backend is tested against) and "cpu" (oneDNN primitives).
#ifndef PSFLOW_WORKER_CPU_CPU_BACKEND_H_
#define PSFLOW_WORKER_CPU_CPU_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/backend.h"

namespace psflow::worker {

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateReferenceBackend(
    const BackendOptions& options);
absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateOneDnnBackend(const BackendOptions& options);

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_CPU_CPU_BACKEND_H_
