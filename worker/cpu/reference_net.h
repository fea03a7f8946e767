// ReferenceNet<T>: a whole ModelDef's forward and backward pass built from
// the reference ops (reference_ops.h), templated on the scalar type. The
// "reference" ComputeBackend is ReferenceNet<float>; tests run
// ReferenceNet<double> for finite-difference checks and as the yardstick for
// the other backends. Not thread-safe.
#ifndef PSFLOW_WORKER_CPU_REFERENCE_NET_H_
#define PSFLOW_WORKER_CPU_REFERENCE_NET_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "worker/backend.h"
#include "worker/cpu/reference_ops.h"
#include "worker/model/model_def.h"

namespace psflow::worker::reference {

// The argument checks every backend's TrainStep/Evaluate makes: `num_params`
// (and, when training, `num_grads`) equal model.variables.size(), 1 <= batch
// <= max_batch, every label in [0, num_classes). INVALID_ARGUMENT otherwise.
inline absl::Status ValidateStep(const ModelDef& model, int max_batch, size_t num_params,
                                 const size_t* num_grads, const int32_t* labels, int batch) {
  if (num_params != model.variables.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", model.variables.size(), " parameter arrays, got ", num_params));
  }
  if (num_grads != nullptr && *num_grads != model.variables.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", model.variables.size(), " gradient arrays, got ", *num_grads));
  }
  if (batch < 1 || batch > max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("batch must be in [1, ", max_batch,
                                                   "] (max_batch given to Prepare), got ", batch));
  }
  for (int b = 0; b < batch; ++b) {
    if (labels[b] < 0 || labels[b] >= model.num_classes) {
      return absl::InvalidArgumentError(absl::StrCat("label of example ", b, " is ", labels[b],
                                                     "; expected a class in [0, ",
                                                     model.num_classes, ")"));
    }
  }
  return absl::OkStatus();
}

template <typename T>
class ReferenceNet {
 public:
  // Allocates every activation and gradient buffer for `max_batch` examples.
  absl::Status Prepare(const ModelDef& model, int max_batch) {
    if (max_batch < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_batch must be positive, got ", max_batch));
    }
    if (model.layers.empty()) return absl::InvalidArgumentError("model has no layers");
    model_ = model;
    max_batch_ = max_batch;
    acts_.assign(model_.layers.size(), {});
    d_acts_.assign(model_.layers.size(), {});
    for (size_t i = 0; i < model_.layers.size(); ++i) {
      acts_[i].assign(max_batch * model_.layers[i].output.size(), T{0});
      d_acts_[i].assign(max_batch * model_.layers[i].output.size(), T{0});
    }
    return absl::OkStatus();
  }

  // Forward pass and, when `grads` is non-empty, backward pass writing the
  // gradient of the mean loss into grads[i] (same layout as params[i]).
  // Adds the batch's loss sum and correct count to *result.
  absl::Status Run(absl::Span<const T* const> params, const T* images, const int32_t* labels,
                   int batch, absl::Span<T* const> grads, bool train, StepResult* result) {
    if (max_batch_ == 0) {
      return absl::FailedPreconditionError("reference backend: Prepare was not called");
    }
    if (images == nullptr || labels == nullptr) {
      return absl::InvalidArgumentError("images and labels must not be null");
    }
    for (size_t v = 0; v < params.size() && v < model_.variables.size(); ++v) {
      if (params[v] == nullptr || (train && v < grads.size() && grads[v] == nullptr)) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter or gradient array of ", model_.variables[v].name, " is null"));
      }
    }
    const size_t num_grads = grads.size();
    if (absl::Status s = ValidateStep(model_, max_batch_, params.size(),
                                      train ? &num_grads : nullptr, labels, batch);
        !s.ok()) {
      return s;
    }
    const int n = static_cast<int>(model_.layers.size());
    for (int i = 0; i < n; ++i) {
      const LayerDef& l = model_.layers[i];
      const T* x = i == 0 ? images : acts_[i - 1].data();
      T* y = acts_[i].data();
      switch (l.kind) {
        case LayerKind::kConv2D:
          Conv2DForward(l, batch, x, params[l.kernel_var], params[l.bias_var], y);
          break;
        case LayerKind::kMaxPool2D:
          MaxPoolForward(l, batch, x, y);
          break;
        case LayerKind::kFlatten:
          std::copy(x, x + batch * l.input.size(), y);
          break;
        case LayerKind::kDense:
          DenseForward(l, batch, x, params[l.kernel_var], params[l.bias_var], y);
          break;
      }
      if (l.relu) ReluForward(batch * l.output.size(), y);
    }
    int64_t correct = 0;
    const double loss = SoftmaxCrossEntropy(batch, model_.num_classes, acts_[n - 1].data(), labels,
                                            train ? d_acts_[n - 1].data() : nullptr, &correct);
    if (train) Backward(params, images, batch, grads);
    result->loss_sum += loss;
    result->correct += correct;
    return absl::OkStatus();
  }

  // Output of layer i (after its relu) from the last Run, [batch, output].
  const T* activation(int i) const { return acts_[i].data(); }
  const ModelDef& model() const { return model_; }
  int max_batch() const { return max_batch_; }

 private:
  void Backward(absl::Span<const T* const> params, const T* images, int batch,
                absl::Span<T* const> grads) {
    for (size_t v = 0; v < model_.variables.size(); ++v) {
      std::fill(grads[v], grads[v] + model_.variables[v].num_elements(), T{0});
    }
    for (int i = static_cast<int>(model_.layers.size()) - 1; i >= 0; --i) {
      const LayerDef& l = model_.layers[i];
      const T* x = i == 0 ? images : acts_[i - 1].data();
      T* dy = d_acts_[i].data();
      T* dx = i == 0 ? nullptr : d_acts_[i - 1].data();
      if (l.relu) ReluBackward(batch * l.output.size(), acts_[i].data(), dy);
      switch (l.kind) {
        case LayerKind::kConv2D:
          Conv2DBackward(l, batch, x, params[l.kernel_var], dy, dx, grads[l.kernel_var],
                         grads[l.bias_var]);
          break;
        case LayerKind::kMaxPool2D:
          if (dx != nullptr) MaxPoolBackward(l, batch, x, dy, dx);
          break;
        case LayerKind::kFlatten:
          if (dx != nullptr) std::copy(dy, dy + batch * l.output.size(), dx);
          break;
        case LayerKind::kDense:
          DenseBackward(l, batch, x, params[l.kernel_var], dy, dx, grads[l.kernel_var],
                        grads[l.bias_var]);
          break;
      }
    }
  }

  ModelDef model_;
  int max_batch_ = 0;
  std::vector<std::vector<T>> acts_;    // acts_[i]: output of layer i
  std::vector<std::vector<T>> d_acts_;  // d_acts_[i]: d(mean loss)/d(acts_[i])
};

}  // namespace psflow::worker::reference

#endif  // PSFLOW_WORKER_CPU_REFERENCE_NET_H_
