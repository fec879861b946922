// Host-only build: no driver to ask about device addresses.
#include "core/errors.h"
#include "cuda/pointer_query.h"

namespace colomem {

bool pointer_is_mapped(uintptr_t) {
  throw NotAvailable("pointer_is_mapped: colomem was built without CUDA; reinstall with nvcc on PATH or "
                     "CUDA_HOME set");
}

}  // namespace colomem
