// PSFLOW_RETURN_IF_ERROR / PSFLOW_ASSIGN_OR_RETURN: Debian 12's Abseil
// (20220623) predates Abseil's own status macros.
#ifndef PSFLOW_COMMON_STATUS_MACROS_H_
#define PSFLOW_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PSFLOW_STATUS_CONCAT_INNER_(a, b) a##b
#define PSFLOW_STATUS_CONCAT_(a, b) PSFLOW_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) fails.
#define PSFLOW_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status psflow_status_ = (expr);          \
    if (!psflow_status_.ok()) return psflow_status_; \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error.
#define PSFLOW_ASSIGN_OR_RETURN(lhs, expr) \
  PSFLOW_ASSIGN_OR_RETURN_IMPL_(PSFLOW_STATUS_CONCAT_(psflow_or_, __LINE__), lhs, expr)
#define PSFLOW_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

#endif  // PSFLOW_COMMON_STATUS_MACROS_H_
