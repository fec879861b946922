// The CUDA backend of the copy engine: one non-blocking stream per direction, chunked cudaMemcpyAsync,
// an event per chunk, small copies coalesced into batched copies (cuda/batch_copy.h).
#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>

#include "core/copy_engine.h"
#include "cuda/batch_copy.h"
#include "cuda/cuda_check.h"
#include "cuda/event_wait.h"

namespace colomem {

namespace {

using Clock = std::chrono::steady_clock;

struct Streams {
  int device;
  cudaStream_t d2h = nullptr, h2d = nullptr;
  std::mutex mu;  // one submission at a time per engine: chunks of two submissions never interleave
  bool batch_supported = true;

  explicit Streams(int dev) : device(dev) {
    DeviceGuard g(dev);
    COLOMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking));
    COLOMEM_CUDA_CHECK(cudaStreamCreateWithFlags(&h2d, cudaStreamNonBlocking));
  }
  ~Streams() {
    // Pending work still completes: cudaStreamDestroy defers the release until the stream drains.
    if (d2h) (void)cudaStreamDestroy(d2h);
    if (h2d) (void)cudaStreamDestroy(h2d);
  }
};

struct ChunkMark {
  cudaEvent_t event;
  size_t copies_done;  // copies fully complete once this event fires
};

class CudaTransfer : public Transfer {
 public:
  std::shared_ptr<Streams> streams;  // keeps the streams alive while events are pending
  std::vector<ChunkMark> marks;
  cudaEvent_t start = nullptr, end = nullptr;
  size_t next_mark = 0;  // marks before this index have completed
  bool finished = false;
  bool partial = false;  // what a failed submission had queued (PartialSubmission): it has no timing events

  ~CudaTransfer() override {
    for (auto& m : marks) (void)cudaEventDestroy(m.event);
    if (start) (void)cudaEventDestroy(start);
    if (end) (void)cudaEventDestroy(end);
  }

  // Advances next_mark over completed events; returns true when all completed.
  bool poll() {
    if (finished) return true;
    DeviceGuard g(streams->device);
    while (next_mark < marks.size()) {
      cudaError_t st = cudaEventQuery(marks[next_mark].event);
      if (st == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return false;
      }
      COLOMEM_CUDA_CHECK(st);
      ++next_mark;
    }
    finished = true;
    return true;
  }

  bool done() override { return poll(); }

  void wait(double timeout_s) override {
    auto bound = wait_bound(timeout_s);  // nullopt: no bound (inf or huge); NaN / negative refused
    auto t0 = Clock::now();
    auto deadline = bound ? t0 + *bound : Clock::time_point::max();
    int spins = 0;
    while (!poll()) {
      auto now = Clock::now();
      if (bound && now >= deadline)
        throw Timeout(cat(direction_name(direction), " transfer of ", nbytes, " bytes not done after ", timeout_s,
                          " s (", completed_copies(), "/", ncopies, " copies done). It keeps running: wait "
                          "again, or check that the GPU is not hung (nvidia-smi)"));
      // Spin briefly (copies of a few MiB finish in tens of microseconds), then back off.
      if (++spins < 2000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(spins < 4000 ? 20 : 200));
    }
  }

  double span_ms(const std::vector<std::shared_ptr<Transfer>>& others) override {
    std::vector<CudaTransfer*> all{this};
    for (const auto& o : others) {
      auto* c = dynamic_cast<CudaTransfer*>(o.get());
      require(c != nullptr && c->start != nullptr, "span_ms() needs timed transfers of the CUDA backend");
      all.push_back(c);
    }
    for (auto* c : all) {
      require(c->start != nullptr && !c->partial, "span_ms() needs transfers submitted with timing=True");
      if (!c->poll()) throw InvalidArgument("span_ms() before every transfer is done; wait() first");
    }
    DeviceGuard g(streams->device);
    // The origin is the start event no other start precedes; then the latest end measured from it.
    for (auto* origin : all) {
      bool earliest = true;
      for (auto* c : all) {
        float ms = 0;
        if (c != origin && (cudaEventElapsedTime(&ms, origin->start, c->start) != cudaSuccess || ms < 0)) {
          (void)cudaGetLastError();
          earliest = false;
          break;
        }
      }
      if (!earliest) continue;
      double hi = 0;
      for (auto* c : all) {
        float ms = 0;
        COLOMEM_CUDA_CHECK(cudaEventElapsedTime(&ms, origin->start, c->end));
        hi = std::max(hi, static_cast<double>(ms));
      }
      return hi;
    }
    throw InvalidArgument("span_ms(): could not order the transfers' start events");
  }

  size_t completed_copies() override {
    poll();
    return next_mark == 0 ? 0 : marks[next_mark - 1].copies_done;
  }

