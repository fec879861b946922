// Host launchers for the device kernels (plain C++: the host-only build links stubs of these).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/lora_merge.h"

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

// Same, but asynchronous: writes the value to the 8-byte device location `out` when `stream` gets there, and
// to the page-locked host word `host_out` too when it is not 0 (stored by the kernel: no copy engine is used,
// so the value does not wait behind a long copy in flight; read it once the stream passed the checksum).
void device_checksum_into(uintptr_t ptr, size_t nbytes, size_t stride_words, uintptr_t out, uintptr_t stream,
                          int device, uintptr_t host_out);

// The checksums of n windows in one batch (three kernel launches whatever n is, where one call a window
// launches three each). descs: page-locked host memory of n * kChecksumDescWords uint64 (core/checksum.h:
// address, nbytes, stride_words a window), read by the kernels where they run, so it must stay as it is until
// `stream` passed them. The n values land at the device address `out` (n words) and at the page-locked host
// words `host_out` too when it is not 0 (stored by the kernel). Every window is checked as device_checksum_into
// checks one before anything is queued.
void device_checksum_many_into(uintptr_t descs, size_t n, uintptr_t out, uintptr_t stream, int device,
                               uintptr_t host_out);

// Most words device_store_words moves: it is for small results (checksums, flags), not for data.
constexpr size_t kStoreWordsMax = 1 << 20;

// Copies n_words 8-byte words from device memory at `src` to page-locked host memory at `host_out`, by a
// kernel in `stream` order: a small result read back this way never queues behind a long copy the process
// has in flight on a copy engine (a cudaMemcpy to the host would). Read it once the stream passed it.
void device_store_words(uintptr_t src, size_t n_words, uintptr_t host_out, uintptr_t stream, int device);

// The noise of core/seeded_noise.h for n seeded rows of the float32 tensor at device address q (row_stride
// elements apart, n_q_rows rows, vocab columns), in one launch on `stream`. meta: a device address of 3 * n
// int64 (the rows, then their seeds, then their offsets); a row outside q is skipped (callers check first).
// Asynchronous: nothing waits.
void device_exponential_rows(uintptr_t q, int64_t row_stride, int64_t n_q_rows, int64_t vocab, uintptr_t meta,
                             int64_t n, uintptr_t stream, int device);

// NotAvailable when no CUDA device is usable, InvalidArgument when `device` is not visible; `what` names the
// caller in the message. (CUDA build only.)
void require_device(int device, const char* what);

// Refuses an address that is not device memory of `device` (plain host memory, another GPU's) before a kernel
// touches it: an illegal address would poison the context. `what` names the caller in the message. (CUDA
// build only.)
void check_device_pointer(uintptr_t ptr, size_t nbytes, int device, const char* what);

// The LoRA merge of core/lora_merge.h on device memory of `device` (cuda/lora_merge.cu): one launch on
// `stream`, asynchronous; the arguments are checked as the host version checks them before anything runs.
void device_lora_merge(const LoraMergeArgs& a, uintptr_t stream, int device);

}  // namespace colomem
