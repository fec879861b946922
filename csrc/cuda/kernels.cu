// The bucket checksum of core/checksum.h and the sampling noise of core/seeded_noise.h on the GPU (the LoRA
// merge has its own file, cuda/lora_merge.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "core/checksum.h"
#include "core/copy_engine.h"  // wait_bound
#include "core/seeded_noise.h"
#include "cuda/cuda_check.h"
#include "cuda/driver_api.h"
#include "cuda/event_wait.h"
#include "cuda/kernels.h"

namespace colomem {

namespace {

constexpr int kThreads = 256;

// This thread's share of term(i, w[i]) over the sampled words i = k * stride (k < n_samples): the grid's
// x dimension strides over them.
__device__ __forceinline__ uint64_t sampled_sum(const uint64_t* __restrict__ words, uint64_t n_samples,
                                                uint64_t stride) {
  uint64_t sum = 0;
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n_samples; k += step)
    sum += checksum_detail::term(k * stride, words[k * stride]);
  return sum;
}

// The block's threads' sums added to *out (atomically: several blocks share a value); every thread calls it.
__device__ __forceinline__ void block_sum_into(uint64_t sum, unsigned long long* out) {
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
  __shared__ uint64_t warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0;
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
    if (lane == 0 && sum != 0) atomicAdd(out, static_cast<unsigned long long>(sum));
  }
}

// A window's value from the sum of its sampled words: the off-grid last word and the zero-padded tail
// added, then finished (core/checksum.h).
__device__ __forceinline__ uint64_t finished_value(uint64_t sum, const unsigned char* base, uint64_t nbytes,
                                                   uint64_t stride) {
  const uint64_t n_words = nbytes / 8;
  if (checksum_detail::last_word_extra(n_words, stride))
    sum += checksum_detail::term(n_words - 1, reinterpret_cast<const uint64_t*>(base)[n_words - 1]);
  if (const uint64_t tail = nbytes % 8) {
    uint64_t w = 0;
    for (uint64_t b = 0; b < tail; ++b) w |= static_cast<uint64_t>(base[n_words * 8 + b]) << (8 * b);
    sum += checksum_detail::term(n_words, w);
  }
  return checksum_detail::finish(sum, nbytes, stride);
}

// Sums term(i, w[i]) over the sampled words i = k * stride (k < n_samples) into *out (atomically, per block).
__global__ void checksum_sum_kernel(const uint64_t* __restrict__ words, uint64_t n_samples, uint64_t stride,
                                    unsigned long long* out) {
  block_sum_into(sampled_sum(words, n_samples, stride), out);
}

// One thread: the sum's start. A kernel, not cudaMemsetAsync: a memset may run on a copy engine, and there it
// would wait behind a long copy the process has in flight in that direction.
__global__ void checksum_zero_kernel(unsigned long long* out) { *out = 0; }

// One thread: adds the off-grid last word and the zero-padded tail, then finishes the value in place (and
// stores it into page-locked host memory when host_out is set: a store over the bus, no copy engine).
__global__ void checksum_finish_kernel(unsigned long long* out, const unsigned char* base, uint64_t nbytes,
                                       uint64_t stride, unsigned long long* host_out) {
  *out = finished_value(*out, base, nbytes, stride);
  if (host_out) {
    *host_out = *out;
    __threadfence_system();
  }
}

// The batched checksum: window blockIdx.y of `descs` (address, nbytes, stride_words), its sampled words summed
// by gridDim.x blocks into out[blockIdx.y]; blocks past a window's samples add nothing.
__global__ void checksum_many_sum_kernel(const uint64_t* __restrict__ descs, unsigned long long* out) {
  const uint64_t* d = descs + static_cast<uint64_t>(blockIdx.y) * kChecksumDescWords;
  const uint64_t* words = reinterpret_cast<const uint64_t*>(d[0]);
  const uint64_t n_words = d[1] / 8, stride = d[2];
  block_sum_into(sampled_sum(words, n_words == 0 ? 0 : (n_words - 1) / stride + 1, stride), out + blockIdx.y);
}

__global__ void checksum_many_zero_kernel(unsigned long long* out, uint64_t n) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) out[i] = 0;
}

