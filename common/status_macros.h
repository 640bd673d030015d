// Status propagation helpers used across pshard.
#ifndef PSHARD_COMMON_STATUS_MACROS_H_
#define PSHARD_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PSHARD_CONCAT_INNER_(a, b) a##b
#define PSHARD_CONCAT_(a, b) PSHARD_CONCAT_INNER_(a, b)

/// Returns from the enclosing function if `expr` yields a non-OK status.
#define RETURN_IF_ERROR(expr)                              \
  do {                                                     \
    ::absl::Status pshard_status_ = (expr);                \
    if (!pshard_status_.ok()) return pshard_status_;       \
  } while (false)

/// `ASSIGN_OR_RETURN(auto x, F())` binds the value of a StatusOr or returns
/// its error from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  PSHARD_ASSIGN_OR_RETURN_IMPL_(PSHARD_CONCAT_(pshard_statusor_, __LINE__), lhs, expr)
#define PSHARD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

#endif  // PSHARD_COMMON_STATUS_MACROS_H_
