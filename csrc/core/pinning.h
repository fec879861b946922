// Page-locking of host ranges for DMA. The CUDA build registers with cudaHostRegister
// (cuda/pin.cpp); the host-only build has no registration (host_only/pin.cpp throws NotAvailable).
#pragma once

#include <cstddef>

namespace colomem {

// True when this build can page-lock memory and a CUDA device is visible.
bool pinning_available();
// Page-locks [ptr, ptr + nbytes) for all CUDA contexts (portable). Throws CudaError / NotAvailable.
void pin_range(void* ptr, size_t nbytes);
// Undoes pin_range; reports (never throws) on failure, since it runs from destructors.
void unpin_range(void* ptr);
// Number of visible CUDA devices; 0 without a driver, a device, or CUDA in this build.
int visible_device_count();

}  // namespace colomem
