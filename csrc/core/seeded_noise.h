// Exponential noise for sampling, from a counter-based generator (Philox4x32-10) keyed by a request's seed
// and its draw offset: (seed, offset, column) gives the same value on the host and on the GPU whatever else
// the batch holds, so a seeded request samples the same tokens however it was batched. vLLM's sampler draws
// one row per seeded request with torch's generator (a kernel launch each, every decode step); this draws
// every seeded row of a step in one launch (cuda/kernels.cu), and the host version pins the algorithm.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/host_device.h"

namespace colomem {
namespace noise_detail {

struct Block4 {
  uint32_t x[4];
};

COLOMEM_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// Philox4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011).
COLOMEM_HD Block4 philox4x32_10(Block4 c, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(0xD2511F53u, c.x[0], hi0, lo0);
    mulhilo32(0xCD9E8D57u, c.x[2], hi1, lo1);
    Block4 n;
    n.x[0] = hi1 ^ c.x[1] ^ k0;
    n.x[1] = lo1;
    n.x[2] = hi0 ^ c.x[3] ^ k1;
    n.x[3] = lo0;
    c = n;
  }
  return c;
}

// A uniform in (0, 1) from the top 23 bits: never 0 or 1, so -log(u) is finite and above 0 (a zero would
// make its token's score infinite). 23 bits, not 24: k + 0.5 is exact in float32 only for k < 2^23 (above, it
// rounds, and the largest k would give exactly 1).
COLOMEM_HD float open_uniform(uint32_t x) { return (static_cast<float>(x >> 9) + 0.5f) * (1.0f / 8388608.0f); }

// The four uniforms of columns 4 * quad .. 4 * quad + 3 of a row with this seed and offset.
COLOMEM_HD Block4 quad_bits(uint64_t seed, uint64_t offset, uint64_t quad) {
  Block4 c;
  c.x[0] = static_cast<uint32_t>(quad);
  c.x[1] = static_cast<uint32_t>(quad >> 32);
  c.x[2] = static_cast<uint32_t>(offset);
  c.x[3] = static_cast<uint32_t>(offset >> 32);
  return philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

}  // namespace noise_detail

// The checks both the host and the GPU path make of their sizes (InvalidArgument).
void check_exponential_rows_args(int64_t row_stride, int64_t n_q_rows, int64_t vocab, int64_t n);

// For i < n: row rows[i] of q (float32, row_stride elements apart, n_q_rows rows) gets -log(u) in its first
// vocab columns, u from (seeds[i], offsets[i], column). InvalidArgument for a row outside q.
void host_exponential_rows(float* q, int64_t row_stride, int64_t n_q_rows, int64_t vocab, const int64_t* rows,
                           const int64_t* seeds, const int64_t* offsets, int64_t n);

}  // namespace colomem
