// How the CUDA backend runs each layer of a ModelDef: window geometry and
// padding, the cuDNN descriptors that do not depend on the batch size, and,
// per batch size, the tensor descriptors and the convolution algorithms
// (chosen once, with a workspace limit, never per step). Host-side only: no
// device memory is touched here. Internal to worker/cuda/.
#ifndef PSFLOW_WORKER_CUDA_CUDA_PLAN_H_
#define PSFLOW_WORKER_CUDA_CUDA_PLAN_H_

#include <cstddef>
#include <memory>
#include <vector>

#include <cudnn.h>

#include "absl/status/statusor.h"
#include "worker/cuda/window_geometry.h"
#include "worker/model/model_def.h"

namespace psflow::worker::cuda_internal {

// Owning cuDNN descriptors (destroyed with their owner).
struct TensorDescDeleter {
  void operator()(cudnnTensorStruct* d) const { cudnnDestroyTensorDescriptor(d); }
};
struct FilterDescDeleter {
  void operator()(cudnnFilterStruct* d) const { cudnnDestroyFilterDescriptor(d); }
};
struct ConvDescDeleter {
  void operator()(cudnnConvolutionStruct* d) const { cudnnDestroyConvolutionDescriptor(d); }
};
struct PoolDescDeleter {
  void operator()(cudnnPoolingStruct* d) const { cudnnDestroyPoolingDescriptor(d); }
};
struct ActivationDescDeleter {
  void operator()(cudnnActivationStruct* d) const { cudnnDestroyActivationDescriptor(d); }
};
using TensorDesc = std::unique_ptr<cudnnTensorStruct, TensorDescDeleter>;
using FilterDesc = std::unique_ptr<cudnnFilterStruct, FilterDescDeleter>;
using ConvDesc = std::unique_ptr<cudnnConvolutionStruct, ConvDescDeleter>;
using PoolDesc = std::unique_ptr<cudnnPoolingStruct, PoolDescDeleter>;
using ActivationDesc = std::unique_ptr<cudnnActivationStruct, ActivationDescDeleter>;

// An NHWC float tensor of n x h x w x c (dense layers use h = w = 1).
absl::StatusOr<TensorDesc> MakeNhwcTensor(int n, int h, int w, int c);
absl::StatusOr<ActivationDesc> MakeReluDesc();

// One layer, independent of the batch size.
struct LayerPlan {
  LayerDef def;
  WindowGeometry gh, gw;  // conv/pool: rows and columns
  // Conv/pool: the input is first copied into a padded buffer (asymmetric
  // conv padding, or any max-pool padding, filled with the lowest float so
  // that padding never wins a max), and cuDNN runs unpadded on it.
  bool explicit_pad = false;
  int cudnn_pad_h = 0, cudnn_pad_w = 0;  // symmetric conv padding done by cuDNN
  Shape3 cudnn_input;                    // the input shape cuDNN sees
  FilterDesc filter;                     // conv: KRSC
  ConvDesc conv;                         // conv: FP32 compute, FMA math (no TF32)
  PoolDesc pool;                         // maxpool
  TensorDesc bias;                       // conv/dense: 1 x 1 x 1 x units
};

absl::StatusOr<std::vector<LayerPlan>> PlanLayers(const ModelDef& model);

// One layer at one batch size.
struct BatchLayerPlan {
  TensorDesc x;  // conv/pool: the (padded) input cuDNN sees
  TensorDesc y;  // the layer's output (and pre-activation, and their gradients)
  cudnnConvolutionFwdAlgo_t fwd_algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
  cudnnConvolutionBwdDataAlgo_t bwd_data_algo = CUDNN_CONVOLUTION_BWD_DATA_ALGO_0;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter_algo = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0;
};

struct BatchPlan {
  int batch = 0;
  std::vector<BatchLayerPlan> layers;
  size_t workspace_bytes = 0;  // the most any chosen algorithm needs
};

// Chooses, for every convolution and direction, the fastest algorithm by
// cuDNN's heuristics (cudnnGet*Algorithm_v7) that computes in plain FP32
// and needs at most `workspace_limit` bytes. `need_input_grad[i]` says
// whether layer i's backward-data pass runs. RESOURCE_EXHAUSTED when every
// FP32 algorithm needs more workspace than the limit (naming the layer, the
// least needed and the limit); INTERNAL when none is available.
absl::StatusOr<BatchPlan> PlanBatch(cudnnHandle_t handle, const std::vector<LayerPlan>& layers,
                                    const std::vector<bool>& need_input_grad, int batch,
                                    size_t workspace_limit);

}  // namespace psflow::worker::cuda_internal

#endif  // PSFLOW_WORKER_CUDA_CUDA_PLAN_H_
