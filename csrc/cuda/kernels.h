// Host launchers for the device kernels (plain C++: the host-only build links stubs of these).
#pragma once

#include <cstddef>
#include <cstdint>

namespace colomem {

// The checksum of core/checksum.h over device memory [ptr, ptr + nbytes) on `device`, computed on `stream`
// (a cudaStream_t as an integer; 0 = legacy default stream). Synchronises only that stream. ptr must be
// 8-byte aligned.
uint64_t device_checksum(uintptr_t ptr, size_t nbytes, size_t stride_words, uintptr_t stream, int device);

// Same, but asynchronous: writes the value to the 8-byte device location `out` when `stream` gets there.
void device_checksum_into(uintptr_t ptr, size_t nbytes, size_t stride_words, uintptr_t out, uintptr_t stream,
                          int device);

}  // namespace colomem
