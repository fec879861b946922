// Host-only build: the CUDA-IPC buffers and the GPU checksum exist as symbols but every entry raises
// NotAvailable. The Unix socket and the host checksum (csrc/core) work in both builds.
#include "core/errors.h"
#include "cuda/ipc_buffer.h"
#include "cuda/kernels.h"

namespace colomem {

namespace {
[[noreturn]] void unavailable(const char* what) {
  throw NotAvailable(cat(what, ": colomem was built without CUDA; reinstall with nvcc on PATH or CUDA_HOME set"));
}
}  // namespace

IpcBuffer::~IpcBuffer() = default;
uintptr_t IpcBuffer::ptr() const { unavailable("IpcBuffer.ptr"); }
bool IpcBuffer::closed() const { return true; }
void IpcBuffer::close(double) {}
void IpcBuffer::map_handle() { unavailable("IpcBuffer"); }
void IpcBuffer::unmap_and_release() noexcept {}

ExportableBuffer::ExportableBuffer(int, size_t) { unavailable("ExportableBuffer"); }
int ExportableBuffer::export_fd() { unavailable("ExportableBuffer.export_fd"); }
ImportedBuffer::ImportedBuffer(int, size_t, int) { unavailable("ImportedBuffer"); }

std::string device_uuid(int) { unavailable("device_uuid"); }
int device_by_uuid(const std::string&) { unavailable("device_by_uuid"); }
size_t ipc_granularity(int) { unavailable("ipc_granularity"); }

uint64_t device_checksum(uintptr_t, size_t, size_t, uintptr_t, int, double) { unavailable("checksum on a CUDA device"); }
void device_checksum_into(uintptr_t, size_t, size_t, uintptr_t, uintptr_t, int, uintptr_t) {
  unavailable("checksum on a CUDA device");
}

void device_checksum_many_into(uintptr_t, size_t, uintptr_t, uintptr_t, int, uintptr_t) {
  unavailable("checksum on a CUDA device");
}

void device_store_words(uintptr_t, size_t, uintptr_t, uintptr_t, int) { unavailable("store_words on a CUDA device"); }

void device_lora_merge(const LoraMergeArgs&, uintptr_t, int) { unavailable("lora_merge on a CUDA device"); }

void device_exponential_rows(uintptr_t, int64_t, int64_t, int64_t, uintptr_t, int64_t, uintptr_t, int) {
  unavailable("sampling noise on a CUDA device");
}

}  // namespace colomem
