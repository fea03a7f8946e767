#include "worker/cuda/cuda_check.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace psflow::worker::cuda_internal {

std::string CallErrorText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", static_cast<int>(e), "): ", cudaGetErrorString(e));
}

std::string CallErrorText(cudnnStatus_t s) {
  std::string text = absl::StrCat(cudnnGetErrorString(s), " (", static_cast<int>(s), ")");
  // cuDNN 9 keeps a thread-local description of the last failure (which
  // check failed and why); it is the most useful part when debugging.
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  if (detail[0] != '\0') absl::StrAppend(&text, ": ", detail);
  return text;
}

std::string CallErrorText(cublasStatus_t s) {
  return absl::StrCat(cublasGetStatusName(s), " (", static_cast<int>(s),
                      "): ", cublasGetStatusString(s));
}

absl::Status CallError(const char* file, int line, const char* call, const std::string& text) {
  return absl::InternalError(absl::StrCat(file, ":", line, ": ", call, " failed: ", text));
}

}  // namespace psflow::worker::cuda_internal