  double elapsed_ms() override {
    require(!partial, "elapsed_ms(): this transfer is what a failed submission had queued; it was not timed");
    require(start != nullptr, "elapsed_ms() needs a transfer submitted with timing=True");
    if (!poll()) throw InvalidArgument("elapsed_ms() before the transfer is done; wait() first");
    float ms = 0;
    DeviceGuard g(streams->device);
    COLOMEM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
    return ms;
  }
};

void check_pointer(const void* p, bool want_device, int device, size_t index, const char* role) {
  cudaPointerAttributes a{};
  COLOMEM_CUDA_CHECK(cudaPointerGetAttributes(&a, p));
  if (want_device) {
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
      throw InvalidArgument(cat("copy ", index, ": the ", role, " pointer is not device memory; offload and "
                                "reload move CUDA tensors (host tensors need device='cpu')"));
    if (a.device != device)
      throw InvalidArgument(cat("copy ", index, ": the ", role, " pointer lives on cuda:", a.device,
                                " but this copy engine serves cuda:", device, "; use one engine per device"));
  } else if (a.type == cudaMemoryTypeDevice) {
    throw InvalidArgument(cat("copy ", index, ": the ", role, " pointer is device memory, expected host memory"));
  }
}

class CudaCopyEngine : public CopyEngine {
 public:
  CudaCopyEngine(int device, size_t chunk, size_t small, double failure_wait_s)
      : s_(std::make_shared<Streams>(device)),
        chunk_(chunk),
        small_(small),
        failure_wait_s_(failure_wait_s),
        failure_bound_(wait_bound(failure_wait_s)) {}

