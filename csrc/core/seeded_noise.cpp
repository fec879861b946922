#include "core/seeded_noise.h"

#include <cmath>

#include "core/errors.h"

namespace colomem {

void check_exponential_rows_args(int64_t row_stride, int64_t n_q_rows, int64_t vocab, int64_t n) {
  require(vocab > 0 && row_stride >= vocab && n >= 0 && n_q_rows >= 0,
          cat("exponential_rows: need vocab > 0, row_stride >= vocab, n >= 0; got vocab ", vocab, ", row_stride ",
              row_stride, ", n ", n));
}

void host_exponential_rows(float* q, int64_t row_stride, int64_t n_q_rows, int64_t vocab, const int64_t* rows,
                           const int64_t* seeds, const int64_t* offsets, int64_t n) {
  using namespace noise_detail;
  check_exponential_rows_args(row_stride, n_q_rows, vocab, n);
  if (n == 0) return;
  require(q != nullptr && rows != nullptr && seeds != nullptr && offsets != nullptr,
          "exponential_rows: null pointer");
  for (int64_t i = 0; i < n; ++i) {
    require(rows[i] >= 0 && rows[i] < n_q_rows,
            cat("exponential_rows: row ", rows[i], " is outside the noise tensor's ", n_q_rows, " rows"));
    float* out = q + rows[i] * row_stride;
    const uint64_t seed = static_cast<uint64_t>(seeds[i]), offset = static_cast<uint64_t>(offsets[i]);
    for (int64_t quad = 0; quad * 4 < vocab; ++quad) {
      const Block4 b = quad_bits(seed, offset, static_cast<uint64_t>(quad));
      for (int k = 0; k < 4 && quad * 4 + k < vocab; ++k) out[quad * 4 + k] = -std::log(open_uniform(b.x[k]));
    }
  }
}

}  // namespace colomem
