#include "cuda/pointer_query.h"

#include "cuda/cuda_check.h"
#include "cuda/driver_api.h"

namespace colomem {

bool pointer_is_mapped(uintptr_t ptr) {
  const DriverApi& d = driver();
  // The driver writes a boolean into the low byte; the rest stays as initialised.
  unsigned int mapped = 0;
  CUresult r = d.cuPointerGetAttribute(&mapped, CU_POINTER_ATTRIBUTE_MAPPED, static_cast<CUdeviceptr>(ptr));
  if (r == CUDA_ERROR_INVALID_VALUE) return false;  // not an address the driver manages (any more)
  COLOMEM_CU_CHECK(r);
  return (mapped & 0xFFu) != 0;
}

}  // namespace colomem
