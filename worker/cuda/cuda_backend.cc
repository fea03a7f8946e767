// The "cuda" ComputeBackend: cuDNN convolutions, pooling and ReLU, cuBLAS
// GEMMs for dense layers and bias gradients, and our own kernels for the
// rest (cuda_kernels.cu). Everything runs on one stream of one device.
//
// Memory: Prepare measures every buffer (parameters, gradients, activations,
// cuDNN and cuBLAS workspaces) with the same code that later carves them out
// of ONE device allocation, checks the total against gpu_memory_limit_mb,
// and allocates once; steps never allocate. Parameters go in and gradients
// come out straight from and to the caller's memory where the caller pinned
// it (PinHostMemory: the trainer pins its big tensors), else through pinned
// staging buffers (one extra host copy per direction per step).
//
// Precision: plain FP32 everywhere (cuBLAS default math, cuDNN FMA math);
// no TF32, so results agree with the CPU backends to FP32 rounding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_kernels.h"
#include "worker/cuda/cuda_plan.h"
#include "worker/cuda/device_arena.h"

namespace psflow::worker {
namespace cuda_internal {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // cuBLAS' advice for Hopper
constexpr size_t kMaxConvWorkspaceBytes = size_t{1} << 30;
constexpr size_t kConvWorkspaceSlackBytes = size_t{16} << 20;
constexpr float kOne = 1.0f, kZero = 0.0f;

double Mb(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// Device pointers of one layer, all slices of the arena. Without padding,
// xpad == x and dxpad == dx; without relu, z == y and dz == dy. dx is null
// when no earlier layer has parameters (the input gradient is not needed).
struct LayerBuffers {
  float* x = nullptr;
  float* xpad = nullptr;
  float* z = nullptr;
  float* y = nullptr;
  float* dx = nullptr;
  float* dxpad = nullptr;
  float* dz = nullptr;
  float* dy = nullptr;
  float* kernel = nullptr;  // Keras layout, in the parameter block
  float* bias = nullptr;
  float* d_kernel = nullptr;  // Keras layout, in the gradient block
  float* d_bias = nullptr;
  float* kernel_krsc = nullptr;  // conv: cuDNN's filter layout
  float* d_kernel_krsc = nullptr;
};

class CudaBackend final : public ComputeBackend {
 public:
  explicit CudaBackend(const BackendOptions& options) : options_(options) {}
  ~CudaBackend() override;

  absl::Status Init();
  std::string name() const override { return "cuda"; }
  bool ActivationsInHostMemory() const override { return false; }
  absl::Status Prepare(const ModelDef& model, int max_batch) override;
  absl::Status TrainStep(absl::Span<const float* const> params, const float* images,
                         const int32_t* labels, int batch, absl::Span<float* const> grads,
                         StepResult* result) override {
    return RunStep(params, images, labels, batch, grads, /*train=*/true, result);
  }
  absl::Status Evaluate(absl::Span<const float* const> params, const float* images,
                        const int32_t* labels, int batch, StepResult* result) override {
    return RunStep(params, images, labels, batch, {}, /*train=*/false, result);
  }
  absl::Status PinHostMemory(void* data, size_t bytes) override;
  void UnpinHostMemory(void* data) override;

 private:
  // Lays every device buffer out in `arena` and the pinned staging buffers
  // in `host` (measuring arenas, or the real allocations).
  void Carve(Arena& arena, Arena& host);
  absl::StatusOr<const BatchPlan*> PlanFor(int batch);
  absl::Status RunStep(absl::Span<const float* const> params, const float* images,
                       const int32_t* labels, int batch, absl::Span<float* const> grads,
                       bool train, StepResult* result);
  // RunStep's copies and kernels, once its arguments have been checked.
  absl::Status QueueStep(const BatchPlan* plan, absl::Span<const float* const> params,
                         const float* images, const int32_t* labels, int batch,
                         absl::Span<float* const> grads, bool train, StepResult* result);
  absl::Status Forward(const BatchPlan& plan, int batch);
  absl::Status Backward(const BatchPlan& plan, int batch);
  absl::Status LayerForward(size_t i, const BatchLayerPlan& b, int batch);
  absl::Status LayerBackward(size_t i, const BatchLayerPlan& b, int batch);
  void Release();
  // Whether [p, p + bytes) lies inside memory pinned by PinHostMemory.
  bool Pinned(const void* p, size_t bytes) const;

  const BackendOptions options_;
  // Caller memory page-locked by PinHostMemory: (start, bytes).
  std::vector<std::pair<char*, size_t>> pinned_;
  cudaStream_t stream_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  ActivationDesc relu_;

  // Set by Prepare.
  ModelDef model_;
  int max_batch_ = 0;
  bool prepared_ = false;  // Prepare succeeded
  std::vector<LayerPlan> layers_;
  std::vector<bool> need_input_grad_;
  std::vector<size_t> var_offset_;  // floats from the start of the parameter block
  size_t param_block_floats_ = 0;
  std::map<int, std::unique_ptr<BatchPlan>> batch_plans_;
  size_t workspace_bytes_ = 0;  // allocated cuDNN workspace
  void* device_memory_ = nullptr;
  void* host_memory_ = nullptr;  // pinned

  // Device slices.
  float* d_params_ = nullptr;
  float* d_grads_ = nullptr;
  float* d_images_ = nullptr;
  int32_t* d_labels_ = nullptr;
  double* d_loss_ = nullptr;
  int32_t* d_correct_ = nullptr;
  float* d_ones_ = nullptr;
  int64_t ones_count_ = 0;
  void* d_workspace_ = nullptr;
  void* d_cublas_workspace_ = nullptr;
  std::vector<LayerBuffers> buf_;
  // Pinned host slices.
  float* h_params_ = nullptr;
  float* h_grads_ = nullptr;
  float* h_images_ = nullptr;
  int32_t* h_labels_ = nullptr;
  double* h_loss_ = nullptr;
  int32_t* h_correct_ = nullptr;
};

CudaBackend::~CudaBackend() {
  // Errors are ignored here: there is no one left to report them to.
  cudaSetDevice(options_.device_index);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (const auto& [start, bytes] : pinned_) cudaHostUnregister(start);
  Release();
  relu_.reset();
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (cudnn_ != nullptr) cudnnDestroy(cudnn_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void CudaBackend::Release() {
  if (device_memory_ != nullptr) cudaFree(device_memory_);
  if (host_memory_ != nullptr) cudaFreeHost(host_memory_);
  device_memory_ = host_memory_ = nullptr;
  batch_plans_.clear();
  layers_.clear();
  buf_.clear();
  max_batch_ = 0;
  prepared_ = false;
}

absl::Status CudaBackend::PinHostMemory(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("cuda: PinHostMemory needs a non-empty range");
  }
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_index));
  const cudaError_t rc = cudaHostRegister(data, bytes, cudaHostRegisterDefault);
  if (rc != cudaSuccess) {
    cudaGetLastError();  // clear it: the backend goes on with staging buffers
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda: could not pin ", bytes, " bytes of host memory (", CallErrorText(rc),
        "); steps copy through the staging buffers instead"));
  }
  pinned_.emplace_back(static_cast<char*>(data), bytes);
  return absl::OkStatus();
}

void CudaBackend::UnpinHostMemory(void* data) {
  for (size_t i = 0; i < pinned_.size(); ++i) {
    if (pinned_[i].first != data) continue;
    cudaSetDevice(options_.device_index);
    // A step in flight may still be copying from or to it.
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    cudaHostUnregister(data);
    // Nobody to report a failure to; do not leave it as the "last error"
    // that the next kernel launch would return.
    cudaGetLastError();
    pinned_.erase(pinned_.begin() + static_cast<std::ptrdiff_t>(i));
    return;
  }
}

bool CudaBackend::Pinned(const void* p, size_t bytes) const {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  for (const auto& [start, size] : pinned_) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(start);
    if (at >= begin && bytes <= size && at - begin <= size - bytes) return true;
  }
  return false;
}

