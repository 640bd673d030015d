// CUDA runtime and cuBLAS errors as absl::Status, wrapped at the call with
// the call's text and file:line:
//
//   CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream));
//   // -> Internal "cudaMemcpyAsync(dst, src, bytes, kind, stream) failed:
//   //    invalid argument (cudaErrorInvalidValue) at cuda_gpt.cc:123"
//
// Nothing here exits or aborts.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_CHECK_H_
#define PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_CHECK_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pshard::internal {

/// The Status of a failed CUDA runtime call: ResourceExhausted for out of
/// memory, FailedPrecondition when there is no usable device or driver,
/// Internal otherwise.
inline absl::Status CudaError(const char* call, cudaError_t error, const char* file, int line) {
  const std::string message = absl::StrCat(call, " failed: ", cudaGetErrorString(error), " (",
                                           cudaGetErrorName(error), ") at ", file, ":", line);
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

/// The Status of a failed cuBLAS call: ResourceExhausted when cuBLAS could
/// not allocate, Internal otherwise.
inline absl::Status CublasError(const char* call, cublasStatus_t status, const char* file,
                                int line) {
  const std::string message = absl::StrCat(call, " failed: ", cublasGetStatusString(status), " (",
                                           cublasGetStatusName(status), ") at ", file, ":", line);
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace pshard::internal

/// Returns the CudaError Status from the enclosing function if the CUDA
/// runtime call `expr` does not return cudaSuccess.
#define CUDA_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                     \
    const cudaError_t pshard_cuda_error_ = (expr);                                         \
    if (pshard_cuda_error_ != cudaSuccess) {                                               \
      return ::pshard::internal::CudaError(#expr, pshard_cuda_error_, __FILE__, __LINE__); \
    }                                                                                      \
  } while (false)

/// Returns the CublasError Status from the enclosing function if the cuBLAS
/// call `expr` does not return CUBLAS_STATUS_SUCCESS.
#define CUBLAS_RETURN_IF_ERROR(expr)                                                            \
  do {                                                                                          \
    const cublasStatus_t pshard_cublas_status_ = (expr);                                        \
    if (pshard_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                       \
      return ::pshard::internal::CublasError(#expr, pshard_cublas_status_, __FILE__, __LINE__); \
    }                                                                                           \
  } while (false)

#endif  // PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_CHECK_H_
