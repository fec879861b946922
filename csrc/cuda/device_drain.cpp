#include "cuda/device_drain.h"

#include <thread>

#include "core/errors.h"

namespace colomem {

std::shared_ptr<DeviceDrain> DeviceDrain::start(int device) {
  auto d = std::make_shared<DeviceDrain>();
  std::thread([d, device] {
    cudaError_t st = cudaSetDevice(device);
    if (st == cudaSuccess) st = cudaDeviceSynchronize();
    (void)cudaGetLastError();
    std::lock_guard<std::mutex> lk(d->mu);
    d->done = true;
    d->status = st;
    d->cv.notify_all();
  }).detach();
  return d;
}

bool DeviceDrain::wait_until(std::optional<Clock::time_point> deadline) {
  std::unique_lock<std::mutex> lk(mu);
  if (!deadline) {
    cv.wait(lk, [&] { return done; });
    return true;
  }
  return cv.wait_until(lk, *deadline, [&] { return done; });
}

bool cuda_unloading() {
  int current = 0;
  cudaError_t state = cudaGetDevice(&current);
  if (state == cudaErrorCudartUnloading || state == cudaErrorInitializationError) {
    (void)cudaGetLastError();
    return true;
  }
  return false;
}

bool drain_device(std::shared_ptr<DeviceDrain>& pending, int device,
                  std::optional<DeviceDrain::Clock::time_point> deadline) {
  if (pending && !pending->wait_until(deadline)) return false;
  pending = DeviceDrain::start(device);
  if (!pending->wait_until(deadline)) return false;
  if (pending->status != cudaSuccess && pending->status != cudaErrorCudartUnloading)
    warn(cat("cudaDeviceSynchronize before unmapping device memory failed: ", cudaGetErrorString(pending->status)));
  pending.reset();
  return true;
}

}  // namespace colomem