absl::Status CudaBackend::Init() {
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_index));
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnCreate(&cudnn_));
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnSetStream(cudnn_, stream_));
  PSFLOW_CUDA_RETURN_IF_ERROR(cublasCreate(&cublas_));
  PSFLOW_CUDA_RETURN_IF_ERROR(cublasSetStream(cublas_, stream_));
  // Default math is FP32 for SGEMM; TF32 needs CUBLAS_TF32_TENSOR_OP_MATH.
  PSFLOW_CUDA_RETURN_IF_ERROR(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  PSFLOW_ASSIGN_OR_RETURN(relu_, MakeReluDesc());
  return absl::OkStatus();
}

void CudaBackend::Carve(Arena& arena, Arena& host) {
  const int64_t b = max_batch_;
  d_params_ = arena.Take<float>(param_block_floats_);
  d_grads_ = arena.Take<float>(param_block_floats_);
  d_images_ = arena.Take<float>(b * model_.input.size());
  d_labels_ = arena.Take<int32_t>(b);
  d_loss_ = arena.Take<double>(b);
  d_correct_ = arena.Take<int32_t>(b);
  d_ones_ = arena.Take<float>(ones_count_);
  d_cublas_workspace_ = arena.Take<char>(kCublasWorkspaceBytes);
  d_workspace_ = arena.Take<char>(workspace_bytes_);

  const size_t n = layers_.size();
  buf_.assign(n, LayerBuffers{});
  float* act = d_images_;  // the current layer's input
  float* grad = nullptr;   // its gradient (null: not needed)
  for (size_t i = 0; i < n; ++i) {
    const LayerPlan& p = layers_[i];
    const LayerDef& d = p.def;
    LayerBuffers& lb = buf_[i];
    lb.x = act;
    lb.dx = need_input_grad_[i] ? grad : nullptr;
    if (d.kind == LayerKind::kFlatten) {  // NHWC flattening is a reshape
      lb.y = lb.x;
      lb.dy = lb.dx;
    } else {
      lb.y = arena.Take<float>(b * d.output.size());
      const bool output_grad_needed = i + 1 == n || need_input_grad_[i + 1];
      lb.dy = output_grad_needed ? arena.Take<float>(b * d.output.size()) : nullptr;
    }
    lb.xpad = p.explicit_pad ? arena.Take<float>(b * p.cudnn_input.size()) : lb.x;
    lb.dxpad = p.explicit_pad && lb.dx != nullptr ? arena.Take<float>(b * p.cudnn_input.size())
                                                  : lb.dx;
    const bool has_params = d.kernel_var >= 0;
    lb.z = has_params && d.relu ? arena.Take<float>(b * d.output.size()) : lb.y;
    lb.dz = has_params && d.relu ? arena.Take<float>(b * d.output.size()) : lb.dy;
    if (has_params) {
      lb.kernel = d_params_ + var_offset_[d.kernel_var];
      lb.bias = d_params_ + var_offset_[d.bias_var];
      lb.d_kernel = d_grads_ + var_offset_[d.kernel_var];
      lb.d_bias = d_grads_ + var_offset_[d.bias_var];
    }
    if (d.kind == LayerKind::kConv2D) {
      const int64_t k = model_.variables[d.kernel_var].num_elements();
      lb.kernel_krsc = arena.Take<float>(k);
      lb.d_kernel_krsc = arena.Take<float>(k);
    }
    act = lb.y;
    grad = lb.dy;
  }

  h_params_ = host.Take<float>(param_block_floats_);
  h_grads_ = host.Take<float>(param_block_floats_);
  h_images_ = host.Take<float>(b * model_.input.size());
  h_labels_ = host.Take<int32_t>(b);
  h_loss_ = host.Take<double>(b);
  h_correct_ = host.Take<int32_t>(b);
}

