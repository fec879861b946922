// A bounded wait for every piece of work queued on a device, before memory that work may use is unmapped
// (an IPC buffer's close, a mapped range's close).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>

namespace colomem {

// cudaDeviceSynchronize has no timeout, so it runs on a helper thread the caller can stop waiting for; the
// thread holds only this state and ends when the device drains, however long after the caller gave up.
struct DeviceDrain {
  using Clock = std::chrono::steady_clock;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  cudaError_t status = cudaSuccess;

  static std::shared_ptr<DeviceDrain> start(int device);
  // True once the device drained; false when the deadline (none: no bound) passed first.
  bool wait_until(std::optional<Clock::time_point> deadline);
};

// Whether the process is tearing CUDA down: the driver reclaims every mapping, nothing is left to wait for.
bool cuda_unloading();

// Waits until the work queued on `device` before this call completed: true, or false at the deadline. A
// drain left running by an earlier wait that gave up (`pending`) is waited for first, so an owner whose
// close() is retried under a hung device keeps one blocked thread, not one per try; then a fresh drain
// covers the work queued since.
bool drain_device(std::shared_ptr<DeviceDrain>& pending, int device,
                  std::optional<DeviceDrain::Clock::time_point> deadline);

}  // namespace colomem
