// The "reference" ComputeBackend: ReferenceNet<float> (reference_net.h)
// behind the ComputeBackend interface. Single-threaded whatever
// options.threads says; it exists to be obviously correct.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/backend.h"
#include "worker/cpu/cpu_backend.h"
#include "worker/cpu/reference_net.h"

namespace psflow::worker {
namespace {

class ReferenceBackend final : public ComputeBackend {
 public:
  std::string name() const override { return "reference"; }

  absl::Status Prepare(const ModelDef& model, int max_batch) override {
    return net_.Prepare(model, max_batch);
  }

  absl::Status TrainStep(absl::Span<const float* const> params, const float* images,
                         const int32_t* labels, int batch, absl::Span<float* const> grads,
                         StepResult* result) override {
    return net_.Run(params, images, labels, batch, grads, /*train=*/true, result);
  }

  absl::Status Evaluate(absl::Span<const float* const> params, const float* images,
                        const int32_t* labels, int batch, StepResult* result) override {
    return net_.Run(params, images, labels, batch, {}, /*train=*/false, result);
  }

 private:
  reference::ReferenceNet<float> net_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateReferenceBackend(
    const BackendOptions& options) {
  return std::make_unique<ReferenceBackend>();
}

}  // namespace psflow::worker
