#include "core/host_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/errors.h"
#include "core/pinning.h"

namespace colomem {

namespace {

constexpr size_t kHugePage = 2ull << 20;
// One cudaHostRegister call per segment, and a block never crosses segments: this is the largest block.
constexpr size_t kMaxSegment = 64ull << 30;
// Segments are mapped this much larger than asked to align their base; past 1 GiB that waste has no use.
constexpr size_t kMaxAlignment = 1ull << 30;
#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateWrite = 23;  // Linux 5.14 uapi value, for older headers
#endif

size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// n rounded up to a multiple of a (a power of two), refused where the result would not fit in size_t.
size_t round_up(size_t n, size_t a, const char* what) {
  if (n > SIZE_MAX - (a - 1))
    throw InvalidArgument(cat(what, " of ", n, " bytes is too large: rounded up to a multiple of ", a,
                              " it does not fit in 64 bits; ask for at most ", kMaxSegment, " bytes"));
  return (n + a - 1) / a * a;
}

size_t round_down(size_t n, size_t a) { return n / a * a; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string gib(size_t n) { return cat(static_cast<double>(n) / (1ull << 30), " GiB"); }

// Maps `size` bytes with the base aligned to `align` (at least 2 MiB, so transparent huge pages can back
// all of it, and more when blocks must be aligned more: their offsets in a segment are multiples of it).
char* map_aligned(size_t size, size_t align) {
  size_t span = size + align;  // size <= kMaxSegment and align <= kMaxAlignment: cannot overflow
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED)
    throw PoolExhausted(cat("mmap of ", gib(size), " of host memory failed: ", std::strerror(errno),
                            ". Lower the pool size or free host RAM."));
  uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = (base + align - 1) / align * align;
  if (aligned > base) munmap(raw, aligned - base);
  size_t tail = (base + span) - (aligned + size);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + size), tail);
  return reinterpret_cast<char*>(aligned);
}

void prefault_range(char* base, size_t begin, size_t end, size_t page, bool populate) {
  // MADV_POPULATE_WRITE (Linux 5.14+) faults the range in-kernel, huge pages included, without a
  // user fault per page; older kernels fall back to touching each page.
  if (populate && madvise(base + begin, end - begin, kMadvPopulateWrite) == 0) return;
  volatile char* p = base;
  for (size_t off = begin; off < end; off += page) p[off] = 0;
}

// First-touch every page from several threads: the kernel's page-fault path scales across cores,
// and cudaHostRegister of already-populated pages is about 8x cheaper than of untouched ones.
// Where a thread cannot be started (RLIMIT_NPROC, no memory for its stack) its range is faulted on the
// calling thread instead: slower, never fatal.
void prefault(char* base, size_t size, int threads, bool populate) {
  size_t page = page_size();
  size_t per = round_up((size + threads - 1) / threads, kHugePage, "a pre-fault range");
  std::vector<std::thread> workers;
  std::vector<std::pair<size_t, size_t>> inline_ranges;
  for (int t = 0; t < threads; ++t) {
    size_t begin = static_cast<size_t>(t) * per;
    if (begin >= size) break;
    size_t end = std::min(size, begin + per);
    try {
      workers.emplace_back([=] { prefault_range(base, begin, end, page, populate); });
    } catch (const std::exception&) {  // std::system_error (EAGAIN) or bad_alloc: do it here
      inline_ranges.emplace_back(begin, end);
    }
  }
  for (auto [begin, end] : inline_ranges) prefault_range(base, begin, end, page, populate);
  for (auto& th : workers) th.join();
}

}  // namespace

HostPool::HostPool(const PoolConfig& cfg) : cfg_(cfg) {
  size_t page = page_size();
  require(cfg_.alignment > 0 && (cfg_.alignment & (cfg_.alignment - 1)) == 0 && cfg_.alignment <= kMaxAlignment,
          cat("alignment must be a power of two of at most ", kMaxAlignment, " bytes (1 GiB), got ",
              cfg_.alignment));
  require(cfg_.segment_bytes > 0 && cfg_.segment_bytes <= kMaxSegment,
          cat("segment_bytes must be from 1 byte to 64 GiB (each segment is page-locked in one call and holds "
              "whole blocks), got ", cfg_.segment_bytes));
  if (cfg_.max_bytes != 0) {
    // The pool reserves whole pages: a cap that is not a page multiple is rounded down, so it is never
    // exceeded; one below a page could hold nothing.
    require(cfg_.max_bytes >= page, cat("max_bytes of ", cfg_.max_bytes, " bytes is less than one page (", page,
                                        " bytes), the least the pool can reserve; raise it or pass no cap"));
    cfg_.max_bytes = round_down(cfg_.max_bytes, page);
    size_t initial = round_up(cfg_.initial_bytes, page, "initial_bytes");
    require(initial <= cfg_.max_bytes, cat("initial_bytes (", cfg_.initial_bytes, ", ", initial,
                                           " in whole pages) is larger than max_bytes (", cfg_.max_bytes,
                                           " in whole pages)"));
  }
  if (cfg_.prefault_threads <= 0)
    cfg_.prefault_threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 16u));
  st_.pinned = cfg_.pin;
  if (cfg_.pin && !pinning_available()) pin_range(nullptr, 0);  // throws the explanatory error
  if (cfg_.initial_bytes > 0) {
    // Checked before the first segment is faulted in, not after 64 GiB of it.
    size_t phys = static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * page;
    if (phys > 0 && round_up(cfg_.initial_bytes, page, "initial_bytes") > phys)
      throw PoolExhausted(cat("cannot reserve ", gib(cfg_.initial_bytes), " of host memory: the host has ",
                              gib(phys), " of RAM. Lower the pool size."));
    std::lock_guard<std::mutex> lk(mu_);
    try {
      for (size_t left = cfg_.initial_bytes; left > 0;) {
        size_t n = std::min(left, kMaxSegment);
        add_segment_locked(n);
        left -= n;
      }
    } catch (...) {
      release_segments_locked();  // the destructor does not run for a constructor that throws
      throw;
    }
  }
}

