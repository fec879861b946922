#include "core/checksum.h"

#include <cstring>

#include "core/errors.h"

namespace colomem {

uint64_t host_checksum(const void* ptr, size_t nbytes, size_t stride_words) {
  using namespace checksum_detail;
  require(stride_words >= 1, cat("stride_words must be >= 1, got ", stride_words));
  require(ptr != nullptr || nbytes == 0, "checksum of a null pointer");
  const unsigned char* p = static_cast<const unsigned char*>(ptr);
  const uint64_t n_words = nbytes / 8;
  auto word_at = [p](uint64_t i) {
    uint64_t w;
    std::memcpy(&w, p + i * 8, 8);  // little-endian hosts only (x86-64, aarch64), like the GPU
    return w;
  };
  uint64_t sum = 0;
  for (uint64_t i = 0; i < n_words; i += stride_words) {
    sum += term(i, word_at(i));
    if (n_words - i <= stride_words) break;  // no overflow of i for huge strides
  }
  if (last_word_extra(n_words, stride_words)) sum += term(n_words - 1, word_at(n_words - 1));
  if (size_t tail = nbytes % 8) {
    uint64_t w = 0;
    std::memcpy(&w, p + n_words * 8, tail);
    sum += term(n_words, w);
  }
  return finish(sum, nbytes, stride_words);
}

void host_checksum_many(const uint64_t* descs, size_t n, uint64_t* out) {
  require(n == 0 || (descs != nullptr && out != nullptr), "checksum_many: null descriptors or output");
  for (size_t i = 0; i < n; ++i) {
    const uint64_t* d = descs + i * kChecksumDescWords;
    out[i] = host_checksum(reinterpret_cast<const void*>(static_cast<uintptr_t>(d[0])), static_cast<size_t>(d[1]),
                           static_cast<size_t>(d[2]));
  }
}

}  // namespace colomem
