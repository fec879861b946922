#include "cuda/batch_copy.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "core/copy_engine.h"
#include "cuda/cuda_check.h"

namespace colomem {

namespace {
constexpr size_t kMaxBatch = 1024;

bool legacy_stream(cudaStream_t s) {
  // The batch API refuses the legacy default stream (handle 0 or cudaStreamLegacy).
  return s == nullptr || s == cudaStreamLegacy;
}
}  // namespace

void enqueue_copies(void* const* dst, const void* const* src, const size_t* nbytes, size_t count,
                    cudaMemcpyKind kind, cudaStream_t stream, bool& batch_ok) {
  if (count > 1 && batch_ok && !legacy_stream(stream)) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t idx = 0, done = 0;
    while (done < count) {
      size_t n = std::min(kMaxBatch, count - done);
      cudaError_t e = cudaMemcpyBatchAsync(const_cast<void**>(dst + done), const_cast<const void* const*>(src + done),
                                           const_cast<size_t*>(nbytes + done), n, &attr, &idx, 1, stream);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue)
          throw_cuda_error(e, "cudaMemcpyBatchAsync", __FILE__, __LINE__, __func__);
        batch_ok = false;  // refused: the rest go one by one, in order after what was batched
        break;
      }
      done += n;
    }
    if (done == count) return;
    dst += done, src += done, nbytes += done, count -= done;
  }
  for (size_t i = 0; i < count; ++i) COLOMEM_CUDA_CHECK(cudaMemcpyAsync(dst[i], src[i], nbytes[i], kind, stream));
}

void cuda_copy_ranges(const std::vector<CopyOp>& ops, uintptr_t stream, int device) {
  if (ops.empty()) return;
  DeviceGuard g(device);
  std::vector<void*> d(ops.size());
  std::vector<const void*> s(ops.size());
  std::vector<size_t> n(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    d[i] = reinterpret_cast<void*>(ops[i].dst);
    s[i] = reinterpret_cast<const void*>(ops[i].src);
    n[i] = ops[i].nbytes;
  }
  static std::atomic<bool> batch_ok{true};  // a driver without batching says so once
  bool ok = batch_ok.load();
  enqueue_copies(d.data(), s.data(), n.data(), ops.size(), cudaMemcpyDefault, reinterpret_cast<cudaStream_t>(stream),
                 ok);
  if (!ok && !legacy_stream(reinterpret_cast<cudaStream_t>(stream))) batch_ok.store(false);
}

}  // namespace colomem
