// A LoRA merge into a bf16 weight with one rounding: out = bf16(w + scale * P @ Q), the product summed in
// fp32 (fused multiply-adds over k in ascending order), the scaled sum added to the weight in fp32 and
// rounded once to bf16, nearest-even (NaN as torch writes it, 0x7FC0). cuBLAS's bf16 GEMM rounds the product
// to bf16 before it adds the weight (two roundings); the fp32 path rounds once but writes and reads an fp32
// product of the weight's size. This reads the weight once and writes it once.
//
// P is m x r, Q is r x n, w and out m x n, each given by a pointer and two element strides, so transposed
// views (peft's fan_in_fan_out) need no copy; out may be w itself (in place). The factors are bf16 or fp32.
// The element arithmetic below is shared by the host version (core/lora_merge.cpp) and the GPU kernel
// (cuda/lora_merge.cu): both do the same operations in the same order, so their results are bit for bit the
// same, and the host version pins what the kernel must give.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace colomem {

// What the factors hold.
enum class MergeFactors : int { kBf16 = 0, kFp32 = 1 };

struct LoraMergeArgs {
  uintptr_t w = 0, p = 0, q = 0, out = 0;      // addresses
  int64_t ws0 = 0, ws1 = 0, ps0 = 0, ps1 = 0;  // element strides: w[i, j] = w + i * ws0 + j * ws1, ...
  int64_t qs0 = 0, qs1 = 0, os0 = 0, os1 = 0;
  int64_t m = 0, n = 0, r = 0;
  float scale = 1.0f;
  MergeFactors factors = MergeFactors::kBf16;
};

// InvalidArgument for sizes below 0, an unknown factor kind, null or misaligned addresses, or an output
// whose distinct elements would land on one address (a zero stride in a dimension longer than one).
void check_lora_merge_args(const LoraMergeArgs& a);

// The merge on host memory (the reference the GPU kernel is tested against; slow: one element at a time).
void host_lora_merge(const LoraMergeArgs& a);

namespace merge_detail {

COLOMEM_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

COLOMEM_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

COLOMEM_HD float bf16_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even, as torch's float -> bfloat16 conversion does (a NaN becomes 0x7FC0).
COLOMEM_HD uint16_t float_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0) return 0x7FC0u;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

COLOMEM_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

COLOMEM_HD float factor(uintptr_t base, int64_t index, MergeFactors kind) {
  return kind == MergeFactors::kFp32 ? reinterpret_cast<const float*>(base)[index]
                                     : bf16_float(reinterpret_cast<const uint16_t*>(base)[index]);
}

}  // namespace merge_detail
}  // namespace colomem