absl::Status CudaBackend::Prepare(const ModelDef& model, int max_batch) {
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_index));
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  Release();
  if (max_batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat("cuda: max_batch must be >= 1, got ", max_batch));
  }
  if (model.layers.empty() || model.layers.back().kind != LayerKind::kDense ||
      model.num_classes != model.layers.back().units) {
    return absl::InvalidArgumentError(
        "cuda: the model must end with a dense layer whose units are num_classes");
  }
  model_ = model;
  max_batch_ = max_batch;
  PSFLOW_ASSIGN_OR_RETURN(layers_, PlanLayers(model_));

  // A layer's input gradient is needed only when some earlier layer has
  // parameters.
  need_input_grad_.assign(layers_.size(), false);
  bool params_before = false;
  ones_count_ = 1;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerDef& d = layers_[i].def;
    need_input_grad_[i] = params_before;
    if (d.kernel_var >= 0) {
      params_before = true;
      ones_count_ = std::max<int64_t>(ones_count_, int64_t{max_batch} * d.output.h * d.output.w);
    }
  }
  var_offset_.clear();
  param_block_floats_ = 0;
  for (const VariableSpec& v : model_.variables) {
    var_offset_.push_back(param_block_floats_);
    param_block_floats_ += Arena::RoundUp(v.num_elements() * sizeof(float)) / sizeof(float);
  }

  // Measure everything but the convolution workspace, then let the
  // remaining budget bound the algorithms' workspace.
  workspace_bytes_ = 0;
  Arena measure_device = Arena::Measuring(), measure_host = Arena::Measuring();
  Carve(measure_device, measure_host);
  const size_t fixed = measure_device.size();
  size_t free_bytes = 0, total_bytes = 0;
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  const bool capped = options_.gpu_memory_limit_mb > 0;
  // A cap beyond the GPU's memory caps nothing (and beyond 2^64 bytes the
  // conversion was undefined: infinity gave a cap of 0 bytes).
  const double cap_bytes =
      std::min(options_.gpu_memory_limit_mb * 1024.0 * 1024.0, static_cast<double>(total_bytes));
  // The cap, and never more than is free: on a GPU shared with other
  // processes the cap alone let the convolutions pick workspaces that the
  // allocation then could not get.
  const size_t cap = capped ? static_cast<size_t>(cap_bytes) : free_bytes;
  const size_t allowed = std::min(cap, free_bytes);
  auto exhausted = [&](size_t needed) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cuda: model \"%s\" at batch %d needs %.1f MB of GPU memory but %s", model_.spec, max_batch,
        Mb(needed),
        cap < free_bytes
            ? absl::StrFormat("gpu_memory_limit_mb allows %.1f MB", Mb(allowed))
            : absl::StrFormat(
                  "only %.1f MB are free on the GPU%s", Mb(allowed),
                  capped ? absl::StrFormat(" (gpu_memory_limit_mb would allow %.1f)", Mb(cap))
                         : "")));
  };
  if (fixed > allowed) return exhausted(fixed);
  const size_t workspace_limit = std::min(kMaxConvWorkspaceBytes, allowed - fixed);
  auto plan = PlanBatch(cudnn_, layers_, need_input_grad_, max_batch, workspace_limit);
  if (!plan.ok()) {
    if (absl::IsResourceExhausted(plan.status())) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s; the rest of the model needs %.1f MB of the %.1f MB allowed",
          plan.status().message(), Mb(fixed), Mb(allowed)));
    }
    return plan.status();
  }
  // A little slack lets a smaller last batch pick its own algorithms
  // without needing more than was allocated here.
  bool has_conv = false;
  for (const LayerPlan& p : layers_) has_conv |= p.def.kind == LayerKind::kConv2D;
  workspace_bytes_ = std::max(plan->workspace_bytes,
                              has_conv ? std::min(kConvWorkspaceSlackBytes, workspace_limit) : 0);

  Arena sized_device = Arena::Measuring(), sized_host = Arena::Measuring();
  Carve(sized_device, sized_host);
  if (sized_device.size() > allowed) return exhausted(sized_device.size());
  if (cudaMalloc(&device_memory_, sized_device.size()) != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls do not see it
    device_memory_ = nullptr;
    return exhausted(sized_device.size());
  }
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_memory_, sized_host.size()));
  Arena device(reinterpret_cast<uintptr_t>(device_memory_));
  Arena host(reinterpret_cast<uintptr_t>(host_memory_));
  Carve(device, host);
  batch_plans_[max_batch] = std::make_unique<BatchPlan>(*std::move(plan));

  PSFLOW_CUDA_RETURN_IF_ERROR(
      cublasSetWorkspace(cublas_, d_cublas_workspace_, kCublasWorkspaceBytes));
  PSFLOW_CUDA_RETURN_IF_ERROR(LaunchFill(d_ones_, ones_count_, 1.0f, stream_));
  // Alignment gaps in the parameter blocks are copied every step; keep them
  // defined.
  PSFLOW_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(d_grads_, 0, param_block_floats_ * sizeof(float), stream_));
  std::memset(h_params_, 0, param_block_floats_ * sizeof(float));
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  prepared_ = true;
  return absl::OkStatus();
}

