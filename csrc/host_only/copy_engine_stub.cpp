#include "core/copy_engine.h"
#include "core/errors.h"

namespace colomem {

std::shared_ptr<CopyEngine> make_cuda_copy_engine(int device, size_t, size_t) {
  throw NotAvailable(cat("cannot create a copy engine for cuda:", device,
                         ": colomem was built without CUDA. Reinstall with nvcc on PATH or CUDA_HOME set, "
                         "or use the host path (device='cpu')"));
}

}  // namespace colomem
