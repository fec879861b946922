#include "cuda/ipc_buffer.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "core/copy_engine.h"  // wait_bound
#include "cuda/cuda_check.h"
#include "cuda/device_drain.h"
#include "cuda/driver_api.h"

namespace colomem {

namespace {

int visible_devices() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw NotAvailable(cat("no CUDA device is usable (", cudaGetErrorName(err),
                           "): check nvidia-smi and CUDA_VISIBLE_DEVICES"));
  }
  return n;
}

void require_device(int device) {
  int n = visible_devices();
  require(device >= 0 && device < n, cat("device ", device, " is not visible in this process (", n,
                                         " visible; CUDA_VISIBLE_DEVICES=",
                                         std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES")
                                                                             : "<unset>",
                                         ")"));
}

CUdevice cu_device(int device) {
  CUdevice d = 0;
  COLOMEM_CU_CHECK(driver().cuDeviceGet(&d, device));
  return d;
}

// Makes the device's primary context current on this thread (the cuMem calls need one).
void ensure_context() { COLOMEM_CUDA_CHECK(cudaFree(nullptr)); }

void require_vmm(CUdevice dev, int device) {
  int vmm = 0, fd = 0;
  COLOMEM_CU_CHECK(driver().cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
  COLOMEM_CU_CHECK(
      driver().cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev));
  if (!vmm || !fd)
    throw NotAvailable(cat("cuda:", device, " does not support CUDA VMM buffers with POSIX file-descriptor handles (",
                           "vmm=", vmm, ", posix_fd=", fd, "); the weight bridge cannot export memory here"));
}

CUmemAllocationProp allocation_prop(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

size_t granularity(CUdevice dev, CUmemAllocationGranularity_flags which) {
  CUmemAllocationProp prop = allocation_prop(dev);
  size_t g = 0;
  COLOMEM_CU_CHECK(driver().cuMemGetAllocationGranularity(&g, &prop, which));
  return g;
}

std::string normalise_uuid(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* prefix : {"gpu-", "mig-"})
    if (s.rfind(prefix, 0) == 0) return s.substr(4);
  return s;
}

// Ignore failures when the process is tearing CUDA down: there is nothing left to release.
bool shutting_down(CUresult r) { return r == CUDA_ERROR_DEINITIALIZED; }

}  // namespace

// ---------------------------------------------------------------------------------------------------------

using Clock = DeviceDrain::Clock;

IpcBuffer::~IpcBuffer() {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;
  if (cuda_unloading()) return;  // the process is exiting: the driver reclaims everything
  if (!mapped_) {
    unmap_and_release();
    return;
  }
  lock.unlock();
  // A close() that already timed out left its drain running: the device is known to be stuck, so do not
  // make the owner (often Python's garbage collector, holding the GIL) wait once more.
  const bool stuck = drain_ && !drain_->wait_until(Clock::now());
  bool drained = false;
  if (!stuck) {
    try {
      drained = drain_device(drain_, device_, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                                  std::chrono::duration<double>(kCloseWaitS)));
    } catch (const std::exception& e) {
      warn(cat("waiting for cuda:", device_, " before unmapping an IPC buffer failed: ", e.what()));
    }
  }
  if (!drained) {
    warn(cat("an IPC buffer of ", nbytes_, " bytes on cuda:", device_, " was dropped while work queued on the "
             "device had not finished; its mapping stays in place (the driver reclaims it when the process exits) "
             "so that work does not fault. Close buffers explicitly once the GPU is idle"));
    return;
  }
  lock.lock();
  unmap_and_release();
}

uintptr_t IpcBuffer::ptr() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw PoolClosed("this IPC buffer was closed; its address is no longer mapped");
  return ptr_;
}

bool IpcBuffer::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

void IpcBuffer::close(double timeout_s) {
  const auto bound = wait_bound(timeout_s);  // NaN / negative refused before anything changes
  const std::optional<Clock::time_point> deadline =
      bound ? std::optional<Clock::time_point>(Clock::now() + *bound) : std::nullopt;
  std::unique_lock<std::mutex> lock(mu_);
  auto no_other_closer = [&] { return !closing_; };
  if (!deadline) {
    closing_cv_.wait(lock, no_other_closer);
  } else if (!closing_cv_.wait_until(lock, *deadline, no_other_closer)) {
    throw Timeout(cat("closing an IPC buffer on cuda:", device_, ": another close() of it was still waiting for "
                      "the device after ", timeout_s, " s; the buffer stays mapped. Close again once the GPU's "
                      "queued work finished (nvidia-smi shows whether it is hung)"));
  }
  if (closed_) return;
  if (mapped_ && !cuda_unloading()) {
    closing_ = true;
    lock.unlock();  // ptr(), closed() and export_fd() stay answerable while the device drains
    bool drained = false;
    try {
      drained = drain_device(drain_, device_, deadline);
    } catch (...) {
      lock.lock();
      closing_ = false;
      closing_cv_.notify_all();
      throw;
    }
    lock.lock();
    closing_ = false;
    closing_cv_.notify_all();
    if (!drained)
      throw Timeout(cat("closing an IPC buffer of ", nbytes_, " bytes on cuda:", device_, ": the work queued on the "
                        "device before close() was still running after ", timeout_s, " s, and unmapping under it "
                        "would fault. The buffer stays mapped and usable: close again with a longer timeout once "
                        "the GPU is idle (nvidia-smi shows whether it is hung)"));
  }
  closed_ = true;
  unmap_and_release();
}

