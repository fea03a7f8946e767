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

  int64_t num_elements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t num_bytes() const { return num_elements() * 4; }  // float32
  // Elements in one row of dimension 0 (1 for a scalar or a vector).
  int64_t row_elements() const {
    int64_t n = 1;
    for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
    return n;
  }
  int64_t num_rows() const { return shape.empty() ? 1 : shape[0]; }
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_VARIABLE_SPEC_H_