  std::shared_ptr<Transfer> submit(Direction dir, const std::vector<CopyOp>& ops, uintptr_t wait_stream,
                                   uintptr_t signal_stream, bool timing) override {
    std::lock_guard<std::mutex> lk(s_->mu);
    DeviceGuard g(s_->device);
    cudaStream_t st = dir == Direction::D2H ? s_->d2h : s_->h2d;
    bool src_dev = dir == Direction::D2H;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].nbytes == 0) continue;
      require(ops[i].dst != 0 && ops[i].src != 0, cat("copy ", i, " has a null pointer"));
      check_pointer(reinterpret_cast<void*>(ops[i].src), src_dev, s_->device, i, "source");
      check_pointer(reinterpret_cast<void*>(ops[i].dst), !src_dev, s_->device, i, "destination");
    }
    auto t = std::make_shared<CudaTransfer>();
    t->streams = s_;
    t->direction = dir;
    t->ncopies = ops.size();
    cudaMemcpyKind kind = src_dev ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;

    // From the first queued copy on, a failure leaves copies running into the caller's memory.
    bool copying = false;
    size_t queued = 0;  // leading copies whose every chunk is queued
    try {
      if (wait_stream) {
        cudaEvent_t ready;
        COLOMEM_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
        cudaError_t e1 = cudaEventRecord(ready, reinterpret_cast<cudaStream_t>(wait_stream));
        cudaError_t e2 = e1 == cudaSuccess ? cudaStreamWaitEvent(st, ready, 0) : e1;
        (void)cudaEventDestroy(ready);  // safe: destruction is deferred until the event completes
        COLOMEM_CUDA_CHECK(e2);
      }
      if (timing) {
        COLOMEM_CUDA_CHECK(cudaEventCreate(&t->start));
        COLOMEM_CUDA_CHECK(cudaEventRecord(t->start, st));
      }
      auto mark = [&](size_t copies_done) {
        cudaEvent_t ev;
        COLOMEM_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        t->marks.push_back({ev, copies_done});
        COLOMEM_CUDA_CHECK(cudaEventRecord(ev, st));
        ++t->nchunks;
      };

      size_t since_mark = 0;
      std::vector<void*> bd, bs;
      std::vector<size_t> bn;
      auto flush_batch = [&](size_t copies_done) {
        if (bd.empty()) return;
        copying = true;
        enqueue_batch(bd, bs, bn, kind, st);
        queued = std::max(queued, copies_done);
        bd.clear(), bs.clear(), bn.clear();
        if (since_mark >= chunk_) {
          mark(copies_done);
          since_mark = 0;
        }
      };
      for (size_t i = 0; i < ops.size(); ++i) {
        const CopyOp& op = ops[i];
        t->nbytes += op.nbytes;
        if (op.nbytes == 0) continue;
        if (op.nbytes <= small_) {  // coalesce: one driver call for a run of small copies
          bd.push_back(reinterpret_cast<void*>(op.dst));
          bs.push_back(reinterpret_cast<void*>(op.src));
          bn.push_back(op.nbytes);
          since_mark += op.nbytes;
          if (since_mark >= chunk_ || bd.size() >= 1024) flush_batch(i + 1);
          continue;
        }
        flush_batch(i);
        for (size_t off = 0; off < op.nbytes; off += chunk_) {
          size_t n = std::min(chunk_, op.nbytes - off);
          copying = true;
          COLOMEM_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(op.dst + off),
                                             reinterpret_cast<const void*>(op.src + off), n, kind, st));
          bool last = off + n == op.nbytes;
          mark(last ? i + 1 : i);  // one event per chunk
          since_mark = 0;
        }
        queued = i + 1;
      }
      flush_batch(ops.size());
      mark(ops.size());  // the final mark: done() and completed_copies() == ncopies
      if (timing) {
        COLOMEM_CUDA_CHECK(cudaEventCreate(&t->end));
        COLOMEM_CUDA_CHECK(cudaEventRecord(t->end, st));
      }
      if (signal_stream)
        COLOMEM_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(signal_stream), t->marks.back().event, 0));
    } catch (...) {
      if (!copying) throw;
      fail_after_queueing(t, st, queued, std::current_exception());
    }
    return t;
  }

  int device() const override { return s_->device; }
  size_t chunk_bytes() const override { return chunk_; }
  uintptr_t stream(Direction d) const override {
    return reinterpret_cast<uintptr_t>(d == Direction::D2H ? s_->d2h : s_->h2d);
  }

 private:
  void enqueue_batch(std::vector<void*>& d, std::vector<void*>& s, std::vector<size_t>& n, cudaMemcpyKind kind,
                     cudaStream_t st) {
    bool ok = s_->batch_supported;
    enqueue_copies(d.data(), const_cast<const void* const*>(s.data()), n.data(), d.size(), kind, st, ok);
    s_->batch_supported = ok;  // older driver: plain copies from now on
  }

  // The copies queued before a failure still run and read or write the caller's memory, which the caller
  // frees or reuses once it sees the error: wait for them (up to failure_wait_s) before reporting it, and past
  // that bound hand the caller a transfer that is done when they are (PartialSubmission). Runs under the
  // submission lock, so nothing else is queued on `st` meanwhile.
  [[noreturn]] void fail_after_queueing(const std::shared_ptr<CudaTransfer>& t, cudaStream_t st, size_t queued,
                                        std::exception_ptr cause) {
    (void)cudaGetLastError();
    const auto deadline = deadline_after(failure_bound_);
    cudaEvent_t drained = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&drained, cudaEventDisableTiming);
    if (e == cudaSuccess && (e = cudaEventRecord(drained, st)) != cudaSuccess) (void)cudaEventDestroy(drained);
    if (e != cudaSuccess) {
      // Not even an event: the context is unusable (nothing of it runs any more) or out of resources. Poll the
      // stream itself; anything but "not ready" means nothing runs on it.
      (void)cudaGetLastError();
      for (;;) {
        cudaError_t q = cudaStreamQuery(st);
        (void)cudaGetLastError();
        if (q != cudaErrorNotReady) std::rethrow_exception(cause);
        if (deadline && WaitClock::now() >= *deadline) break;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      warn(cat("a failed ", direction_name(t->direction), " submission could not mark its queued copies (",
               cudaGetErrorString(e), ") and they were still running after ", failure_wait_s_,
               " s; keep their memory allocated until the engine's stream is idle"));
      std::rethrow_exception(cause);
    }
    t->marks.push_back({drained, queued});
    t->partial = true;
    t->ncopies = queued;
    bool done = true;
    try {
      done = wait_event_until(drained, deadline);
    } catch (const CudaError&) {
      // the device reported an error: the context's queued work was abandoned, none of it runs any more
    }
    if (done) std::rethrow_exception(cause);
    std::string why = "unknown error";
    try {
      std::rethrow_exception(cause);
    } catch (const std::exception& ex) {
      why = ex.what();
    } catch (...) {
    }
    throw PartialSubmission(cause, t, cat(why, " (the copies queued before this failure were still running after ",
                                          failure_wait_s_, " s: keep their memory until .transfer is done)"));
  }

  std::shared_ptr<Streams> s_;
  size_t chunk_, small_;
  double failure_wait_s_;
  std::optional<WaitClock::duration> failure_bound_;
};

}  // namespace

std::shared_ptr<CopyEngine> make_cuda_copy_engine(int device, size_t chunk_bytes, size_t small_copy_bytes,
                                                  double failure_wait_s) {
  require(chunk_bytes > 0, "chunk_bytes must be positive");
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    throw NotAvailable(cat("cannot create a copy engine for cuda:", device, ": no CUDA device is visible (",
                           e == cudaSuccess ? "0 devices" : cudaGetErrorString(e),
                           "). Check the driver and CUDA_VISIBLE_DEVICES, or use the host path (device='cpu')"));
  }
  require(device < n, cat("cuda:", device, " is not visible in this process (", n, " devices)"));
  return std::make_shared<CudaCopyEngine>(device, chunk_bytes, small_copy_bytes, failure_wait_s);
}

}  // namespace colomem