void IpcBuffer::map_handle() {
  const DriverApi& d = driver();
  CUdevice dev = cu_device(device_);
  CUdeviceptr addr = 0;
  COLOMEM_CU_CHECK(d.cuMemAddressReserve(&addr, nbytes_, granularity(dev, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                                         0, 0));
  ptr_ = static_cast<uintptr_t>(addr);
  COLOMEM_CU_CHECK(d.cuMemMap(addr, nbytes_, 0, handle_, 0));
  mapped_ = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  COLOMEM_CU_CHECK(d.cuMemSetAccess(addr, nbytes_, &access, 1));
}

void IpcBuffer::unmap_and_release() noexcept {
  if (!mapped_ && ptr_ == 0 && handle_ == 0) return;
  if (cuda_unloading()) return;  // the process is exiting: the driver reclaims everything, stay quiet
  try {
    const DriverApi& d = driver();
    CUresult r;
    if (mapped_ && (r = d.cuMemUnmap(static_cast<CUdeviceptr>(ptr_), nbytes_)) != CUDA_SUCCESS && !shutting_down(r))
      warn(cat("cuMemUnmap of an IPC buffer failed: ", cu_error_name(r)));
    if (ptr_ && (r = d.cuMemAddressFree(static_cast<CUdeviceptr>(ptr_), nbytes_)) != CUDA_SUCCESS &&
        !shutting_down(r))
      warn(cat("cuMemAddressFree of an IPC buffer failed: ", cu_error_name(r)));
    if (handle_ && (r = d.cuMemRelease(handle_)) != CUDA_SUCCESS && !shutting_down(r))
      warn(cat("cuMemRelease of an IPC buffer failed: ", cu_error_name(r)));
  } catch (const std::exception& e) {
    warn(cat("releasing an IPC buffer failed: ", e.what()));
  }
  mapped_ = false;
  ptr_ = 0;
  handle_ = 0;
}

// ---------------------------------------------------------------------------------------------------------

ExportableBuffer::ExportableBuffer(int device, size_t nbytes) {
  require(nbytes > 0, "an IPC buffer needs nbytes > 0");
  require_device(device);
  DeviceGuard guard(device);
  ensure_context();
  device_ = device;
  requested_ = nbytes;
  CUdevice dev = cu_device(device);
  require_vmm(dev, device);
  const size_t g = granularity(dev, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  nbytes_ = (nbytes + g - 1) / g * g;
  uuid_ = device_uuid(device);
  CUmemAllocationProp prop = allocation_prop(dev);
  CUmemGenericAllocationHandle h = 0;
  COLOMEM_CU_CHECK(driver().cuMemCreate(&h, nbytes_, &prop, 0));
  handle_ = h;
  try {
    map_handle();
  } catch (...) {
    unmap_and_release();  // nothing ran on it yet: no device work to wait for
    throw;
  }
}

int ExportableBuffer::export_fd() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw PoolClosed("cannot export a closed IPC buffer");
  DeviceGuard guard(device_);  // may run on another thread (the bridge's accept thread): bind the context
  ensure_context();
  int fd = -1;
  COLOMEM_CU_CHECK(driver().cuMemExportToShareableHandle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  return fd;
}

ImportedBuffer::ImportedBuffer(int fd, size_t nbytes, int device) {
  require(fd >= 0, cat("invalid file descriptor ", fd));
  require(nbytes > 0, "an IPC buffer needs nbytes > 0");
  require_device(device);
  DeviceGuard guard(device);
  ensure_context();
  device_ = device;
  CUdevice dev = cu_device(device);
  require_vmm(dev, device);
  const size_t g = granularity(dev, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  require(nbytes % g == 0, cat("imported nbytes ", nbytes, " is not a multiple of the VMM granularity ", g,
                               "; pass the exporter's nbytes"));
  nbytes_ = nbytes;
  uuid_ = device_uuid(device);
  CUmemGenericAllocationHandle h = 0;
  COLOMEM_CU_CHECK(driver().cuMemImportFromShareableHandle(
      &h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  handle_ = h;
  try {
    map_handle();
  } catch (...) {
    unmap_and_release();
    throw;
  }
}

// ---------------------------------------------------------------------------------------------------------

std::string device_uuid(int device) {
  require_device(device);
  CUuuid u{};
  COLOMEM_CU_CHECK(driver().cuDeviceGetUuid(&u, cu_device(device)));
  const unsigned char* b = reinterpret_cast<const unsigned char*>(u.bytes);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return buf;
}

int device_by_uuid(const std::string& uuid) {
  const std::string want = normalise_uuid(uuid);
  require(!want.empty(), "empty GPU UUID");
  const int n = visible_devices();
  std::string seen;
  for (int i = 0; i < n; ++i) {
    std::string u = device_uuid(i);
    if (normalise_uuid(u) == want) return i;
    seen += cat(i ? ", " : "", i, ": ", u);
  }
  const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES");
  throw NotAvailable(cat("GPU ", uuid, " is not visible in this process (visible: ", n ? seen : "none",
                         "; CUDA_VISIBLE_DEVICES=", cvd ? cvd : "<unset>",
                         "). The bridge only works between processes that see the same GPU: make it visible here."));
}

size_t ipc_granularity(int device) {
  require_device(device);
  return granularity(cu_device(device), CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
}

}  // namespace colomem