absl::StatusOr<const BatchPlan*> CudaBackend::PlanFor(int batch) {
  auto it = batch_plans_.find(batch);
  if (it != batch_plans_.end()) return it->second.get();
  // A smaller batch (the last of an epoch): new descriptors and algorithms,
  // host-side only, limited to the workspace already allocated.
  PSFLOW_ASSIGN_OR_RETURN(BatchPlan plan,
                          PlanBatch(cudnn_, layers_, need_input_grad_, batch, workspace_bytes_));
  auto owned = std::make_unique<BatchPlan>(std::move(plan));
  const BatchPlan* raw = owned.get();
  batch_plans_[batch] = std::move(owned);
  return raw;
}

absl::Status CudaBackend::RunStep(absl::Span<const float* const> params, const float* images,
                                  const int32_t* labels, int batch,
                                  absl::Span<float* const> grads, bool train,
                                  StepResult* result) {
  if (!prepared_) {
    return absl::FailedPreconditionError("cuda: Prepare has not succeeded on this backend");
  }
  if (batch < 1 || batch > max_batch_) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda: batch ", batch, " is outside [1, ", max_batch_, "] (max_batch)"));
  }
  const size_t nvars = model_.variables.size();
  if (params.size() != nvars || (train && grads.size() != nvars)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda: the model has ", nvars, " variables but got ", params.size(), " params and ",
        grads.size(), " grads"));
  }
  if (images == nullptr || labels == nullptr || result == nullptr) {
    return absl::InvalidArgumentError("cuda: images, labels and result must not be null");
  }
  // As the CPU backends: a null buffer is refused, not dereferenced.
  for (size_t v = 0; v < nvars; ++v) {
    if (params[v] == nullptr || (train && grads[v] == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda: the ", params[v] == nullptr ? "parameter" : "gradient", " buffer of ",
                       model_.variables[v].name, " is null"));
    }
  }
  for (int b = 0; b < batch; ++b) {
    if (labels[b] < 0 || labels[b] >= model_.num_classes) {
      return absl::InvalidArgumentError(absl::StrCat("cuda: label of example ", b, " is ",
                                                     labels[b], "; expected [0, ",
                                                     model_.num_classes, ")"));
    }
  }
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_index));
  PSFLOW_ASSIGN_OR_RETURN(const BatchPlan* plan, PlanFor(batch));
  absl::Status status = QueueStep(plan, params, images, labels, batch, grads, train, result);
  if (!status.ok()) {
    // What was queued before the failure may still read the staging
    // buffers, which the next step would overwrite: let it finish. (Its
    // own error, if any, is the one already being returned.)
    cudaStreamSynchronize(stream_);
    cudaGetLastError();
  }
  return status;
}

