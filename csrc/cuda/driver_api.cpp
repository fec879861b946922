#include "cuda/driver_api.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>

#include "cuda/cuda_check.h"

namespace colomem {

namespace {

// Entry points as of the CUDA 12.0 ABI: every symbol we use exists there with the typedefs above.
constexpr unsigned int kAbiVersion = 12000;

std::atomic<const DriverApi*> g_loaded{nullptr};

template <typename Fn>
void load(Fn& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &p, kAbiVersion, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr) {
    const char* why = err != cudaSuccess ? cudaGetErrorString(err)
                      : status == cudaDriverEntryPointVersionNotSufficent ? "driver too old"
                                                                          : "symbol not found";
    (void)cudaGetLastError();
    throw NotAvailable(cat("CUDA driver entry point ", symbol, " is not available (", why,
                           "). colomem's IPC bridge needs an NVIDIA driver for CUDA 12 or newer; check "
                           "nvidia-smi and that libcuda.so.1 is on the loader path."));
  }
  fn = reinterpret_cast<Fn>(p);
}

DriverApi load_all() {
  DriverApi d{};
  load(d.cuGetErrorString, "cuGetErrorString");
  load(d.cuGetErrorName, "cuGetErrorName");
  load(d.cuInit, "cuInit");
  load(d.cuDeviceGet, "cuDeviceGet");
  load(d.cuDeviceGetAttribute, "cuDeviceGetAttribute");
  load(d.cuDeviceGetUuid, "cuDeviceGetUuid");
  load(d.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  load(d.cuMemCreate, "cuMemCreate");
  load(d.cuMemRelease, "cuMemRelease");
  load(d.cuMemAddressReserve, "cuMemAddressReserve");
  load(d.cuMemAddressFree, "cuMemAddressFree");
  load(d.cuMemMap, "cuMemMap");
  load(d.cuMemUnmap, "cuMemUnmap");
  load(d.cuMemSetAccess, "cuMemSetAccess");
  load(d.cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
  load(d.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  load(d.cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle");
  load(d.cuPointerGetAttribute, "cuPointerGetAttribute");
  return d;
}

const char* hint_for(CUresult err) {
  switch (err) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return " Free GPU memory first (offload the trainer, lower bucket_bytes or gpu_memory_utilization) and retry.";
    case CUDA_ERROR_NOT_SUPPORTED:
      return " This GPU/driver does not support CUDA VMM with POSIX file-descriptor handles.";
    case CUDA_ERROR_INVALID_DEVICE:
      return " The device is not visible in this process (CUDA_VISIBLE_DEVICES).";
    case CUDA_ERROR_DEINITIALIZED:
      return " The CUDA driver is shutting down in this process.";
    case CUDA_ERROR_NO_DEVICE:
      return " No CUDA device is visible: check the driver and CUDA_VISIBLE_DEVICES.";
    default:
      return "";
  }
}

}  // namespace

const DriverApi& driver() {
  if (const DriverApi* d = g_loaded.load(std::memory_order_acquire)) return *d;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (const DriverApi* d = g_loaded.load(std::memory_order_acquire)) return *d;
  static DriverApi api;
  api = load_all();  // throws NotAvailable; a later call tries again
  CUresult r = api.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    api.cuGetErrorName(r, &name);
    throw NotAvailable(cat("cuInit failed (", name ? name : "unknown", ", status ", static_cast<int>(r),
                           "): no usable CUDA device. Check nvidia-smi and CUDA_VISIBLE_DEVICES."));
  }
  g_loaded.store(&api, std::memory_order_release);
  return api;
}

const char* cu_error_name(CUresult err) {
  const char* s = nullptr;
  if (const DriverApi* d = g_loaded.load(std::memory_order_acquire)) d->cuGetErrorName(err, &s);
  return s ? s : "CUDA_ERROR_UNKNOWN_STATUS";
}

const char* cu_error_string(CUresult err) {
  const char* s = nullptr;
  if (const DriverApi* d = g_loaded.load(std::memory_order_acquire)) d->cuGetErrorString(err, &s);
  return s ? s : "unrecognised CUDA driver status";
}

void throw_cu_error(CUresult err, const char* expr, const char* file, int line, const char* func) {
  const char* name = cu_error_name(err);
  std::string msg = cat(expr, " failed: ", cu_error_string(err), " (", name, ", status ", static_cast<int>(err),
                        ") at ", file, ":", line, " in ", func, ".", hint_for(err));
  if (err == CUDA_ERROR_OUT_OF_MEMORY) throw CudaOutOfMemory(msg, static_cast<int>(err), name);
  throw CudaError(msg, static_cast<int>(err), name);
}

}  // namespace colomem
