#include "cuda/cuda_check.h"

namespace colomem {

namespace {
const char* hint_for(cudaError_t err) {
  switch (err) {
    case cudaErrorMemoryAllocation:
      return " Free GPU memory first (offload the trainer, lower gpu_memory_utilization or the batch) and retry.";
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return " No usable CUDA device: check the driver and CUDA_VISIBLE_DEVICES, or use the host path (device='cpu').";
    case cudaErrorInvalidDevice:
      return " The device index is not visible in this process (CUDA_VISIBLE_DEVICES).";
    case cudaErrorHostMemoryAlreadyRegistered:
      return " This host range is already registered (pinned) by someone else.";
    default:
      return "";
  }
}
}  // namespace

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line, const char* func) {
  // Clear the non-sticky error so the next call in this thread starts clean.
  (void)cudaGetLastError();
  std::string msg = cat(expr, " failed: ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ", status ",
                        static_cast<int>(err), ") at ", file, ":", line, " in ", func, ".", hint_for(err));
  if (err == cudaErrorMemoryAllocation) throw CudaOutOfMemory(msg, static_cast<int>(err), cudaGetErrorName(err));
  throw CudaError(msg, static_cast<int>(err), cudaGetErrorName(err));
}

DeviceGuard::DeviceGuard(int device) {
  COLOMEM_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device) {
    COLOMEM_CUDA_CHECK(cudaSetDevice(device));
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_ && cudaSetDevice(prev_) != cudaSuccess) warn("could not restore the current CUDA device");
}

}  // namespace colomem
