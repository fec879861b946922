// The GPU kind of MappedRange (core/mapped_range.h): a cuMemAddressReserve'd range (or one another allocator
// reserved) whose chunks are cuMemCreate'd allocations, mapped and given read-write access one by one,
// unmapped and released one by one.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <unordered_map>

#include "core/errors.h"
#include "core/mapped_range.h"
#include "cuda/cuda_check.h"
#include "cuda/device_drain.h"
#include "cuda/driver_api.h"
#include "cuda/kernels.h"  // require_device

namespace colomem {

namespace {

CUmemAllocationProp chunk_prop(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

class DeviceRange final : public MappedRange {
 public:
  DeviceRange(int device, size_t nbytes, size_t chunk_bytes) {
    layout(device, nbytes, chunk_bytes, open_device(device, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CUdeviceptr addr = 0;
    COLOMEM_CU_CHECK(driver().cuMemAddressReserve(&addr, reserved_bytes(), granularity(), 0, 0));
    ptr_ = static_cast<uintptr_t>(addr);
  }

  // Laid over addresses another allocator reserved (and mapped with the smallest granularity: vLLM's does).
  DeviceRange(int device, uintptr_t address, size_t nbytes, size_t chunk_bytes) {
    layout(device, nbytes, chunk_bytes, open_device(device, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    adopt(address, nbytes);
  }

  ~DeviceRange() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_ || cuda_unloading()) return;  // at exit the driver reclaims everything
    if (!handles_.empty()) {
      bool drained = false;
      try {
        drained = drain_device(drain_, device(), DeviceDrain::Clock::now() +
                                                     std::chrono::duration_cast<DeviceDrain::Clock::duration>(
                                                         std::chrono::duration<double>(kCloseWaitS)));
      } catch (const std::exception& e) {
        warn(cat("waiting for cuda:", device(), " before unmapping a mapped range failed: ", e.what()));
      }
      if (!drained) {
        warn(cat("a mapped range of ", handles_.size(), " chunks on cuda:", device(), " was dropped while work "
                 "queued on the device had not finished; it stays mapped (the driver reclaims it when the process "
                 "exits) so that work does not fault"));
        return;
      }
    }
    teardown();
  }

 protected:
  void map_chunk(uintptr_t address, size_t size) override {
    const DriverApi& d = driver();
    DeviceGuard guard(device());  // any thread may map: bind the device's context
    CUmemAllocationProp prop = chunk_prop(dev_);
    CUmemGenericAllocationHandle h = 0;
    COLOMEM_CU_CHECK(d.cuMemCreate(&h, size, &prop, 0));
    const CUdeviceptr at = static_cast<CUdeviceptr>(address);
    CUresult r = d.cuMemMap(at, size, 0, h, 0);
    if (r == CUDA_SUCCESS) {
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = dev_;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      r = d.cuMemSetAccess(at, size, &access, 1);
      if (r != CUDA_SUCCESS) (void)d.cuMemUnmap(at, size);
    }
    if (r != CUDA_SUCCESS) {
      (void)d.cuMemRelease(h);
      throw_cu_error(r, "cuMemMap/cuMemSetAccess of a mapped range's chunk", __FILE__, __LINE__, __func__);
    }
    handles_[address] = h;
  }

  void unmap_chunk(uintptr_t address, size_t size) noexcept override {
    auto it = handles_.find(address);
    if (it == handles_.end()) return;
    try {
      const DriverApi& d = driver();
      DeviceGuard guard(device());
      CUresult r = d.cuMemUnmap(static_cast<CUdeviceptr>(address), size);
      if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED)
        warn(cat("cuMemUnmap of a mapped range's chunk failed: ", cu_error_name(r)));
      r = d.cuMemRelease(it->second);
      if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED)
        warn(cat("cuMemRelease of a mapped range's chunk failed: ", cu_error_name(r)));
    } catch (const std::exception& e) {
      warn(cat("unmapping a mapped range's chunk failed: ", e.what()));
    }
    handles_.erase(it);
  }

  void release_range() noexcept override {
    try {
      CUresult r = driver().cuMemAddressFree(static_cast<CUdeviceptr>(ptr_), reserved_bytes());
      if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED)
        warn(cat("cuMemAddressFree of a mapped range failed: ", cu_error_name(r)));
    } catch (const std::exception& e) {
      warn(cat("freeing a mapped range's addresses failed: ", e.what()));
    }
  }

  bool drain(std::optional<std::chrono::steady_clock::duration> bound) override {
    if (cuda_unloading()) return true;
    std::optional<DeviceDrain::Clock::time_point> deadline;
    if (bound) deadline = DeviceDrain::Clock::now() + *bound;
    return drain_device(drain_, device(), deadline);
  }

 private:
  // Checks the device (visible, VMM supported), makes its primary context current, sets dev_; returns the
  // chunks' mapping granularity of that kind.
  size_t open_device(int device, CUmemAllocationGranularity_flags kind) {
    require_device(device, "a mapped range");   // NotAvailable without a usable GPU, InvalidArgument if unseen
    DeviceGuard guard(device);
    COLOMEM_CUDA_CHECK(cudaFree(nullptr));  // the primary context, current on this thread
    const DriverApi& d = driver();
    COLOMEM_CU_CHECK(d.cuDeviceGet(&dev_, device));
    int vmm = 0;
    COLOMEM_CU_CHECK(d.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev_));
    if (!vmm)
      throw NotAvailable(cat("cuda:", device, " does not support CUDA virtual memory management; colomem cannot "
                             "map memory there chunk by chunk (leave the optimizer state in torch's memory)"));
    CUmemAllocationProp prop = chunk_prop(dev_);
    size_t g = 0;
    COLOMEM_CU_CHECK(d.cuMemGetAllocationGranularity(&g, &prop, kind));
    return g;
  }

  CUdevice dev_ = 0;
  std::unordered_map<uintptr_t, CUmemGenericAllocationHandle> handles_;  // mapped chunks by address
  std::shared_ptr<DeviceDrain> drain_;  // a close() that timed out leaves its wait here
};

}  // namespace

std::shared_ptr<MappedRange> make_device_range(int device, size_t nbytes, size_t chunk_bytes) {
  return std::make_shared<DeviceRange>(device, nbytes, chunk_bytes);
}

std::shared_ptr<MappedRange> attach_device_range(int device, uintptr_t address, size_t nbytes, size_t chunk_bytes) {
  return std::make_shared<DeviceRange>(device, address, nbytes, chunk_bytes);
}

}  // namespace colomem
