#include "worker/cuda/cuda_plan.h"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_check.h"

namespace psflow::worker::cuda_internal {
namespace {

std::string ShapeText(Shape3 s) { return absl::StrCat("[", s.h, ",", s.w, ",", s.c, "]"); }

double Mb(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

absl::Status CheckOutput(const LayerDef& def, Shape3 computed) {
  if (computed == def.output) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("cuda: layer ", def.name, " has output shape ", ShapeText(def.output),
                   " in the ModelDef but its window gives ", ShapeText(computed)));
}

// cuDNN's own view of the output size must agree with Keras' (a mismatch
// would mean wrong padding; fail loudly instead of computing garbage).
absl::Status CheckCudnnOutput(const LayerDef& def, int h, int w, int c) {
  if (Shape3{h, w, c} == def.output) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuda: cuDNN computes output ", ShapeText({h, w, c}),
                                          " for layer ", def.name, " but Keras padding gives ",
                                          ShapeText(def.output)));
}

bool IsTensorOpMath(cudnnMathType_t m) {
  return m == CUDNN_TENSOR_OP_MATH || m == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
}

// The first heuristic candidate that succeeds, computes in FP32 (no tensor
// cores, hence no TF32) and fits the workspace limit. `workspace(algo,
// &bytes)` asks cuDNN for the exact workspace of a candidate.
template <typename Perf, typename WorkspaceFn>
absl::StatusOr<decltype(Perf::algo)> PickAlgorithm(const Perf* perf, int count,
                                                   WorkspaceFn workspace, size_t limit,
                                                   const std::string& what, size_t* needed) {
  size_t least_over_limit = std::numeric_limits<size_t>::max();
  std::string rejected;
  for (int i = 0; i < count; ++i) {
    const int algo = static_cast<int>(perf[i].algo);
    if (perf[i].status != CUDNN_STATUS_SUCCESS) {
      absl::StrAppend(&rejected, " algo ", algo, ": ", cudnnGetErrorString(perf[i].status), ";");
      continue;
    }
    if (IsTensorOpMath(perf[i].mathType)) {
      absl::StrAppend(&rejected, " algo ", algo, ": tensor-op math;");
      continue;
    }
    size_t bytes = 0;
    const cudnnStatus_t s = workspace(perf[i].algo, &bytes);
    if (s != CUDNN_STATUS_SUCCESS) {
      absl::StrAppend(&rejected, " algo ", algo, ": workspace query ", cudnnGetErrorString(s), ";");
      continue;
    }
    if (bytes > limit) {
      least_over_limit = std::min(least_over_limit, bytes);
      absl::StrAppend(&rejected, " algo ", algo, ": needs ", bytes, " B of workspace;");
      continue;
    }
    *needed = bytes;
    return perf[i].algo;
  }
  if (least_over_limit != std::numeric_limits<size_t>::max()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cuda: %s needs at least %.1f MB of cuDNN workspace but only %.1f MB are allowed "
        "(raise gpu_memory_limit_mb or lower the batch size)",
        what, Mb(least_over_limit), Mb(limit)));
  }
  return absl::InternalError(absl::StrCat("cuda: no FP32 cuDNN algorithm for ", what,
                                          " among ", count, " candidates:", rejected));
}

absl::Status PlanConv(LayerPlan* p) {
  const LayerDef& d = p->def;
  PSFLOW_ASSIGN_OR_RETURN(p->gh, ComputeWindow(d.input.h, d.kernel, d.stride, d.same_padding));
  PSFLOW_ASSIGN_OR_RETURN(p->gw, ComputeWindow(d.input.w, d.kernel, d.stride, d.same_padding));
  PSFLOW_RETURN_IF_ERROR(CheckOutput(d, Shape3{p->gh.out, p->gw.out, d.units}));
  p->explicit_pad = !(p->gh.symmetric() && p->gw.symmetric());
  p->cudnn_input = d.input;
  if (p->explicit_pad) {
    p->cudnn_input.h += p->gh.pad_before + p->gh.pad_after;
    p->cudnn_input.w += p->gw.pad_before + p->gw.pad_after;
  } else {
    p->cudnn_pad_h = p->gh.pad_before;
    p->cudnn_pad_w = p->gw.pad_before;
  }
  cudnnFilterDescriptor_t f = nullptr;
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnCreateFilterDescriptor(&f));
  p->filter.reset(f);
  // NHWC filters are KRSC: [filters, kh, kw, cin].
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnSetFilter4dDescriptor(f, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NHWC,
                                                         d.units, d.input.c, d.kernel, d.kernel));
  cudnnConvolutionDescriptor_t c = nullptr;
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnCreateConvolutionDescriptor(&c));
  p->conv.reset(c);
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnSetConvolution2dDescriptor(
      c, p->cudnn_pad_h, p->cudnn_pad_w, d.stride, d.stride, 1, 1, CUDNN_CROSS_CORRELATION,
      CUDNN_DATA_FLOAT));
  // CUDNN_DEFAULT_MATH would permit TF32 tensor cores on Ampere and later;
  // FMA math keeps FP32 results comparable with the CPU backends.
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnSetConvolutionMathType(c, CUDNN_FMA_MATH));
  PSFLOW_ASSIGN_OR_RETURN(TensorDesc x, MakeNhwcTensor(1, p->cudnn_input.h, p->cudnn_input.w,
                                                       p->cudnn_input.c));
  int n = 0, ch = 0, h = 0, w = 0;  // the dims come back in NCHW order
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnGetConvolution2dForwardOutputDim(c, x.get(), f, &n, &ch, &h, &w));
  PSFLOW_RETURN_IF_ERROR(CheckCudnnOutput(d, h, w, ch));
  PSFLOW_ASSIGN_OR_RETURN(p->bias, MakeNhwcTensor(1, 1, 1, d.units));
  return absl::OkStatus();
}

