// How far apart two names are, for "did you mean" hints (flags, TF_CONFIG
// keys).
#ifndef PSFLOW_COMMON_EDIT_DISTANCE_H_
#define PSFLOW_COMMON_EDIT_DISTANCE_H_

#include <cstddef>

#include "absl/strings/string_view.h"

namespace psflow {

// Levenshtein distance: insertions, deletions and substitutions of bytes.
size_t EditDistance(absl::string_view a, absl::string_view b);

}  // namespace psflow

#endif  // PSFLOW_COMMON_EDIT_DISTANCE_H_
