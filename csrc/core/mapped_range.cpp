#include "core/mapped_range.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/copy_engine.h"  // wait_bound
#include "core/errors.h"

namespace colomem {

namespace {

size_t round_up(size_t n, size_t g) { return (n + g - 1) / g * g; }

std::string gib(size_t n) { return cat(static_cast<double>(n) / static_cast<double>(1ull << 30), " GiB"); }

}  // namespace

void MappedRange::layout(int device, size_t nbytes, size_t chunk_bytes, size_t granularity) {
  require(nbytes > 0, "a mapped range needs nbytes > 0");
  require(chunk_bytes > 0, "a mapped range needs chunk_bytes > 0");
  require(granularity > 0, "mapping granularity is 0");
  device_ = device;
  nbytes_ = nbytes;
  granularity_ = granularity;
  chunk_bytes_ = round_up(chunk_bytes, granularity);
  const size_t full = nbytes / chunk_bytes_;
  const size_t rest = nbytes - full * chunk_bytes_;
  sizes_.assign(full, chunk_bytes_);
  if (rest) sizes_.push_back(round_up(rest, granularity));
  reserved_ = full * chunk_bytes_ + (rest ? round_up(rest, granularity) : 0);
  mapped_.assign(sizes_.size(), false);
}

uintptr_t MappedRange::ptr() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw PoolClosed("this mapped range was closed; its addresses are no longer reserved");
  return ptr_;
}

size_t MappedRange::chunk_offset(size_t i) const {
  require(i < sizes_.size(), cat("chunk ", i, " is out of range (", sizes_.size(), " chunks)"));
  return i * chunk_bytes_;
}

size_t MappedRange::chunk_size(size_t i) const {
  require(i < sizes_.size(), cat("chunk ", i, " is out of range (", sizes_.size(), " chunks)"));
  return sizes_[i];
}

bool MappedRange::is_mapped(size_t i) const {
  std::lock_guard<std::mutex> lock(mu_);
  require(i < sizes_.size(), cat("chunk ", i, " is out of range (", sizes_.size(), " chunks)"));
  return mapped_[i];
}

size_t MappedRange::mapped_chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_count_;
}

size_t MappedRange::mapped_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_bytes_;
}

bool MappedRange::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

void MappedRange::check_span(size_t first, size_t count) const {
  require(first <= sizes_.size() && count <= sizes_.size() - first,
          cat("chunks [", first, ", ", first, " + ", count, ") are out of range (", sizes_.size(), " chunks)"));
  if (closed_) throw PoolClosed("this mapped range was closed; make a new one");
}

size_t MappedRange::map(size_t first, size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  check_span(first, count);
  std::vector<size_t> done;
  try {
    for (size_t i = first; i < first + count; ++i) {
      if (mapped_[i]) continue;
      map_chunk(ptr_ + i * chunk_bytes_, sizes_[i]);
      mapped_[i] = true;
      ++mapped_count_;
      mapped_bytes_ += sizes_[i];
      done.push_back(i);
    }
  } catch (...) {
    for (size_t i : done) {  // nothing has used them yet: no device work to wait for
      unmap_chunk(ptr_ + i * chunk_bytes_, sizes_[i]);
      mapped_[i] = false;
      --mapped_count_;
      mapped_bytes_ -= sizes_[i];
    }
    throw;
  }
  return done.size();
}

size_t MappedRange::unmap(size_t first, size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  check_span(first, count);
  size_t n = 0;
  for (size_t i = first; i < first + count; ++i) {
    if (!mapped_[i]) continue;
    unmap_chunk(ptr_ + i * chunk_bytes_, sizes_[i]);
    mapped_[i] = false;
    --mapped_count_;
    mapped_bytes_ -= sizes_[i];
    ++n;
  }
  return n;
}

