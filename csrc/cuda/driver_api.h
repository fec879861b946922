// CUDA driver entry points, fetched at first use through cudaGetDriverEntryPointByVersion so the module
// never links libcuda: it imports on a machine without a driver and fails only when a driver call is made.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

namespace colomem {

// Every pointer is non-null once driver() returned. The versioned typedefs pin the ABI we call.
struct DriverApi {
  PFN_cuGetErrorString_v6000 cuGetErrorString;
  PFN_cuGetErrorName_v6000 cuGetErrorName;
  PFN_cuInit_v2000 cuInit;
  PFN_cuDeviceGet_v2000 cuDeviceGet;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute;
  PFN_cuDeviceGetUuid_v11040 cuDeviceGetUuid;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity;
  PFN_cuMemCreate_v10020 cuMemCreate;
  PFN_cuMemRelease_v10020 cuMemRelease;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree;
  PFN_cuMemMap_v10020 cuMemMap;
  PFN_cuMemUnmap_v10020 cuMemUnmap;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle;
  PFN_cuMemRetainAllocationHandle_v11000 cuMemRetainAllocationHandle;
  PFN_cuPointerGetAttribute_v4000 cuPointerGetAttribute;
};

// Loads the entry points once (thread-safe) and calls cuInit. Throws NotAvailable when there is no usable
// driver or it lacks one of the entry points (driver older than CUDA 12).
const DriverApi& driver();

// The driver's name/description of a status, or "CUDA_ERROR_<n>" when the driver is not loaded.
const char* cu_error_name(CUresult err);
const char* cu_error_string(CUresult err);

}  // namespace colomem
