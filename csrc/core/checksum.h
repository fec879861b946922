// The bucket checksum: a 64-bit, order-dependent hash of a byte range, identical on the host (this file's
// host_checksum) and on the GPU (cuda/kernels.cu), so CPU tests pin the algorithm the GPU runs.
//
// The range is read as little-endian 8-byte words w[0..n_words), plus a tail word of the last
// nbytes % 8 bytes zero-padded (index n_words). With stride_words = s, the words sampled are those with
// i % s == 0, the last full word, and the tail. Each sampled word adds term(i, w[i]) mod 2^64 (a sum, so
// the GPU can reduce in any order; the index inside the term makes it order-dependent), and the sum is
// finished with nbytes and the stride, so different lengths or strides give different values.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define COLOMEM_HD __host__ __device__ __forceinline__
#else
#define COLOMEM_HD inline
#endif

namespace colomem {
namespace checksum_detail {

COLOMEM_HD uint64_t fmix64(uint64_t k) {  // murmur3's finaliser: a bijection with full avalanche
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

COLOMEM_HD uint64_t term(uint64_t index, uint64_t word) {
  return fmix64(word ^ fmix64(index * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL));
}

COLOMEM_HD uint64_t finish(uint64_t sum, uint64_t nbytes, uint64_t stride_words) {
  return fmix64(sum + fmix64(nbytes ^ 0xC2B2AE3D27D4EB4FULL) + stride_words * 0x165667B19E3779F9ULL);
}

// Whether the last full word needs its own term (it is not on the stride grid).
COLOMEM_HD bool last_word_extra(uint64_t n_words, uint64_t stride_words) {
  return n_words > 0 && (n_words - 1) % stride_words != 0;
}

}  // namespace checksum_detail

// stride_words >= 1 (1 = every word). Any alignment of ptr.
uint64_t host_checksum(const void* ptr, size_t nbytes, size_t stride_words);

// A batch of windows: kChecksumDescWords uint64 each, (address, nbytes, stride_words), the layout the GPU's
// batched checksum reads too.
constexpr size_t kChecksumDescWords = 3;

// The checksums of n windows of host memory described by `descs` (n * kChecksumDescWords words), into out[0..n).
void host_checksum_many(const uint64_t* descs, size_t n, uint64_t* out);

}  // namespace colomem
