// Host-only build: a mapped range on the host works (core/mapped_range.cpp); one on a GPU raises NotAvailable.
#include "core/errors.h"
#include "core/mapped_range.h"

namespace colomem {

namespace {

[[noreturn]] void no_cuda() {
  throw NotAvailable("a mapped range on a CUDA device: colomem was built without CUDA; reinstall with nvcc on PATH "
                     "or CUDA_HOME set");
}

}  // namespace

std::shared_ptr<MappedRange> make_device_range(int, size_t, size_t) { no_cuda(); }

std::shared_ptr<MappedRange> attach_device_range(int, uintptr_t, size_t, size_t) { no_cuda(); }

}  // namespace colomem