// One thread a window: the off-grid last word and the tail, the finish, the store to the host when asked.
__global__ void checksum_many_finish_kernel(const uint64_t* __restrict__ descs, unsigned long long* out, uint64_t n,
                                            unsigned long long* host_out) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t w = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < n; w += step) {
    const uint64_t* d = descs + w * kChecksumDescWords;
    out[w] = finished_value(out[w], reinterpret_cast<const unsigned char*>(d[0]), d[1], d[2]);
    if (host_out) host_out[w] = out[w];
  }
  if (host_out) __threadfence_system();
}

// Copies n 8-byte words from device memory to mapped page-locked host memory, the SMs storing over the bus.
__global__ void store_words_kernel(const unsigned long long* __restrict__ src, uint64_t n,
                                   unsigned long long* __restrict__ dst) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) dst[i] = src[i];
  __threadfence_system();
}

// One thread per (seeded row, 4 columns): one Philox block gives the four uniforms.
__global__ void exponential_rows_kernel(float* __restrict__ q, int64_t row_stride, int64_t n_q_rows, int64_t vocab,
                                        const int64_t* __restrict__ meta, int64_t n) {
  const int64_t quads = (vocab + 3) / 4;
  const int64_t total = n * quads;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += step) {
    const int64_t i = t / quads, quad = t - i * quads;
    const int64_t row = meta[i];
    if (row < 0 || row >= n_q_rows) continue;
    const noise_detail::Block4 b = noise_detail::quad_bits(static_cast<uint64_t>(meta[n + i]),
                                                           static_cast<uint64_t>(meta[2 * n + i]),
                                                           static_cast<uint64_t>(quad));
    float* out = q + row * row_stride + quad * 4;
    const int64_t left = vocab - quad * 4;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (k < left) out[k] = -logf(noise_detail::open_uniform(b.x[k]));
  }
}

// A private non-blocking stream per device for reading results back once they are known to be ready: a copy
// to pageable memory returns only when it completed, so on the caller's stream it would wait, without bound,
// for whatever was queued there after the checksum. Created on first use, kept for the process.
cudaStream_t readback_stream(int device) {
  static std::mutex mu;
  static std::vector<cudaStream_t> streams;
  std::lock_guard<std::mutex> lk(mu);
  if (streams.size() <= static_cast<size_t>(device)) streams.resize(device + 1, nullptr);
  if (!streams[device]) COLOMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking));
  return streams[device];
}

// The device's address of page-locked host memory (the same address under unified addressing).
unsigned long long* mapped_host_word(uintptr_t host_out, const char* what = "host_out") {
  require(host_out != 0 && host_out % 8 == 0, cat("`", what, "` must be an 8-byte aligned host address"));
  void* dev = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&dev, reinterpret_cast<void*>(host_out), 0);
  if (err != cudaSuccess || dev == nullptr) {
    (void)cudaGetLastError();
    throw InvalidArgument(cat(what, " ", hex(host_out), " is not page-locked host memory mapped for "
                              "the device (", cudaGetErrorName(err), "); pass a pinned tensor's address "
                              "(pin_memory())", std::string(what) == "host_out" ? " or 0" : ""));
  }
  return static_cast<unsigned long long*>(dev);
}

}  // namespace

void require_device(int device, const char* what) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw NotAvailable(cat(what, " on cuda:", device, ": no CUDA device is usable (", cudaGetErrorName(err),
                           "); pass device=-1 for host memory"));
  }
  require(device >= 0 && device < n, cat(what, ": cuda:", device, " is not visible (", n, " devices)"));
}

// Refuses plain host memory before a kernel touches it (an illegal address would poison the context).
void check_device_pointer(uintptr_t ptr, size_t nbytes, int device, const char* what) {
  if (nbytes == 0) return;
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(ptr));
  if (err != cudaSuccess) (void)cudaGetLastError();
  if (err == cudaSuccess && attr.type == cudaMemoryTypeDevice && attr.device != device)
    throw InvalidArgument(cat(what, ": address ", hex(ptr), " is on cuda:", attr.device,
                              ", not cuda:", device));
  if (err == cudaSuccess && attr.type != cudaMemoryTypeUnregistered) return;
  // VMM mappings (ours, vLLM's) may report no memory type: they have an allocation handle.
  CUmemGenericAllocationHandle h = 0;
  if (driver().cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(ptr)) == CUDA_SUCCESS) {
    driver().cuMemRelease(h);
    return;
  }
  throw InvalidArgument(cat(what, ": address ", hex(ptr),
                            " is not CUDA memory; pass device=-1 for host memory"));
}

