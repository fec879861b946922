// What the driver knows about a device virtual address. Used by vLLM's worker to undo a partial wake:
// vLLM's cumem allocator reserves address ranges and maps physical memory into them, so a range can be
// reserved but unmapped.
#pragma once

#include <cstdint>

namespace colomem {

// Whether physical memory is mapped at `ptr` (CU_POINTER_ATTRIBUTE_MAPPED). An address the driver does not
// know (CUDA_ERROR_INVALID_VALUE: never reserved, or released) is not mapped; any other driver failure
// throws CudaError. NotAvailable in the host-only build or without a driver.
bool pointer_is_mapped(uintptr_t ptr);

}  // namespace colomem
