// The host backend of the copy engine: memcpy on one worker thread per direction.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include <unistd.h>

#include "core/copy_engine.h"
#include "core/errors.h"

namespace colomem {

namespace {

using Clock = std::chrono::steady_clock;

// Raised in a fork() child that uses an engine (or a transfer) of its parent: the worker threads that would
// run the copies were not copied into the child, so waiting would never end.
void check_not_forked(pid_t owner, const char* what) {
  pid_t self = getpid();
  if (self == owner) return;
  throw NotAvailable(cat("host copy engine: ", what, " in process ", static_cast<long long>(self),
                         ", a fork() child of process ", static_cast<long long>(owner),
                         " where the engine was created; its copy threads do not survive fork(), so no copy "
                         "would run. Fork before the first offload or reload, or start child processes with "
                         "the 'spawn' (or 'forkserver') method"));
}

class HostTransfer : public Transfer {
 public:
  std::vector<CopyOp> ops;
  size_t chunk = 0;
  std::atomic<size_t> completed{0};
  // Held by pointer so a fork() child can leak them: a mutex copied while locked, or a condition variable
  // with waiters in the parent, would block for ever on destruction in the child.
  struct Sync {
    std::mutex mu;
    std::condition_variable cv;
  };
  std::unique_ptr<Sync> sync = std::make_unique<Sync>();
  std::mutex& mu = sync->mu;
  std::condition_variable& cv = sync->cv;
  bool finished = false;
  bool timing = false;
  double ms = 0;
  Clock::time_point started, ended;
  pid_t owner = getpid();

  ~HostTransfer() override {
    if (getpid() != owner) (void)sync.release();
  }

  bool done() override {
    check_not_forked(owner, "done() on a transfer started");
    std::lock_guard<std::mutex> lk(mu);
    return finished;
  }
  void wait(double timeout_s) override {
    auto bound = wait_bound(timeout_s);  // before the lock: a bad timeout is refused at once
    check_not_forked(owner, "wait() on a transfer started");
    std::unique_lock<std::mutex> lk(mu);
    if (!bound) {
      cv.wait(lk, [&] { return finished; });
      return;
    }
    if (!cv.wait_for(lk, *bound, [&] { return finished; }))
      throw Timeout(cat("host ", direction_name(direction), " transfer of ", nbytes, " bytes not done after ",
                        timeout_s, " s (", completed.load(), "/", ncopies,
                        " copies done); it keeps running, wait again"));
  }
  size_t completed_copies() override { return completed.load(); }
  double elapsed_ms() override {
    require(timing, "elapsed_ms() needs a transfer submitted with timing=True");
    if (!done()) throw InvalidArgument("elapsed_ms() before the transfer is done; wait() first");
    return ms;
  }

  double span_ms(const std::vector<std::shared_ptr<Transfer>>& others) override {
    Clock::time_point lo = started, hi = ended;
    require(done(), "span_ms() before the transfer is done; wait() first");
    for (const auto& o : others) {
      auto* h = dynamic_cast<HostTransfer*>(o.get());
      require(h != nullptr && h->done(), "span_ms() needs finished transfers of the same backend");
      lo = std::min(lo, h->started);
      hi = std::max(hi, h->ended);
    }
    return std::chrono::duration<double, std::milli>(hi - lo).count();
  }

  void run() {
    auto t0 = Clock::now();
    started = t0;
    for (const auto& op : ops) {
      for (size_t off = 0; off < op.nbytes; off += chunk) {
        size_t n = std::min(chunk, op.nbytes - off);
        std::memcpy(reinterpret_cast<void*>(op.dst + off), reinterpret_cast<const void*>(op.src + off), n);
      }
      completed.fetch_add(1);
    }
    std::lock_guard<std::mutex> lk(mu);
    ended = Clock::now();
    ms = std::chrono::duration<double, std::milli>(ended - t0).count();
    finished = true;
    cv.notify_all();
  }
};

// One FIFO worker thread.
class Worker {
 public:
  Worker() : th_([this] { loop(); }) {}
  ~Worker() {  // never run in a fork() child: see ~HostCopyEngine
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    th_.join();  // drains the queue first: submitted copies always complete
  }
  void push(std::shared_ptr<HostTransfer> t) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      q_.push_back(std::move(t));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<HostTransfer> t;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        t = std::move(q_.front());
        q_.pop_front();
      }
      t->run();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<HostTransfer>> q_;
  bool stop_ = false;
  std::thread th_;  // last: started once the members above exist
};

class HostCopyEngine : public CopyEngine {
 public:
  explicit HostCopyEngine(size_t chunk) : chunk_(chunk) {}
  ~HostCopyEngine() override {
    if (getpid() != owner_) {
      // A fork() child: the worker threads are not in this process (joining would wait for ever), and their
      // mutex and condition variable were copied mid-use (destroying them can block too). Leak the workers.
      (void)d2h_.release();
      (void)h2d_.release();
    }
  }

  std::shared_ptr<Transfer> submit(Direction dir, const std::vector<CopyOp>& ops, uintptr_t wait_stream,
                                   uintptr_t signal_stream, bool timing) override {
    check_not_forked(owner_, "submit()");
    require(wait_stream == 0 && signal_stream == 0,
            "the host copy engine has no streams: pass wait_stream=0 and signal_stream=0");
    auto t = std::make_shared<HostTransfer>();
    t->direction = dir;
    t->chunk = chunk_;
    t->timing = timing;
    t->ops = ops;
    for (const auto& op : ops) {
      require(op.nbytes == 0 || (op.dst != 0 && op.src != 0), "copy with a null pointer");
      t->nbytes += op.nbytes;
      t->nchunks += (op.nbytes + chunk_ - 1) / chunk_;
    }
    t->ncopies = ops.size();
    (dir == Direction::D2H ? d2h_ : h2d_)->push(t);
    return t;
  }
  int device() const override { return -1; }
  size_t chunk_bytes() const override { return chunk_; }
  uintptr_t stream(Direction) const override { return 0; }

 private:
  size_t chunk_;
  pid_t owner_ = getpid();
  // declared last: destroyed (drained, joined) first
  std::unique_ptr<Worker> d2h_ = std::make_unique<Worker>(), h2d_ = std::make_unique<Worker>();
};

}  // namespace

std::shared_ptr<CopyEngine> make_host_copy_engine(size_t chunk_bytes) {
  require(chunk_bytes > 0, "chunk_bytes must be positive");
  return std::make_shared<HostCopyEngine>(chunk_bytes);
}

std::shared_ptr<CopyEngine> make_copy_engine(int device, size_t chunk_bytes, size_t small_copy_bytes,
                                             double failure_wait_s) {
  (void)wait_bound(failure_wait_s);  // refused on both backends alike
  if (device < 0) return make_host_copy_engine(chunk_bytes);
  return make_cuda_copy_engine(device, chunk_bytes, small_copy_bytes, failure_wait_s);
}

}  // namespace colomem
