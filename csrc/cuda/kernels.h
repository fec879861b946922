// Host launchers for the device kernels (plain C++: the host-only build links stubs of these).
#pragma once

#include <cstddef>
#include <cstdint>

namespace colomem {

// How long device_checksum waits by default for its stream to get through the work queued before it.
constexpr double kChecksumWaitS = 60.0;

// The checksum of core/checksum.h over device memory [ptr, ptr + nbytes) on `device`, computed on `stream`
// (a cudaStream_t as an integer; 0 = legacy default stream). Waits up to timeout_s (inf: no bound; NaN or
// negative: InvalidArgument) for the stream to get there and only for that stream; Timeout after that, with
// nothing left waiting (the kernels still run on the stream and free their scratch memory themselves).
// ptr must be 8-byte aligned.
uint64_t device_checksum(uintptr_t ptr, size_t nbytes, size_t stride_words, uintptr_t stream, int device,
                         double timeout_s);

// Same, but asynchronous: writes the value to the 8-byte device location `out` when `stream` gets there.
void device_checksum_into(uintptr_t ptr, size_t nbytes, size_t stride_words, uintptr_t out, uintptr_t stream,
                          int device);

// The noise of core/seeded_noise.h for n seeded rows of the float32 tensor at device address q (row_stride
// elements apart, n_q_rows rows, vocab columns), in one launch on `stream`. meta: a device address of 3 * n
// int64 (the rows, then their seeds, then their offsets); a row outside q is skipped (callers check first).
// Asynchronous: nothing waits.
void device_exponential_rows(uintptr_t q, int64_t row_stride, int64_t n_q_rows, int64_t vocab, uintptr_t meta,
                             int64_t n, uintptr_t stream, int device);

}  // namespace colomem
