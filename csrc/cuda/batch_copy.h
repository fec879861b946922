// Enqueues many copies with cudaMemcpyBatchAsync (one driver call per 1024), or one cudaMemcpyAsync each
// where batching is refused (older drivers; the legacy default stream).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace colomem {

// batch_ok: in = try batching, out = false once the runtime refused it (callers may remember that).
void enqueue_copies(void* const* dst, const void* const* src, const size_t* nbytes, size_t count,
                    cudaMemcpyKind kind, cudaStream_t stream, bool& batch_ok);

}  // namespace colomem
