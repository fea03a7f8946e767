// VariableSpec: the name and shape of one model variable, as both the worker
// (which defines the model) and the PS (which stores it) see it.
#ifndef PSFLOW_COMMON_VARIABLE_SPEC_H_
#define PSFLOW_COMMON_VARIABLE_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

namespace psflow {

struct VariableSpec {
  std::string name;            // e.g. "dense_1/kernel"; unique in a model
  std::vector<int64_t> shape;  // row-major; dimension 0 is the split axis

  // The products saturate at INT64_MAX instead of overflowing (undefined
  // behaviour, and a negative count that passes "too large" checks): a shape
  // from a request or a flag may be anything.
  int64_t num_elements() const { return Product(0); }
  int64_t num_bytes() const {  // float32
    const int64_t n = num_elements();
    return n > INT64_MAX / 4 ? INT64_MAX : n * 4;
  }
  // Elements in one row of dimension 0 (1 for a scalar or a vector).
  int64_t row_elements() const { return Product(1); }
  int64_t num_rows() const { return shape.empty() ? 1 : shape[0]; }

 private:
  int64_t Product(size_t first) const {
    int64_t n = 1;
    for (size_t i = first; i < shape.size(); ++i) {
      if (__builtin_mul_overflow(n, shape[i], &n)) return INT64_MAX;
    }
    return n;
  }
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_VARIABLE_SPEC_H_