absl::Status CudaBackend::QueueStep(const BatchPlan* plan, absl::Span<const float* const> params,
                                    const float* images, const int32_t* labels, int batch,
                                    absl::Span<float* const> grads, bool train,
                                    StepResult* result) {
  const size_t nvars = model_.variables.size();
  // Parameters: pinned caller memory goes straight to the device (the copies
  // start at once and run while the others are staged); the rest is copied
  // into the staging buffer first.
  for (size_t v = 0; v < nvars; ++v) {
    const size_t bytes = model_.variables[v].num_elements() * sizeof(float);
    if (Pinned(params[v], bytes)) {
      PSFLOW_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_params_ + var_offset_[v], params[v], bytes,
                                                  cudaMemcpyHostToDevice, stream_));
    }
  }
  for (size_t v = 0; v < nvars; ++v) {
    const size_t bytes = model_.variables[v].num_elements() * sizeof(float);
    if (!Pinned(params[v], bytes)) {
      std::memcpy(h_params_ + var_offset_[v], params[v], bytes);
      PSFLOW_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_params_ + var_offset_[v],
                                                  h_params_ + var_offset_[v], bytes,
                                                  cudaMemcpyHostToDevice, stream_));
    }
  }
  const int64_t image_floats = int64_t{batch} * model_.input.size();
  std::memcpy(h_images_, images, image_floats * sizeof(float));
  std::memcpy(h_labels_, labels, batch * sizeof(int32_t));
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_images_, h_images_, image_floats * sizeof(float),
                                              cudaMemcpyHostToDevice, stream_));
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_labels_, h_labels_, batch * sizeof(int32_t),
                                              cudaMemcpyHostToDevice, stream_));

  PSFLOW_RETURN_IF_ERROR(Forward(*plan, batch));
  const LayerBuffers& last = buf_.back();
  PSFLOW_CUDA_RETURN_IF_ERROR(LaunchSoftmaxCrossEntropy(last.y, d_labels_, batch,
                                                        model_.num_classes, d_loss_, d_correct_,
                                                        train ? last.dy : nullptr, stream_));
  if (train) {
    PSFLOW_RETURN_IF_ERROR(Backward(*plan, batch));
    for (size_t v = 0; v < nvars; ++v) {
      const size_t bytes = model_.variables[v].num_elements() * sizeof(float);
      float* to = Pinned(grads[v], bytes) ? grads[v] : h_grads_ + var_offset_[v];
      PSFLOW_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to, d_grads_ + var_offset_[v], bytes,
                                                  cudaMemcpyDeviceToHost, stream_));
    }
  }
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_loss_, d_loss_, batch * sizeof(double),
                                              cudaMemcpyDeviceToHost, stream_));
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_correct_, d_correct_, batch * sizeof(int32_t),
                                              cudaMemcpyDeviceToHost, stream_));
  // Faults inside kernels of this step surface here.
  PSFLOW_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));

  if (train) {
    for (size_t v = 0; v < nvars; ++v) {
      const size_t bytes = model_.variables[v].num_elements() * sizeof(float);
      if (!Pinned(grads[v], bytes)) std::memcpy(grads[v], h_grads_ + var_offset_[v], bytes);
    }
  }
  double loss_sum = 0;
  int64_t correct = 0;
  for (int b = 0; b < batch; ++b) {
    loss_sum += h_loss_[b];
    correct += h_correct_[b];
  }
  result->loss_sum += loss_sum;
  result->correct += correct;
  return absl::OkStatus();
}