HostPool::~HostPool() {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  // Live blocks at destruction are normal at interpreter exit (sets keep their blocks between cycles);
  // close() is where a user is told that blocks still hold data.
  release_segments_locked();
  closed_ = true;
}

void HostPool::check_open_locked() const {
  if (closed_) throw PoolClosed("this pinned pool was closed; create a new PinnedPool");
}

void HostPool::add_segment_locked(size_t nbytes) {
  size_t page = page_size();
  require(nbytes <= kMaxSegment, cat("a segment of ", gib(nbytes), " exceeds the 64 GiB segment limit"));
  size_t size = round_up(nbytes, cfg_.huge_pages ? kHugePage : page, "a segment");  // <= kMaxSegment
  // Huge-page rounding must not take the pool past its cap: fall back to whole small pages there.
  if (cfg_.max_bytes && st_.reserved_bytes + size > cfg_.max_bytes) size = round_up(nbytes, page, "a segment");
  if (cfg_.max_bytes && st_.reserved_bytes + size > cfg_.max_bytes)
    throw PoolExhausted(cat("cannot add a segment of ", size, " bytes: the pool holds ", st_.reserved_bytes,
                            " bytes of its cap ", cfg_.max_bytes, "; raise max_bytes"));
  // Every byte is faulted in: more than the host's RAM can only end in the OOM killer, so refuse it here.
  size_t phys = static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * page;
  if (phys > 0 && (size > phys || st_.reserved_bytes > phys - size))
    throw PoolExhausted(cat("cannot grow the pinned pool by ", gib(size), " to ", gib(st_.reserved_bytes + size),
                            ": the host has ", gib(phys), " of RAM. Lower the pool size."));
  auto t0 = std::chrono::steady_clock::now();
  char* base = map_aligned(size, std::max(kHugePage, cfg_.alignment));
  if (cfg_.huge_pages) (void)madvise(base, size, MADV_HUGEPAGE);  // best effort: THP may be off
  st_.map_seconds += seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  prefault(base, size, cfg_.prefault_threads, cfg_.populate);
  st_.prefault_seconds += seconds_since(t0);
  auto seg = std::make_unique<Segment>();
  seg->base = base;
  seg->size = size;
  if (cfg_.pin) {
    t0 = std::chrono::steady_clock::now();
    try {
      pin_range(base, size);
    } catch (...) {
      munmap(base, size);
      throw;
    }
    seg->registered = true;
    st_.pin_seconds += seconds_since(t0);
  }
  segs_.push_back(std::move(seg));
  st_.reserved_bytes += size;
  insert_free_locked(segs_.size() - 1, 0, size);
}

void HostPool::insert_free_locked(size_t seg, size_t off, size_t size) {
  segs_[seg]->free_by_offset.emplace(off, size);
  free_by_size_.emplace(size, seg, off);
}

void HostPool::erase_free_locked(size_t seg, size_t off, size_t size) {
  segs_[seg]->free_by_offset.erase(off);
  free_by_size_.erase(FreeKey{size, seg, off});
}

void HostPool::reserve(size_t nbytes) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open_locked();
  size_t need = round_up(std::max<size_t>(nbytes, 1), cfg_.alignment, "reserve");
  // reserve() promises one block of `nbytes`; a block is one segment at most, so a larger promise
  // cannot be kept (growing by 64 GiB and saying yes would be a lie).
  require(need <= kMaxSegment, cat("cannot reserve one block of ", gib(need), ": the largest block is 64 GiB (a "
                                   "segment, page-locked in one call). Pass initial_bytes to reserve more in "
                                   "total, or reserve in several calls of at most 64 GiB"));
  if (!free_by_size_.empty() && std::get<0>(*free_by_size_.rbegin()) >= need) return;
  size_t pages = round_up(need, page_size(), "reserve");
  if (cfg_.max_bytes && st_.reserved_bytes + pages > cfg_.max_bytes)
    throw PoolExhausted(cat("cannot reserve ", gib(need), ": the pool holds ", gib(st_.reserved_bytes),
                            " of its cap ", gib(cfg_.max_bytes), "; raise max_bytes"));
  add_segment_locked(need);
}