void device_checksum_into(uintptr_t ptr, size_t nbytes, size_t stride_words, uintptr_t out, uintptr_t stream,
                          int device, uintptr_t host_out) {
  require(stride_words >= 1, cat("stride_words must be >= 1, got ", stride_words));
  require(ptr % 8 == 0, cat("checksum on the GPU needs an 8-byte aligned address, got ", hex(ptr)));
  require(out != 0 && out % 8 == 0, "checksum: `out` must be an 8-byte aligned device address");
  require_device(device, "checksum");
  DeviceGuard guard(device);
  check_device_pointer(ptr, nbytes, device, "checksum");
  unsigned long long* host_word = host_out ? mapped_host_word(host_out) : nullptr;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  auto* result = reinterpret_cast<unsigned long long*>(out);
  checksum_zero_kernel<<<1, 1, 0, s>>>(result);
  COLOMEM_CUDA_CHECK(cudaGetLastError());
  const uint64_t n_words = nbytes / 8;
  const uint64_t n_samples = n_words == 0 ? 0 : (n_words - 1) / stride_words + 1;
  if (n_samples > 0) {
    int sms = 0;
    COLOMEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const uint64_t want = (n_samples + kThreads - 1) / kThreads;
    const unsigned int blocks = static_cast<unsigned int>(std::min<uint64_t>(want, std::max(sms, 1) * 8ull));
    checksum_sum_kernel<<<blocks, kThreads, 0, s>>>(reinterpret_cast<const uint64_t*>(ptr), n_samples,
                                                    stride_words, result);
    COLOMEM_CUDA_CHECK(cudaGetLastError());
  }
  checksum_finish_kernel<<<1, 1, 0, s>>>(result, reinterpret_cast<const unsigned char*>(ptr), nbytes,
                                         stride_words, host_word);
  COLOMEM_CUDA_CHECK(cudaGetLastError());
}

void device_checksum_many_into(uintptr_t descs, size_t n, uintptr_t out, uintptr_t stream, int device,
                               uintptr_t host_out) {
  if (n == 0) return;
  require(descs != 0 && descs % 8 == 0, "checksum_many: `descs` must be an 8-byte aligned host address");
  require(out != 0 && out % 8 == 0, "checksum_many: `out` must be an 8-byte aligned device address");
  require_device(device, "checksum");
  DeviceGuard guard(device);
  // page-locked host memory first (a device address would fault this thread's reads below), then every
  // window checked before anything is queued: a bad address would poison the context
  const auto* dev_descs = reinterpret_cast<const uint64_t*>(mapped_host_word(descs, "descs"));
  const auto* host_descs = reinterpret_cast<const uint64_t*>(descs);
  uint64_t most = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t* d = host_descs + i * kChecksumDescWords;
    require(d[2] >= 1, cat("checksum_many: window ", i, ": stride_words must be >= 1, got ", d[2]));
    require(d[0] % 8 == 0, cat("checksum_many: window ", i, ": the GPU needs an 8-byte aligned address, got ",
                               hex(d[0])));
    check_device_pointer(static_cast<uintptr_t>(d[0]), static_cast<size_t>(d[1]), device, "checksum");
    const uint64_t n_words = d[1] / 8;
    most = std::max(most, n_words == 0 ? uint64_t{0} : (n_words - 1) / d[2] + 1);
  }
  unsigned long long* host_words = host_out ? mapped_host_word(host_out) : nullptr;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  auto* result = reinterpret_cast<unsigned long long*>(out);
  const unsigned int spread = static_cast<unsigned int>(std::min<uint64_t>(std::max<uint64_t>(n / kThreads, 1), 64));
  checksum_many_zero_kernel<<<spread, kThreads, 0, s>>>(result, n);
  COLOMEM_CUDA_CHECK(cudaGetLastError());
  if (most > 0) {
    const unsigned int per_window = static_cast<unsigned int>(std::min<uint64_t>((most + kThreads - 1) / kThreads, 64));
    constexpr size_t kMaxGridY = 65535;
    for (size_t first = 0; first < n; first += kMaxGridY) {
      const unsigned int rows = static_cast<unsigned int>(std::min(n - first, kMaxGridY));
      checksum_many_sum_kernel<<<dim3(per_window, rows), kThreads, 0, s>>>(dev_descs + first * kChecksumDescWords,
                                                                          result + first);
      COLOMEM_CUDA_CHECK(cudaGetLastError());
    }
  }
  checksum_many_finish_kernel<<<spread, kThreads, 0, s>>>(dev_descs, result, n, host_words);
  COLOMEM_CUDA_CHECK(cudaGetLastError());
}