// Prefixes a layer's error with its name and pass.
absl::Status InLayer(absl::Status s, const LayerDef& d, const char* pass) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("cuda: layer ", d.name, " ", pass, ": ", s.message()));
}

absl::Status CudaBackend::Forward(const BatchPlan& plan, int batch) {
  for (size_t i = 0; i < layers_.size(); ++i) {
    PSFLOW_RETURN_IF_ERROR(
        InLayer(LayerForward(i, plan.layers[i], batch), layers_[i].def, "forward"));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Backward(const BatchPlan& plan, int batch) {
  for (size_t i = layers_.size(); i-- > 0;) {
    PSFLOW_RETURN_IF_ERROR(
        InLayer(LayerBackward(i, plan.layers[i], batch), layers_[i].def, "backward"));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LayerForward(size_t i, const BatchLayerPlan& b, int batch) {
  const LayerPlan& p = layers_[i];
  const LayerDef& d = p.def;
  const LayerBuffers& lb = buf_[i];
  if (p.explicit_pad) {
    const float fill = d.kind == LayerKind::kMaxPool2D ? std::numeric_limits<float>::lowest() : 0.f;
    PSFLOW_CUDA_RETURN_IF_ERROR(LaunchPadNhwc(lb.x, batch, d.input.h, d.input.w, d.input.c,
                                              p.gh.pad_before, p.gh.pad_after, p.gw.pad_before,
                                              p.gw.pad_after, fill, lb.xpad, stream_));
  }
  switch (d.kind) {
    case LayerKind::kFlatten:
      return absl::OkStatus();
    case LayerKind::kMaxPool2D:
      PSFLOW_CUDA_RETURN_IF_ERROR(cudnnPoolingForward(cudnn_, p.pool.get(), &kOne, b.x.get(),
                                                      lb.xpad, &kZero, b.y.get(), lb.y));
      return absl::OkStatus();
    case LayerKind::kConv2D: {
      const int64_t rows = int64_t{d.kernel} * d.kernel * d.input.c;
      PSFLOW_CUDA_RETURN_IF_ERROR(LaunchTranspose(lb.kernel, rows, d.units, lb.kernel_krsc,
                                                  stream_));
      PSFLOW_CUDA_RETURN_IF_ERROR(cudnnConvolutionForward(
          cudnn_, &kOne, b.x.get(), lb.xpad, p.filter.get(), lb.kernel_krsc, p.conv.get(),
          b.fwd_algo, d_workspace_, workspace_bytes_, &kZero, b.y.get(), lb.z));
      break;
    }
    case LayerKind::kDense: {
      // Row-major Y[B,units] = X[B,in] W[in,units] is column-major
      // Y^T = W^T X^T: cuBLAS sees W as [units,in] and X as [in,B].
      const int in = d.input.c, units = d.units;
      PSFLOW_CUDA_RETURN_IF_ERROR(cublasSgemm(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, units, batch, in,
                                              &kOne, lb.kernel, units, lb.x, in, &kZero, lb.z,
                                              units));
      break;
    }
  }
  PSFLOW_CUDA_RETURN_IF_ERROR(
      cudnnAddTensor(cudnn_, &kOne, p.bias.get(), lb.bias, &kOne, b.y.get(), lb.z));
  if (d.relu) {
    PSFLOW_CUDA_RETURN_IF_ERROR(cudnnActivationForward(cudnn_, relu_.get(), &kOne, b.y.get(),
                                                       lb.z, &kZero, b.y.get(), lb.y));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LayerBackward(size_t i, const BatchLayerPlan& b, int batch) {
  const LayerPlan& p = layers_[i];
  const LayerDef& d = p.def;
  const LayerBuffers& lb = buf_[i];
  const bool want_dx = lb.dx != nullptr;
  auto crop = [&]() -> absl::Status {
    if (!p.explicit_pad) return absl::OkStatus();
    PSFLOW_CUDA_RETURN_IF_ERROR(LaunchCropNhwc(lb.dxpad, batch, d.input.h, d.input.w, d.input.c,
                                               p.gh.pad_before, p.gh.pad_after, p.gw.pad_before,
                                               p.gw.pad_after, lb.dx, stream_));
    return absl::OkStatus();
  };
  switch (d.kind) {
    case LayerKind::kFlatten:
      return absl::OkStatus();  // dx aliases dy
    case LayerKind::kMaxPool2D:
      if (!want_dx) return absl::OkStatus();
      PSFLOW_CUDA_RETURN_IF_ERROR(cudnnPoolingBackward(cudnn_, p.pool.get(), &kOne, b.y.get(),
                                                       lb.y, b.y.get(), lb.dy, b.x.get(), lb.xpad,
                                                       &kZero, b.x.get(), lb.dxpad));
      return crop();
    case LayerKind::kConv2D:
    case LayerKind::kDense:
      break;
  }
  if (d.relu) {
    PSFLOW_CUDA_RETURN_IF_ERROR(cudnnActivationBackward(cudnn_, relu_.get(), &kOne, b.y.get(),
                                                        lb.y, b.y.get(), lb.dy, b.y.get(), lb.z,
                                                        &kZero, b.y.get(), lb.dz));
  }
  // d_bias = dZ^T 1: dZ is row-major [positions, units], column-major
  // [units, positions].
  const int units = d.units;
  const int positions = batch * d.output.h * d.output.w;
  PSFLOW_CUDA_RETURN_IF_ERROR(cublasSgemv(cublas_, CUBLAS_OP_N, units, positions, &kOne, lb.dz,
                                          units, d_ones_, 1, &kZero, lb.d_bias, 1));
  if (d.kind == LayerKind::kDense) {
    const int in = d.input.c;
    // dW[in,units] = X^T dZ, i.e. column-major dW^T = dZ^T X.
    PSFLOW_CUDA_RETURN_IF_ERROR(cublasSgemm(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, units, in, batch,
                                            &kOne, lb.dz, units, lb.x, in, &kZero, lb.d_kernel,
                                            units));
    if (want_dx) {
      // dX[B,in] = dZ W^T, i.e. column-major dX^T = W dZ^T.
      PSFLOW_CUDA_RETURN_IF_ERROR(cublasSgemm(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, in, batch, units,
                                              &kOne, lb.kernel, units, lb.dz, units, &kZero,
                                              lb.dx, in));
    }
    return absl::OkStatus();
  }
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnConvolutionBackwardFilter(
      cudnn_, &kOne, b.x.get(), lb.xpad, b.y.get(), lb.dz, p.conv.get(), b.bwd_filter_algo,
      d_workspace_, workspace_bytes_, &kZero, p.filter.get(), lb.d_kernel_krsc));
  const int64_t rows = int64_t{d.kernel} * d.kernel * d.input.c;
  PSFLOW_CUDA_RETURN_IF_ERROR(LaunchTranspose(lb.d_kernel_krsc, units, rows, lb.d_kernel,
                                              stream_));
  if (!want_dx) return absl::OkStatus();
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnConvolutionBackwardData(
      cudnn_, &kOne, p.filter.get(), lb.kernel_krsc, b.y.get(), lb.dz, p.conv.get(),
      b.bwd_data_algo, d_workspace_, workspace_bytes_, &kZero, b.x.get(), lb.dxpad));
  return crop();
}

}  // namespace
}  // namespace cuda_internal

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver (error 35) or no device: not a GPU machine
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateCudaBackend(const BackendOptions& options) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    const std::string why =
        e != cudaSuccess ? cuda_internal::CallErrorText(e) : std::string("0 devices");
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA GPU is visible (cudaGetDeviceCount: ", why, "); use --device=cpu"));
  }
  if (options.device_index < 0 || options.device_index >= count) {
    return absl::InvalidArgumentError(absl::StrCat("cuda: device_index ", options.device_index,
                                                   " but ", count, " CUDA GPU(s) are visible"));
  }
  if (options.gpu_memory_limit_mb < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda: gpu_memory_limit_mb must be >= 0 (0 = no cap), got ", options.gpu_memory_limit_mb));
  }
  auto backend = std::make_unique<cuda_internal::CudaBackend>(options);
  PSFLOW_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<ComputeBackend>(std::move(backend));
}

}  // namespace psflow::worker
