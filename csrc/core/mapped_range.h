// Memory mapped chunk by chunk at fixed addresses inside one reserved address range.
//
// A chunk that is unmapped gives its memory back (to the CUDA driver on a GPU, to the kernel on the host)
// while the range keeps its addresses, so whatever views the range keeps its pointers across unmap/map
// cycles, and a set of tensors can leave and come back one chunk at a time: each chunk is freed as its
// copy out ends and mapped again just before its copy back, which one allocation per tensor cannot do.
//
// On a GPU (device >= 0) a chunk is a CUDA VMM allocation (cuMemCreate) mapped with cuMemMap; the range is
// cuMemAddressReserve'd. On the host (device < 0) the range is a PROT_NONE reservation and a chunk an
// anonymous mapping placed over it (populated when mapped, dropped when unmapped): the same bookkeeping,
// testable without a GPU.
//
// Reading or writing an unmapped chunk faults (an illegal address on the GPU, SIGSEGV on the host). unmap()
// does not wait for the device: the caller unmaps a chunk only once nothing queued still uses it (its copy
// out has ended). close() waits, bounded, for the device's queued work before unmapping everything.
//
// A range may also be laid over addresses someone else reserved (attach_mapped_range): another allocator's
// allocation whose own mapping its owner took down first (vLLM's KV cache, one handle per layer, re-backed by
// chunks that come and go on their own). Such a range maps and unmaps its chunks the same way but never frees
// the addresses: close() unmaps its chunks and leaves the reservation to its owner, who maps it again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <chrono>
#include <mutex>
#include <optional>
#include <vector>

namespace colomem {

class MappedRange {
 public:
  virtual ~MappedRange() = default;
  MappedRange(const MappedRange&) = delete;
  MappedRange& operator=(const MappedRange&) = delete;

  // How long close() waits by default for the device's queued work.
  static constexpr double kCloseWaitS = 60.0;

  uintptr_t ptr() const;  // PoolClosed after close()
  size_t nbytes() const { return nbytes_; }            // what was asked for
  size_t chunk_bytes() const { return chunk_bytes_; }  // every chunk's size but maybe the last one's
  size_t nchunks() const { return sizes_.size(); }
  size_t reserved_bytes() const { return reserved_; }  // the chunks' sizes summed
  int device() const { return device_; }
  size_t granularity() const { return granularity_; }  // chunk sizes are multiples of it
  bool owns_addresses() const { return owns_addresses_; }  // false: laid over another's reservation
  // Offset and size of chunk i; InvalidArgument out of range.
  size_t chunk_offset(size_t i) const;
  size_t chunk_size(size_t i) const;

  bool is_mapped(size_t i) const;
  size_t mapped_chunks() const;
  size_t mapped_bytes() const;
  bool closed() const;

  // Maps the chunks of [first, first + count) that are not mapped yet, in order; returns how many it mapped.
  // If one fails (out of memory), the chunks this call mapped are unmapped again before the error is thrown,
  // so a failed call leaves the range as it found it. The new chunks' bytes are undefined.
  size_t map(size_t first, size_t count);
  // Unmaps the mapped chunks of [first, first + count); returns how many. Their bytes are gone. Does not wait
  // for the device: nothing queued may still read or write them.
  size_t unmap(size_t first, size_t count);
  // Waits up to timeout_s (inf: no bound) for the work queued on the device before the call, then unmaps every
  // chunk and frees the address range. Timeout if that work still runs (the range stays as it was: close
  // again). Idempotent.
  void close(double timeout_s);

 protected:
  MappedRange() = default;
  // Sets the chunk layout; the subclass then reserves [ptr_, ptr_ + reserved_bytes()), or adopts a range.
  void layout(int device, size_t nbytes, size_t chunk_bytes, size_t granularity);
  // After layout(): the range is [address, address + nbytes), reserved by another owner (InvalidArgument
  // unless both are multiples of the granularity); teardown leaves the addresses reserved.
  void adopt(uintptr_t address, size_t nbytes);

  // Map or unmap one chunk at ptr_ + offset (mu_ held). unmap_chunk reports failures through warn().
  virtual void map_chunk(uintptr_t address, size_t size) = 0;
  virtual void unmap_chunk(uintptr_t address, size_t size) noexcept = 0;
  // Frees the address range once every chunk is unmapped.
  virtual void release_range() noexcept = 0;
  // Waits for the device's queued work before close() unmaps: false when `bound` (nullopt: none) passed first.
  virtual bool drain(std::optional<std::chrono::steady_clock::duration> bound) = 0;
  // Unmaps every mapped chunk and frees the range without waiting (mu_ held): from a subclass's destructor.
  void teardown() noexcept;

  uintptr_t ptr_ = 0;
  mutable std::mutex mu_;
  bool closed_ = false;
  bool owns_addresses_ = true;  // release_range() runs at teardown only then

 private:
  void check_span(size_t first, size_t count) const;

  size_t nbytes_ = 0;
  size_t chunk_bytes_ = 0;
  size_t reserved_ = 0;
  size_t granularity_ = 0;
  int device_ = -1;
  std::vector<size_t> sizes_;
  std::vector<bool> mapped_;
  size_t mapped_count_ = 0;
  size_t mapped_bytes_ = 0;
};

// A range on `device` (< 0: host memory) of at least nbytes, in chunks of chunk_bytes rounded up to the
// mapping granularity (the last chunk holds the rest, rounded the same way). Nothing is mapped yet.
std::shared_ptr<MappedRange> make_mapped_range(int device, size_t nbytes, size_t chunk_bytes);
// The GPU kind (cuda/mapped_range_cuda.cpp; the host-only build's stub raises NotAvailable).
std::shared_ptr<MappedRange> make_device_range(int device, size_t nbytes, size_t chunk_bytes);

// A range laid over [address, address + nbytes), addresses the caller's allocator reserved and keeps: nothing
// may be mapped there (the owner unmapped its own mapping first), address and nbytes are multiples of the
// mapping granularity (the smallest the driver allows on a GPU, the page size on the host), and the range
// never frees those addresses. chunk_bytes is rounded up to the granularity. Nothing is mapped yet.
std::shared_ptr<MappedRange> attach_mapped_range(int device, uintptr_t address, size_t nbytes, size_t chunk_bytes);
std::shared_ptr<MappedRange> attach_device_range(int device, uintptr_t address, size_t nbytes, size_t chunk_bytes);

}  // namespace colomem
