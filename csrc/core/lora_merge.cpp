#include "core/lora_merge.h"

#include "core/errors.h"

namespace colomem {

void check_lora_merge_args(const LoraMergeArgs& a) {
  require(a.m >= 0 && a.n >= 0 && a.r >= 0,
          cat("lora_merge: sizes must be >= 0, got m ", a.m, ", n ", a.n, ", r ", a.r));
  require(a.factors == MergeFactors::kBf16 || a.factors == MergeFactors::kFp32,
          cat("lora_merge: factors must be 0 (bf16) or 1 (fp32), got ", static_cast<int>(a.factors)));
  if (a.m == 0 || a.n == 0) return;
  require(a.w != 0 && a.out != 0 && a.w % 2 == 0 && a.out % 2 == 0,
          "lora_merge: the weight and the output need non-null, 2-byte aligned addresses");
  // two distinct output elements on one address would make the result depend on the order of the writes
  require((a.m == 1 || a.os0 != 0) && (a.n == 1 || a.os1 != 0),
          cat("lora_merge: the output's strides (", a.os0, ", ", a.os1, ") put several elements on one address"));
  if (a.r == 0) return;
  const uintptr_t align = a.factors == MergeFactors::kFp32 ? 4 : 2;
  require(a.p != 0 && a.q != 0 && a.p % align == 0 && a.q % align == 0,
          cat("lora_merge: the factors need non-null, ", align, "-byte aligned addresses"));
}

void host_lora_merge(const LoraMergeArgs& a) {
  using namespace merge_detail;
  check_lora_merge_args(a);
  const auto* w = reinterpret_cast<const uint16_t*>(a.w);
  auto* out = reinterpret_cast<uint16_t*>(a.out);
  for (int64_t i = 0; i < a.m; ++i) {
    for (int64_t j = 0; j < a.n; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < a.r; ++k)
        acc = fma_rn(factor(a.p, i * a.ps0 + k * a.ps1, a.factors), factor(a.q, k * a.qs0 + j * a.qs1, a.factors),
                     acc);
      const float wv = bf16_float(w[i * a.ws0 + j * a.ws1]);
      out[i * a.os0 + j * a.os1] = float_bf16(fma_rn(a.scale, acc, wv));
    }
  }
}

}  // namespace colomem
