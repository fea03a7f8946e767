#include "worker/cuda/cuda_kernels.h"

#include <algorithm>
#include <cstdint>

namespace psflow::worker::cuda_internal {
namespace {

constexpr int kThreads = 256;

// Enough blocks to cover n with grid-stride loops, capped so huge tensors
// reuse threads instead of exceeding the grid limit.
unsigned int Blocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535 * 8)));
}

// Reads are coalesced through a shared-memory tile so that the writes are
// too; the +1 column avoids bank conflicts.
constexpr int kTile = 32;
constexpr int kTileRows = 8;

__global__ void TransposeKernel(const float* __restrict__ in, int64_t rows, int64_t cols,
                                float* __restrict__ out) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;  // out is [cols, rows]
    if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][i];
  }
}

__global__ void PadNhwcKernel(const float* __restrict__ in, int n, int h, int w, int c, int top,
                              int left, int ph, int pw, float fill, float* __restrict__ out) {
  const int64_t total = static_cast<int64_t>(n) * ph * pw * c;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int ch = static_cast<int>(i % c);
    int64_t rest = i / c;
    const int x = static_cast<int>(rest % pw) - left;
    rest /= pw;
    const int y = static_cast<int>(rest % ph) - top;
    const int64_t b = rest / ph;
    out[i] = (y >= 0 && y < h && x >= 0 && x < w) ? in[((b * h + y) * w + x) * c + ch] : fill;
  }
}

__global__ void CropNhwcKernel(const float* __restrict__ in, int n, int h, int w, int c, int top,
                               int left, int ph, int pw, float* __restrict__ out) {
  const int64_t total = static_cast<int64_t>(n) * h * w * c;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int ch = static_cast<int>(i % c);
    int64_t rest = i / c;
    const int x = static_cast<int>(rest % w);
    rest /= w;
    const int y = static_cast<int>(rest % h);
    const int64_t b = rest / h;
    out[i] = in[((b * ph + y + top) * pw + x + left) * c + ch];
  }
}

__global__ void FillKernel(float* out, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

// One thread per example: the class count is small (10 for MNIST/CIFAR), and
// the loop mirrors the reference implementation line by line.
__global__ void SoftmaxCrossEntropyKernel(const float* __restrict__ logits,
                                          const int32_t* __restrict__ labels, int batch,
                                          int classes, double* __restrict__ loss,
                                          int32_t* __restrict__ correct,
                                          float* __restrict__ d_logits) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const float* z = logits + static_cast<int64_t>(b) * classes;
  const int label = labels[b];
  int arg = 0;
  for (int j = 1; j < classes; ++j) {
    if (z[j] > z[arg]) arg = j;
  }
  correct[b] = arg == label ? 1 : 0;
  const double m = z[arg];
  double sum = 0;
  for (int j = 0; j < classes; ++j) sum += exp(static_cast<double>(z[j]) - m);
  const double lse = m + log(sum);
  loss[b] = lse - static_cast<double>(z[label]);
  if (d_logits != nullptr) {
    float* dz = d_logits + static_cast<int64_t>(b) * classes;
    for (int j = 0; j < classes; ++j) {
      const double p = exp(static_cast<double>(z[j]) - lse);
      dz[j] = static_cast<float>((p - (j == label ? 1.0 : 0.0)) / batch);
    }
  }
}

}  // namespace

cudaError_t LaunchTranspose(const float* in, int64_t rows, int64_t cols, float* out,
                            cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const dim3 block(kTile, kTileRows);
  const dim3 grid(static_cast<unsigned int>((cols + kTile - 1) / kTile),
                  static_cast<unsigned int>((rows + kTile - 1) / kTile));
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;  // > 2M rows: not a conv kernel
  TransposeKernel<<<grid, block, 0, stream>>>(in, rows, cols, out);
  return cudaGetLastError();
}

cudaError_t LaunchPadNhwc(const float* in, int n, int h, int w, int c, int top, int bottom,
                          int left, int right, float fill, float* out, cudaStream_t stream) {
  const int ph = h + top + bottom, pw = w + left + right;
  const int64_t total = static_cast<int64_t>(n) * ph * pw * c;
  if (total == 0) return cudaSuccess;
  PadNhwcKernel<<<Blocks(total), kThreads, 0, stream>>>(in, n, h, w, c, top, left, ph, pw, fill,
                                                       out);
  return cudaGetLastError();
}

cudaError_t LaunchCropNhwc(const float* in, int n, int h, int w, int c, int top, int bottom,
                           int left, int right, float* out, cudaStream_t stream) {
  const int ph = h + top + bottom, pw = w + left + right;
  const int64_t total = static_cast<int64_t>(n) * h * w * c;
  if (total == 0) return cudaSuccess;
  CropNhwcKernel<<<Blocks(total), kThreads, 0, stream>>>(in, n, h, w, c, top, left, ph, pw, out);
  return cudaGetLastError();
}

cudaError_t LaunchFill(float* out, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FillKernel<<<Blocks(n), kThreads, 0, stream>>>(out, n, value);
  return cudaGetLastError();
}

cudaError_t LaunchSoftmaxCrossEntropy(const float* logits, const int32_t* labels, int batch,
                                      int classes, double* loss, int32_t* correct,
                                      float* d_logits, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  const int blocks = (batch + kThreads - 1) / kThreads;
  SoftmaxCrossEntropyKernel<<<blocks, kThreads, 0, stream>>>(logits, labels, batch, classes, loss,
                                                             correct, d_logits);
  return cudaGetLastError();
}

}  // namespace psflow::worker::cuda_internal
