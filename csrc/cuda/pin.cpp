#include <cuda_runtime_api.h>

#include "core/pinning.h"
#include "cuda/cuda_check.h"

namespace colomem {

int visible_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

bool pinning_available() { return visible_device_count() > 0; }

void pin_range(void* ptr, size_t nbytes) {
  if (!pinning_available())
    throw NotAvailable("cannot pin host memory: no CUDA device is visible (driver missing or "
                       "CUDA_VISIBLE_DEVICES empty); create the pool with pin=False or pin='auto'");
  COLOMEM_CUDA_CHECK(cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable));
}

void unpin_range(void* ptr) {
  cudaError_t err = cudaHostUnregister(ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    warn(cat("cudaHostUnregister failed: ", cudaGetErrorString(err)));
  }
}

}  // namespace colomem