uint64_t device_checksum(uintptr_t ptr, size_t nbytes, size_t stride_words, uintptr_t stream, int device,
                         double timeout_s) {
  const auto bound = wait_bound(timeout_s);  // a bad timeout is refused before any work is queued
  require_device(device, "checksum");
  DeviceGuard guard(device);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  void* scratch = nullptr;
  COLOMEM_CUDA_CHECK(cudaMallocAsync(&scratch, sizeof(uint64_t), s));
  struct FreeScratch {  // stream-ordered: freed after the kernels, also when the caller stopped waiting
    void* p;
    cudaStream_t s;
    ~FreeScratch() {
      if (cudaFreeAsync(p, s) != cudaSuccess) (void)cudaGetLastError();
    }
  } free_scratch{scratch, s};
  device_checksum_into(ptr, nbytes, stride_words, reinterpret_cast<uintptr_t>(scratch), stream, device, 0);
  cudaEvent_t ready = nullptr;
  COLOMEM_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  struct DestroyEvent {  // destruction of an event still pending is deferred by the runtime: safe on timeout
    cudaEvent_t e;
    ~DestroyEvent() { (void)cudaEventDestroy(e); }
  } destroy_ready{ready};
  COLOMEM_CUDA_CHECK(cudaEventRecord(ready, s));
  if (!wait_event_until(ready, deadline_after(bound)))
    throw Timeout(cat("checksum of ", nbytes, " bytes on cuda:", device, " not done after ", timeout_s,
                      " s: its stream (", hex(stream), ") is still busy with work queued before it. Nothing "
                      "waits for it any more; retry with a longer timeout, or check that the GPU is not hung "
                      "(nvidia-smi)"));
  uint64_t value = 0;
  cudaStream_t rb = readback_stream(device);
  COLOMEM_CUDA_CHECK(cudaMemcpyAsync(&value, scratch, sizeof(value), cudaMemcpyDeviceToHost, rb));
  COLOMEM_CUDA_CHECK(cudaStreamSynchronize(rb));  // only this 8-byte copy is on it: its data is ready
  return value;
}

void device_store_words(uintptr_t src, size_t n_words, uintptr_t host_out, uintptr_t stream, int device) {
  if (n_words == 0) return;
  require(src != 0 && src % 8 == 0, "store_words: `src` must be an 8-byte aligned device address");
  require(n_words <= kStoreWordsMax, cat("store_words moves at most ", kStoreWordsMax, " words (small results), got ",
                                         n_words));
  require_device(device, "store_words");
  DeviceGuard guard(device);
  check_device_pointer(src, n_words * 8, device, "store_words");
  unsigned long long* dst = mapped_host_word(host_out);
  const unsigned int blocks = static_cast<unsigned int>(std::min<uint64_t>((n_words + kThreads - 1) / kThreads, 64));
  store_words_kernel<<<blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const unsigned long long*>(src), n_words, dst);
  COLOMEM_CUDA_CHECK(cudaGetLastError());
}

void device_exponential_rows(uintptr_t q, int64_t row_stride, int64_t n_q_rows, int64_t vocab, uintptr_t meta,
                             int64_t n, uintptr_t stream, int device) {
  check_exponential_rows_args(row_stride, n_q_rows, vocab, n);
  if (n == 0) return;
  require(q != 0 && q % 4 == 0 && meta != 0 && meta % 8 == 0, "exponential_rows: null or misaligned pointer");
  require_device(device, "exponential_rows");
  DeviceGuard guard(device);
  int sms = 0;
  COLOMEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const uint64_t total = static_cast<uint64_t>(n) * static_cast<uint64_t>((vocab + 3) / 4);
  const unsigned int blocks = static_cast<unsigned int>(
      std::min<uint64_t>((total + kThreads - 1) / kThreads, static_cast<uint64_t>(std::max(sms, 1)) * 16ull));
  exponential_rows_kernel<<<blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<float*>(q), row_stride, n_q_rows, vocab, reinterpret_cast<const int64_t*>(meta), n);
  COLOMEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace colomem
