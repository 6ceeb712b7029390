// Error macros for CUDA runtime and NCCL calls: a failure throws asyncpp::Error naming the call,
// the error string and file:line. The CUDA macro exists only in builds with CUDA.
#pragma once
#ifdef ASYNCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "core/error.h"
#include "nccl/nccl_loader.h"

namespace asyncpp::nccl::status {

// ncclResult_t values the transport treats specially (from NCCL's documented enum).
constexpr Result kSuccess = 0;
constexpr Result kInProgress = 7;

inline const char* nccl_error_string(Result r) {
  const Api& a = api();
  return a.ncclGetErrorString ? a.ncclGetErrorString(r) : "unknown NCCL error";
}

}  // namespace asyncpp::nccl::status

#ifdef ASYNCPP_WITH_CUDA
#define ASYNCPP_CUDA_CHECK(call)                                                             \
  do {                                                                                       \
    cudaError_t asyncpp_cuda_err_ = (call);                                                  \
    if (asyncpp_cuda_err_ != cudaSuccess) {                                                  \
      cudaGetLastError(); /* clear a non-sticky error so later calls are not blamed */       \
      ::asyncpp::detail::fail<::asyncpp::Error>(                                             \
          __FILE__, __LINE__, #call,                                                         \
          ::asyncpp::detail::concat("CUDA call failed: ", cudaGetErrorName(asyncpp_cuda_err_), \
                                    ": ", cudaGetErrorString(asyncpp_cuda_err_)));           \
    }                                                                                        \
  } while (0)
#endif  // ASYNCPP_WITH_CUDA

#define ASYNCPP_NCCL_CHECK(call)                                                             \
  do {                                                                                       \
    ::asyncpp::nccl::Result asyncpp_nccl_res_ = (call);                                      \
    if (asyncpp_nccl_res_ != ::asyncpp::nccl::status::kSuccess &&                            \
        asyncpp_nccl_res_ != ::asyncpp::nccl::status::kInProgress) {                         \
      ::asyncpp::detail::fail<::asyncpp::Error>(                                             \
          __FILE__, __LINE__, #call,                                                         \
          ::asyncpp::detail::concat("NCCL call failed (error ", asyncpp_nccl_res_, "): ",   \
                                    ::asyncpp::nccl::status::nccl_error_string(asyncpp_nccl_res_))); \
    }                                                                                        \
  } while (0)
