#include "cuda/event_wait.h"

#include <thread>

#include "cuda/cuda_check.h"

namespace colomem {

bool wait_event_until(cudaEvent_t event, std::optional<WaitClock::time_point> deadline) {
  for (int spins = 0;; ++spins) {
    cudaError_t st = cudaEventQuery(event);
    if (st == cudaSuccess) return true;
    if (st != cudaErrorNotReady) COLOMEM_CUDA_CHECK(st);
    (void)cudaGetLastError();  // cudaErrorNotReady is not an error of the next call
    if (deadline && WaitClock::now() >= *deadline) return false;
    if (spins < 2000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(spins < 4000 ? 20 : 200));
  }
}

}  // namespace colomem
