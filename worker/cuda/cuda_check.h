// PSFLOW_CUDA_RETURN_IF_ERROR: turns a failed CUDA runtime, cuDNN or cuBLAS
// call into absl::InternalError naming the file, the line, the call and the
// library's own error text, and returns it from the enclosing function (after
// clearing the CUDA runtime's last error, which would otherwise be reported
// again by the next kernel launch's check). Never
// exits or aborts: a broken GPU is an error the worker reports, not a crash.
// Internal to worker/cuda/ (it includes the CUDA headers).
#ifndef PSFLOW_WORKER_CUDA_CUDA_CHECK_H_
#define PSFLOW_WORKER_CUDA_CUDA_CHECK_H_

#include <string>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "absl/status/status.h"

namespace psflow::worker::cuda_internal {

inline bool CallSucceeded(cudaError_t e) { return e == cudaSuccess; }
inline bool CallSucceeded(cudnnStatus_t s) { return s == CUDNN_STATUS_SUCCESS; }
inline bool CallSucceeded(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }

// "cudaErrorInvalidValue (1): invalid argument", and for cuDNN the detail of
// cudnnGetLastErrorString when it has one.
std::string CallErrorText(cudaError_t e);
std::string CallErrorText(cudnnStatus_t s);
std::string CallErrorText(cublasStatus_t s);

// "worker/cuda/x.cc:42: cudnnConvolutionForward(...) failed: <text>".
absl::Status CallError(const char* file, int line, const char* call, const std::string& text);

}  // namespace psflow::worker::cuda_internal

#define PSFLOW_CUDA_RETURN_IF_ERROR(call)                                       \
  do {                                                                          \
    const auto psflow_cuda_rc_ = (call);                                        \
    if (!::psflow::worker::cuda_internal::CallSucceeded(psflow_cuda_rc_)) {     \
      /* Clear the runtime's last error, so the next launch's check does not */ \
      /* report this one again under its own name. */                           \
      cudaGetLastError();                                                       \
      return ::psflow::worker::cuda_internal::CallError(                        \
          __FILE__, __LINE__, #call,                                            \
          ::psflow::worker::cuda_internal::CallErrorText(psflow_cuda_rc_));     \
    }                                                                           \
  } while (0)

#endif  // PSFLOW_WORKER_CUDA_CUDA_CHECK_H_
