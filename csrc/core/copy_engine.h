// Chunked, asynchronous copies between device memory and host (pool) memory.
//
// One engine owns one stream per direction, so an offload (D2H) and a reload (H2D) run at once. A
// submission first makes its stream wait for the work already queued on `wait_stream` (the producer),
// splits every copy into chunks, records an event per chunk, and can make `signal_stream` (the consumer)
// wait for its completion without blocking the host. device < 0 selects the host backend: plain memcpy on
// one worker thread per direction, with the same handles, so the host-only build exercises the same API.
#pragma once

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/errors.h"

namespace colomem {

enum class Direction { D2H, H2D };

inline const char* direction_name(Direction d) { return d == Direction::D2H ? "d2h" : "h2d"; }

// Waits longer than this are treated as unbounded: a duration of more seconds, converted to the clock's
// integer ticks and added to now(), would overflow.
constexpr double kUnboundedWaitS = 1e9;

// A wait's bound as a steady_clock duration; nullopt means no bound (inf, or beyond kUnboundedWaitS).
// NaN and negative timeouts name no bound a caller could mean, so they are refused.
inline std::optional<std::chrono::steady_clock::duration> wait_bound(double timeout_s) {
  if (std::isnan(timeout_s)) throw InvalidArgument("timeout is NaN; pass seconds >= 0, or None (inf) for no bound");
  if (timeout_s < 0)
    throw InvalidArgument(cat("timeout is negative (", timeout_s, " s); pass seconds >= 0, or None (inf) for no "
                              "bound"));
  if (timeout_s >= kUnboundedWaitS) return std::nullopt;
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
}

struct CopyOp {
  uintptr_t dst;
  uintptr_t src;
  size_t nbytes;
};

class Transfer {
 public:
  virtual ~Transfer() = default;
  // True once every copy of the submission completed. Throws CudaError if the device reported an error.
  virtual bool done() = 0;
  // Blocks (GIL released by the binding) until done or timeout_s passed; Timeout then, and the transfer
  // keeps running: wait again. inf (or any timeout of kUnboundedWaitS or more) waits without bound; NaN
  // and negative timeouts are InvalidArgument (see wait_bound).
  virtual void wait(double timeout_s) = 0;
  // Number of leading copies (in submission order) that completed.
  virtual size_t completed_copies() = 0;
  // Copy time measured on the device (CUDA events) or the host backend's clock; needs timing and done().
  virtual double elapsed_ms() = 0;

  // Device time from the earliest start to the latest end of several transfers submitted with timing
  // (both directions of a swap). All must come from the same backend.
  virtual double span_ms(const std::vector<std::shared_ptr<Transfer>>& others) = 0;

  Direction direction = Direction::D2H;
  size_t nbytes = 0;
  size_t ncopies = 0;
  size_t nchunks = 0;
};

// What submit() throws when it failed after some of its copies were already queued and those were still
// running when its bounded wait for them ended (CUDA backend; the host backend checks everything before it
// queues anything). `cause` is the failure; `running` a transfer that is done once the copies queued before
// it are, until when their memory must stay allocated. The binding raises the cause's Python class with
// `running` as the exception's `.transfer`.
class PartialSubmission : public Error {
 public:
  PartialSubmission(std::exception_ptr cause, std::shared_ptr<Transfer> running, const std::string& what)
      : Error(what), cause_(std::move(cause)), running_(std::move(running)) {}
  const std::exception_ptr& cause() const { return cause_; }
  const std::shared_ptr<Transfer>& running() const { return running_; }

 private:
  std::exception_ptr cause_;
  std::shared_ptr<Transfer> running_;
};

// How long a CUDA submit() that failed part-way waits for the copies it had queued before it reports the
// failure (they run into memory the caller would free on the error): past this, PartialSubmission.
constexpr double kFailedSubmitWaitS = 30.0;

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual std::shared_ptr<Transfer> submit(Direction dir, const std::vector<CopyOp>& ops, uintptr_t wait_stream,
                                           uintptr_t signal_stream, bool timing) = 0;
  virtual int device() const = 0;
  virtual size_t chunk_bytes() const = 0;
  // The engine's stream for a direction as an integer handle (0 on the host backend).
  virtual uintptr_t stream(Direction dir) const = 0;
};

// The host backend's worker threads exist only in the process that created the engine: after fork() a
// child holds the engine object but no threads, so its submit(), done() and wait() raise NotAvailable
// instead of queueing copies nothing would ever run.
// device >= 0: CUDA engine (NotAvailable in the host-only build); device < 0: host backend.
// failure_wait_s: see kFailedSubmitWaitS (inf: no bound; NaN or negative refused); the host backend has no use
// for it but checks it the same way.
std::shared_ptr<CopyEngine> make_copy_engine(int device, size_t chunk_bytes, size_t small_copy_bytes,
                                             double failure_wait_s);
std::shared_ptr<CopyEngine> make_host_copy_engine(size_t chunk_bytes);
std::shared_ptr<CopyEngine> make_cuda_copy_engine(int device, size_t chunk_bytes, size_t small_copy_bytes,
                                                  double failure_wait_s);

}  // namespace colomem

namespace colomem {

// Copies `count` ranges given as int64 triples (dst, src, nbytes) at host address `ops`, with dst_base and
// src_base added to every dst and src, on `stream`: the weight bridge's pack and unpack, where one call
// replaces a Python copy per tensor. The copies of one call may run concurrently, so no destination may
// overlap another range. device >= 0: memory on that GPU (or pinned), enqueued (asynchronous) with as few
// driver calls as the runtime allows; work later on `stream` sees them. device < 0: host memcpy now.
void copy_ranges(uintptr_t ops, size_t count, uintptr_t dst_base, uintptr_t src_base, uintptr_t stream,
                 int device);
void cuda_copy_ranges(const std::vector<CopyOp>& ops, uintptr_t stream, int device);

}  // namespace colomem
