// Host-only build: a mapped range on the host works (core/mapped_range.cpp); one on a GPU raises NotAvailable.
#include "core/errors.h"
#include "core/mapped_range.h"

namespace colomem {

std::shared_ptr<MappedRange> make_device_range(int, size_t, size_t) {
  throw NotAvailable("a mapped range on a CUDA device: colomem was built without CUDA; reinstall with nvcc on PATH "
                     "or CUDA_HOME set");
}

}  // namespace colomem
