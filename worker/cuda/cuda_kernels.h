// The few device kernels psflow writes itself, for what cuDNN and cuBLAS do
// not offer. Each launcher enqueues on `stream` and returns the launch error
// (cudaGetLastError), so callers wrap it in PSFLOW_CUDA_RETURN_IF_ERROR;
// faults inside a kernel surface at the next stream synchronisation.
// Activations are NHWC float32; every size is an element count.
// This header is plain C++ (no absl) so that nvcc compiles the .cu alone.
#ifndef PSFLOW_WORKER_CUDA_CUDA_KERNELS_H_
#define PSFLOW_WORKER_CUDA_CUDA_KERNELS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace psflow::worker::cuda_internal {

// out[c * rows + r] = in[r * cols + c]: row-major [rows, cols] -> [cols, rows].
// A Keras conv kernel HWIO is [kh*kw*cin, filters]; cuDNN's NHWC filter
// format (KRSC) is its transpose, [filters, kh*kw*cin].
cudaError_t LaunchTranspose(const float* in, int64_t rows, int64_t cols, float* out,
                            cudaStream_t stream);

// Copies in [n, h, w, c] into the interior of out [n, h + top + bottom,
// w + left + right, c] and sets the border to `fill` (0 for convolutions,
// the lowest float for max pooling): Keras "same" padding can be
// asymmetric, which cuDNN's symmetric padding cannot express.
cudaError_t LaunchPadNhwc(const float* in, int n, int h, int w, int c, int top, int bottom,
                          int left, int right, float fill, float* out, cudaStream_t stream);

// The adjoint of LaunchPadNhwc: out [n, h, w, c] = the interior of `in`
// [n, h + top + bottom, w + left + right, c] (border gradients dropped).
cudaError_t LaunchCropNhwc(const float* in, int n, int h, int w, int c, int top, int bottom,
                           int left, int right, float* out, cudaStream_t stream);

cudaError_t LaunchFill(float* out, int64_t n, float value, cudaStream_t stream);

// Softmax cross-entropy of logits [batch, classes] against labels (each in
// [0, classes); the caller checks). Writes loss[b] (log-sum-exp minus the
// label's logit, in double) and correct[b] (1 when the FIRST arg-max equals
// the label, else 0). When d_logits is not null writes the gradient of the
// MEAN loss over the batch, (softmax - one_hot) / batch.
cudaError_t LaunchSoftmaxCrossEntropy(const float* logits, const int32_t* labels, int batch,
                                      int classes, double* loss, int32_t* correct,
                                      float* d_logits, cudaStream_t stream);

}  // namespace psflow::worker::cuda_internal

#endif  // PSFLOW_WORKER_CUDA_CUDA_KERNELS_H_