BlockInfo HostPool::alloc(size_t nbytes) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open_locked();
  size_t size = round_up(std::max<size_t>(nbytes, 1), cfg_.alignment, "a block");
  require(size <= kMaxSegment, cat("a single block of ", gib(size), " exceeds the 64 GiB segment limit; "
                                   "split the tensor"));
  auto it = free_by_size_.lower_bound(FreeKey{size, 0, 0});
  if (it == free_by_size_.end()) {
    size_t grow = std::max(cfg_.segment_bytes, size);
    if (cfg_.max_bytes) {
      size_t page = page_size();
      size_t room = cfg_.max_bytes > st_.reserved_bytes ? (cfg_.max_bytes - st_.reserved_bytes) / page * page : 0;
      grow = std::min(grow, room);
      if (grow < size) {
        size_t largest = free_by_size_.empty() ? 0 : std::get<0>(*free_by_size_.rbegin());
        throw PoolExhausted(cat("pinned pool exhausted: asked for ", size, " bytes; ", st_.reserved_bytes -
                                st_.in_use_bytes, " bytes free (largest free block ", largest, "), ",
                                st_.reserved_bytes, " reserved of the cap ", cfg_.max_bytes,
                                ". Raise max_bytes, or release offloaded sets you no longer need."));
      }
    }
    add_segment_locked(grow);
    it = free_by_size_.lower_bound(FreeKey{size, 0, 0});
    if (it == free_by_size_.end())  // rounding left the new segment short: cannot happen, but never UB
      throw PoolExhausted(cat("pinned pool could not fit ", size, " bytes after growing"));
  }
  auto [fsize, seg, off] = *it;
  erase_free_locked(seg, off, fsize);
  if (fsize > size) insert_free_locked(seg, off + size, fsize - size);
  uint64_t id = next_id_++;
  live_.emplace(id, Live{seg, off, size});
  st_.in_use_bytes += size;
  st_.peak_in_use_bytes = std::max(st_.peak_in_use_bytes, st_.in_use_bytes);
  ++st_.allocs;
  return BlockInfo{id, reinterpret_cast<uintptr_t>(segs_[seg]->base + off), size};
}

void HostPool::free(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open_locked();
  auto it = live_.find(id);
  if (it == live_.end()) {
    if (id > 0 && id < next_id_)
      throw DoubleRelease(cat("block ", id, " was already released; each block is released once"));
    throw DoubleRelease(cat("block ", id, " does not belong to this pool"));
  }
  Live b = it->second;
  live_.erase(it);
  st_.in_use_bytes -= b.size;
  ++st_.frees;
  auto& fm = segs_[b.seg]->free_by_offset;
  size_t off = b.offset, size = b.size;
  auto next = fm.lower_bound(off);
  if (next != fm.end() && next->first == off + size) {
    size_t nsize = next->second;
    erase_free_locked(b.seg, next->first, nsize);
    size += nsize;
  }
  auto after = fm.lower_bound(off);
  if (after != fm.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == off) {
      size_t poff = prev->first, psize = prev->second;
      erase_free_locked(b.seg, poff, psize);
      off = poff;
      size += psize;
    }
  }
  insert_free_locked(b.seg, off, size);
}

PoolStats HostPool::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  PoolStats s = st_;
  s.free_bytes = s.reserved_bytes - s.in_use_bytes;
  s.largest_free_block = free_by_size_.empty() ? 0 : std::get<0>(*free_by_size_.rbegin());
  s.segments = segs_.size();
  s.blocks = live_.size();
  return s;
}

void HostPool::release_segments_locked() {
  for (auto& seg : segs_) {
    if (seg->registered) unpin_range(seg->base);
    munmap(seg->base, seg->size);
  }
  segs_.clear();
  free_by_size_.clear();
  live_.clear();
  st_.reserved_bytes = st_.in_use_bytes = 0;
}

void HostPool::close(bool force) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  if (!live_.empty() && !force) {
    throw PoolBusy(cat("cannot close the pinned pool: ", live_.size(), " blocks (", st_.in_use_bytes,
                       " bytes) are still in use, e.g. by offloaded tensors whose only copy they hold. "
                       "Reload or drop those sets first, or close(force=True) to discard them."));
  }
  release_segments_locked();
  closed_ = true;
}

bool HostPool::closed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return closed_;
}

}  // namespace colomem
