// Check macros for the CUDA runtime and driver. A failure throws CudaError (CudaOutOfMemory for
// out-of-memory) with "<expr> failed: <error string> (<name>, status N) at file:line in function".
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "core/errors.h"

namespace colomem {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line,
                                   const char* func);
[[noreturn]] void throw_cu_error(CUresult err, const char* expr, const char* file, int line,
                                 const char* func);

// Sets the current device for the lifetime of the guard and restores the previous one after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  bool changed_ = false;
};

}  // namespace colomem

#define COLOMEM_CUDA_CHECK(expr)                                                      \
  do {                                                                                \
    cudaError_t colomem_err_ = (expr);                                                \
    if (colomem_err_ != cudaSuccess)                                                  \
      ::colomem::throw_cuda_error(colomem_err_, #expr, __FILE__, __LINE__, __func__); \
  } while (0)

#define COLOMEM_CU_CHECK(expr)                                                      \
  do {                                                                              \
    CUresult colomem_res_ = (expr);                                                 \
    if (colomem_res_ != CUDA_SUCCESS)                                               \
      ::colomem::throw_cu_error(colomem_res_, #expr, __FILE__, __LINE__, __func__); \
  } while (0)
