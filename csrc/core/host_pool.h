// A pool of host memory, page-locked once and sub-allocated for many tensors.
//
// Segments come from mmap (transparent huge pages where available), are pre-faulted by several threads
// and registered with CUDA in one call each, so no block crosses a registration. Blocks are carved by
// best fit from a free list that coalesces neighbours; the pool grows by whole segments up to a cap.
// Every size is checked before it is rounded: a request that would wrap around 64 bits is InvalidArgument,
// never a 0-byte block. A block is one segment at most (64 GiB).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colomem {

struct PoolConfig {
  size_t initial_bytes = 0;      // reserved at construction (0: first segment on first alloc)
  size_t max_bytes = 0;          // cap on reserved bytes (0: no cap besides the OS), rounded down to pages
  size_t segment_bytes = 1ull << 30;  // size of each growth segment, <= 64 GiB (a larger block gets its own)
  size_t alignment = 4096;       // block alignment, a power of two <= 1 GiB (segment bases are aligned too)
  bool pin = true;               // page-lock segments with CUDA
  bool huge_pages = true;        // madvise(MADV_HUGEPAGE)
  int prefault_threads = 0;      // 0: min(16, hardware threads)
  bool populate = false;         // pre-fault with MADV_POPULATE_WRITE (else touch every page: faster)
};

struct PoolStats {
  size_t reserved_bytes = 0, in_use_bytes = 0, peak_in_use_bytes = 0, free_bytes = 0;
  size_t largest_free_block = 0, segments = 0, blocks = 0;
  uint64_t allocs = 0, frees = 0;
  double pin_seconds = 0, prefault_seconds = 0, map_seconds = 0;
  bool pinned = false;
};

struct BlockInfo {
  uint64_t id;
  uintptr_t ptr;
  size_t nbytes;
};

class HostPool {
 public:
  explicit HostPool(const PoolConfig& cfg);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  BlockInfo alloc(size_t nbytes);  // PoolExhausted at the cap; PoolClosed after close
  void free(uint64_t id);          // DoubleRelease for an id not live (freed twice, or never ours)
  PoolStats stats() const;
  // Releases all segments. PoolBusy when blocks are live unless force.
  void close(bool force);
  bool closed() const;
  bool pinned() const { return cfg_.pin; }
  const PoolConfig& config() const { return cfg_; }
  // Grows the pool so at least `nbytes` more can be allocated in one block (no-op if already possible).
  // InvalidArgument above 64 GiB, the largest block; PoolExhausted at the cap.
  void reserve(size_t nbytes);

 private:
  struct Segment {
    char* base = nullptr;
    size_t size = 0;
    bool registered = false;
    std::map<size_t, size_t> free_by_offset;  // offset -> size
  };
  struct Live {
    size_t seg, offset, size;
  };
  using FreeKey = std::tuple<size_t, size_t, size_t>;  // (size, segment, offset): best fit by size

  void add_segment_locked(size_t nbytes);
  void release_segments_locked();
  void insert_free_locked(size_t seg, size_t off, size_t size);
  void erase_free_locked(size_t seg, size_t off, size_t size);
  void check_open_locked() const;

  PoolConfig cfg_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Segment>> segs_;
  std::set<FreeKey> free_by_size_;
  std::unordered_map<uint64_t, Live> live_;
  uint64_t next_id_ = 1;
  bool closed_ = false;
  PoolStats st_;
};

}  // namespace colomem