absl::Status PlanPool(LayerPlan* p) {
  const LayerDef& d = p->def;
  PSFLOW_ASSIGN_OR_RETURN(p->gh, ComputeWindow(d.input.h, d.kernel, d.stride, d.same_padding));
  PSFLOW_ASSIGN_OR_RETURN(p->gw, ComputeWindow(d.input.w, d.kernel, d.stride, d.same_padding));
  PSFLOW_RETURN_IF_ERROR(CheckOutput(d, Shape3{p->gh.out, p->gw.out, d.input.c}));
  // Always pad max pooling ourselves: TF ignores the padding (it never wins
  // a max), which a lowest-float border reproduces exactly.
  p->explicit_pad = p->gh.padded() || p->gw.padded();
  p->cudnn_input = d.input;
  p->cudnn_input.h += p->gh.pad_before + p->gh.pad_after;
  p->cudnn_input.w += p->gw.pad_before + p->gw.pad_after;
  cudnnPoolingDescriptor_t pool = nullptr;
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnCreatePoolingDescriptor(&pool));
  p->pool.reset(pool);
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnSetPooling2dDescriptor(
      pool, CUDNN_POOLING_MAX_DETERMINISTIC, CUDNN_NOT_PROPAGATE_NAN, d.kernel, d.kernel, 0, 0,
      d.stride, d.stride));
  PSFLOW_ASSIGN_OR_RETURN(TensorDesc x, MakeNhwcTensor(1, p->cudnn_input.h, p->cudnn_input.w,
                                                       p->cudnn_input.c));
  int n = 0, ch = 0, h = 0, w = 0;
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnGetPooling2dForwardOutputDim(pool, x.get(), &n, &ch, &h, &w));
  return CheckCudnnOutput(d, h, w, ch);
}

absl::Status PlanConvAlgorithms(cudnnHandle_t handle, const LayerPlan& p, bool need_input_grad,
                                size_t limit, BatchLayerPlan* b, size_t* workspace) {
  const std::string name = p.def.name;
  cudnnTensorDescriptor_t x = b->x.get(), y = b->y.get();
  cudnnFilterDescriptor_t f = p.filter.get();
  cudnnConvolutionDescriptor_t c = p.conv.get();
  size_t bytes = 0;
  {
    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    int count = 0;
    PSFLOW_CUDA_RETURN_IF_ERROR(cudnnGetConvolutionForwardAlgorithm_v7(
        handle, x, f, c, y, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &count, perf));
    auto ws = [&](cudnnConvolutionFwdAlgo_t a, size_t* s) {
      return cudnnGetConvolutionForwardWorkspaceSize(handle, x, f, c, y, a, s);
    };
    PSFLOW_ASSIGN_OR_RETURN(b->fwd_algo,
                            PickAlgorithm(perf, count, ws, limit, name + " forward", &bytes));
    *workspace = std::max(*workspace, bytes);
  }
  {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
    int count = 0;
    PSFLOW_CUDA_RETURN_IF_ERROR(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
        handle, x, y, c, f, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &count, perf));
    auto ws = [&](cudnnConvolutionBwdFilterAlgo_t a, size_t* s) {
      return cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, x, y, c, f, a, s);
    };
    PSFLOW_ASSIGN_OR_RETURN(
        b->bwd_filter_algo,
        PickAlgorithm(perf, count, ws, limit, name + " backward filter", &bytes));
    *workspace = std::max(*workspace, bytes);
  }
  if (need_input_grad) {
    cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
    int count = 0;
    PSFLOW_CUDA_RETURN_IF_ERROR(cudnnGetConvolutionBackwardDataAlgorithm_v7(
        handle, f, y, c, x, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &count, perf));
    auto ws = [&](cudnnConvolutionBwdDataAlgo_t a, size_t* s) {
      return cudnnGetConvolutionBackwardDataWorkspaceSize(handle, f, y, c, x, a, s);
    };
    PSFLOW_ASSIGN_OR_RETURN(b->bwd_data_algo,
                            PickAlgorithm(perf, count, ws, limit, name + " backward data", &bytes));
    *workspace = std::max(*workspace, bytes);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TensorDesc> MakeNhwcTensor(int n, int h, int w, int c) {
  cudnnTensorDescriptor_t t = nullptr;
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnCreateTensorDescriptor(&t));
  TensorDesc owned(t);
  PSFLOW_CUDA_RETURN_IF_ERROR(
      cudnnSetTensor4dDescriptor(t, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT, n, c, h, w));
  return owned;
}

