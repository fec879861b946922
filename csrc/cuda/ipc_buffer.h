// Device buffers that another process on the same GPU can map: CUDA VMM allocations (cuMemCreate) with
// POSIX file-descriptor shareable handles, passed over a Unix socket (core/unix_socket.h).
//
// Lifetime: the physical memory lives until the exporter and every importer released it (the driver
// counts the handles), so an importer's mapping stays valid when the exporter exits. close() unmaps and
// releases this process's share; nothing stays mapped after it. Kernels of this process may still use the
// range, so close() first waits, bounded, for the work queued on the device before it was called.
//
// Plain C++ header (no CUDA types): the host-only build links stubs (host_only/ipc_stub.cpp).
#pragma once

#include <cstddef>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace colomem {

struct DeviceDrain;  // a device-wide synchronisation on a helper thread (ipc_buffer.cpp)

class IpcBuffer {
 public:
  virtual ~IpcBuffer();
  IpcBuffer(const IpcBuffer&) = delete;
  IpcBuffer& operator=(const IpcBuffer&) = delete;

  uintptr_t ptr() const;                 // PoolClosed after close()
  size_t nbytes() const { return nbytes_; }  // mapped size (a multiple of the allocation granularity)
  int device() const { return device_; }
  const std::string& uuid() const { return uuid_; }
  // How long close() waits by default, and the destructor at most, for the device's queued work.
  static constexpr double kCloseWaitS = 60.0;
  // Waits up to timeout_s (inf: no bound; see wait_bound) for the work queued on the device in this process
  // before the call (kernels may still read or write the buffer; unmapping under them faults), then unmaps
  // and releases. Timeout if that work is still running then: the buffer stays mapped and usable, close
  // again. Other threads keep ptr() and export_fd() meanwhile; a concurrent close() waits, within its own
  // timeout, for the first one's outcome. Idempotent.
  void close(double timeout_s);
  bool closed() const;

 protected:
  IpcBuffer() = default;
  // Reserves an address range, maps handle_ there, grants read-write access to device_.
  void map_handle();
  // Unmaps and releases without waiting for the device: only once nothing can use the range.
  void unmap_and_release() noexcept;

  unsigned long long handle_ = 0;  // CUmemGenericAllocationHandle; 0 = none
  uintptr_t ptr_ = 0;              // reserved address range; 0 = none
  bool mapped_ = false;
  size_t nbytes_ = 0;
  int device_ = -1;
  std::string uuid_;
  mutable std::mutex mu_;
  bool closed_ = false;
  bool closing_ = false;                // a close() waits for the device (mu_ not held meanwhile)
  std::condition_variable closing_cv_;  // signalled when that wait ends
  std::shared_ptr<DeviceDrain> drain_;  // the wait of a close() that timed out, while it still runs
};

class ExportableBuffer : public IpcBuffer {
 public:
  // nbytes is rounded up to the device's recommended VMM granularity (2 MiB on current GPUs).
  ExportableBuffer(int device, size_t nbytes);
  size_t requested_nbytes() const { return requested_; }
  // A new file descriptor for the allocation, owned by the caller (send it, then close it).
  int export_fd();

 private:
  size_t requested_ = 0;
};

class ImportedBuffer : public IpcBuffer {
 public:
  // Maps the allocation behind fd (from ExportableBuffer::export_fd in another process) on `device` of
  // this process. nbytes is the exporter's nbytes(). The fd stays owned by the caller.
  ImportedBuffer(int fd, size_t nbytes, int device);
};

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it.
std::string device_uuid(int device);
// The ordinal in this process of the GPU with that UUID ("GPU-" prefix optional, any case).
// NotAvailable, listing the visible UUIDs and CUDA_VISIBLE_DEVICES, when this process cannot see it.
int device_by_uuid(const std::string& uuid);
// Recommended VMM granularity of the device (what ExportableBuffer rounds to).
size_t ipc_granularity(int device);

}  // namespace colomem