void MappedRange::close(double timeout_s) {
  const auto bound = wait_bound(timeout_s);  // NaN / negative refused before anything changes
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  if (mapped_count_ && !drain(bound))
    throw Timeout(cat("closing a mapped range of ", gib(mapped_bytes_), " on ", device_ < 0 ? "the host" : "cuda:",
                      device_ < 0 ? "" : std::to_string(device_), ": the work queued on the device before close() "
                      "was still running after ", timeout_s, " s, and unmapping under it would fault. The range "
                      "stays mapped and usable: close again once the GPU is idle (nvidia-smi shows whether it is "
                      "hung)"));
  teardown();
}

void MappedRange::teardown() noexcept {
  if (closed_) return;
  closed_ = true;
  for (size_t i = 0; i < sizes_.size(); ++i)
    if (mapped_[i]) unmap_chunk(ptr_ + i * chunk_bytes_, sizes_[i]);
  mapped_.assign(sizes_.size(), false);
  mapped_count_ = mapped_bytes_ = 0;
  if (ptr_ && owns_addresses_) release_range();
  ptr_ = 0;
}

void MappedRange::adopt(uintptr_t address, size_t nbytes) {
  require(address != 0, "attaching a mapped range needs a non-null address");
  require(address % granularity_ == 0 && nbytes % granularity_ == 0,
          cat("attaching a mapped range: address ", hex(address), " and size ", nbytes, " must be multiples of the "
              "mapping granularity (", granularity_, " bytes)"));
  ptr_ = address;
  owns_addresses_ = false;
}

// ---------------------------------------------------------------------------------------------------------
// Host memory: a PROT_NONE reservation; a chunk is an anonymous read-write mapping placed over its part of it
// (populated at once, as device memory is backed when mapped); unmapping puts a PROT_NONE mapping back in
// its place, which drops the pages and keeps the addresses reserved (also where another owner reserved them).

namespace {

class HostRange final : public MappedRange {
 public:
  HostRange(size_t nbytes, size_t chunk_bytes) {
    layout(-1, nbytes, chunk_bytes, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
    void* p = mmap(nullptr, reserved_bytes(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw PoolExhausted(cat("reserving ", gib(reserved_bytes()), " of host address space failed: ",
                              std::strerror(errno)));
    ptr_ = reinterpret_cast<uintptr_t>(p);
  }

  HostRange(uintptr_t address, size_t nbytes, size_t chunk_bytes) {  // laid over another's reservation
    layout(-1, nbytes, chunk_bytes, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
    adopt(address, nbytes);
  }

  ~HostRange() override {
    std::lock_guard<std::mutex> lock(mu_);
    teardown();  // nothing but this process's threads can use host memory: no device to wait for
  }

 protected:
  void map_chunk(uintptr_t address, size_t size) override {
    void* p = mmap(reinterpret_cast<void*>(address), size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
      throw PoolExhausted(cat("mapping ", gib(size), " of host memory at ", hex(address), " failed: ",
                              std::strerror(errno)));
  }

  void unmap_chunk(uintptr_t address, size_t size) noexcept override {
    void* p = mmap(reinterpret_cast<void*>(address), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      warn(cat("unmapping ", gib(size), " of host memory at ", hex(address), " failed: ", std::strerror(errno)));
  }

  void release_range() noexcept override {
    if (munmap(reinterpret_cast<void*>(ptr_), reserved_bytes()) != 0)
      warn(cat("freeing a mapped range's host addresses failed: ", std::strerror(errno)));
  }

  bool drain(std::optional<std::chrono::steady_clock::duration>) override { return true; }
};

}  // namespace

std::shared_ptr<MappedRange> make_mapped_range(int device, size_t nbytes, size_t chunk_bytes) {
  if (device < 0) return std::make_shared<HostRange>(nbytes, chunk_bytes);
  return make_device_range(device, nbytes, chunk_bytes);
}

std::shared_ptr<MappedRange> attach_mapped_range(int device, uintptr_t address, size_t nbytes, size_t chunk_bytes) {
  if (device < 0) return std::make_shared<HostRange>(address, nbytes, chunk_bytes);
  return attach_device_range(device, address, nbytes, chunk_bytes);
}

}  // namespace colomem