absl::StatusOr<ActivationDesc> MakeReluDesc() {
  cudnnActivationDescriptor_t a = nullptr;
  PSFLOW_CUDA_RETURN_IF_ERROR(cudnnCreateActivationDescriptor(&a));
  ActivationDesc owned(a);
  PSFLOW_CUDA_RETURN_IF_ERROR(
      cudnnSetActivationDescriptor(a, CUDNN_ACTIVATION_RELU, CUDNN_NOT_PROPAGATE_NAN, 0.0));
  return owned;
}

absl::StatusOr<std::vector<LayerPlan>> PlanLayers(const ModelDef& model) {
  std::vector<LayerPlan> plans(model.layers.size());
  for (size_t i = 0; i < model.layers.size(); ++i) {
    LayerPlan& p = plans[i];
    p.def = model.layers[i];
    const LayerDef& d = p.def;
    switch (d.kind) {
      case LayerKind::kConv2D:
        PSFLOW_RETURN_IF_ERROR(PlanConv(&p));
        break;
      case LayerKind::kMaxPool2D:
        PSFLOW_RETURN_IF_ERROR(PlanPool(&p));
        break;
      case LayerKind::kFlatten:
        PSFLOW_RETURN_IF_ERROR(CheckOutput(d, Shape3{1, 1, static_cast<int>(d.input.size())}));
        break;
      case LayerKind::kDense: {
        if (d.input.h != 1 || d.input.w != 1) {
          return absl::InvalidArgumentError(absl::StrCat(
              "cuda: dense layer ", d.name, " needs a flat input, got ", ShapeText(d.input)));
        }
        PSFLOW_RETURN_IF_ERROR(CheckOutput(d, Shape3{1, 1, d.units}));
        PSFLOW_ASSIGN_OR_RETURN(p.bias, MakeNhwcTensor(1, 1, 1, d.units));
        break;
      }
    }
  }
  return plans;
}

absl::StatusOr<BatchPlan> PlanBatch(cudnnHandle_t handle, const std::vector<LayerPlan>& layers,
                                    const std::vector<bool>& need_input_grad, int batch,
                                    size_t workspace_limit) {
  BatchPlan plan;
  plan.batch = batch;
  plan.layers.resize(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerPlan& p = layers[i];
    BatchLayerPlan& b = plan.layers[i];
    const Shape3 out = p.def.output;
    switch (p.def.kind) {
      case LayerKind::kConv2D:
      case LayerKind::kMaxPool2D: {
        PSFLOW_ASSIGN_OR_RETURN(
            b.x, MakeNhwcTensor(batch, p.cudnn_input.h, p.cudnn_input.w, p.cudnn_input.c));
        PSFLOW_ASSIGN_OR_RETURN(b.y, MakeNhwcTensor(batch, out.h, out.w, out.c));
        if (p.def.kind == LayerKind::kConv2D) {
          PSFLOW_RETURN_IF_ERROR(PlanConvAlgorithms(handle, p, need_input_grad[i],
                                                    workspace_limit, &b, &plan.workspace_bytes));
        }
        break;
      }
      case LayerKind::kDense: {
        PSFLOW_ASSIGN_OR_RETURN(b.y, MakeNhwcTensor(batch, 1, 1, out.c));
        break;
      }
      case LayerKind::kFlatten:
        break;
    }
  }
  return plan;
}

}  // namespace psflow::worker::cuda_internal
