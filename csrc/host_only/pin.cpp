#include "core/errors.h"
#include "core/pinning.h"

namespace colomem {

int visible_device_count() { return 0; }
bool pinning_available() { return false; }

void pin_range(void*, size_t) {
  throw NotAvailable("colomem was built without CUDA, so it cannot pin host memory; create the pool with "
                     "pin=False, or reinstall with nvcc on PATH or CUDA_HOME set");
}

void unpin_range(void*) {}

}  // namespace colomem
