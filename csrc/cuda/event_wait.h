// Bounded host waits on CUDA work: an event polled against a deadline (cudaEventSynchronize and
// cudaStreamSynchronize have no timeout, and a hung stream would block the caller for ever).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <optional>

namespace colomem {

using WaitClock = std::chrono::steady_clock;

// The deadline of a wait with this bound (from wait_bound); nullopt: none.
inline std::optional<WaitClock::time_point> deadline_after(std::optional<WaitClock::duration> bound) {
  if (!bound) return std::nullopt;
  return WaitClock::now() + *bound;
}

// Polls `event` (on the current device) until it completed, true, or the deadline passed, false; no deadline:
// until it completed. Spins briefly (a copy of a few MiB ends in tens of microseconds), then backs off to
// 200 us sleeps. CudaError if the device reported an error.
bool wait_event_until(cudaEvent_t event, std::optional<WaitClock::time_point> deadline);

}  // namespace colomem
