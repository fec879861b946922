#include "core/copy_engine.h"
#include "core/errors.h"

namespace colomem {

std::shared_ptr<CopyEngine> make_cuda_copy_engine(int device, size_t, size_t, double) {
  throw NotAvailable(cat("cannot create a copy engine for cuda:", device,
                         ": colomem was built without CUDA. Reinstall with nvcc on PATH or CUDA_HOME set, "
                         "or use the host path (device='cpu')"));
}

void cuda_copy_ranges(const std::vector<CopyOp>&, uintptr_t, int device) {
  throw NotAvailable(cat("copy_ranges on cuda:", device, ": colomem was built without CUDA; reinstall with nvcc on "
                         "PATH or CUDA_HOME set, or pass device=-1 for host memory"));
}

}  // namespace colomem
