// The LoRA merge of core/lora_merge.h on a GPU: one launch a layer, the weight read once and written once.
// Each block covers kRows rows and kCols * blockDim.x columns; a thread holds kRows x kCols fp32 sums, its
// columns blockDim.x apart so that a warp's loads and stores of the weight are contiguous. The block's rows
// of P are staged in shared memory as fp32, kTileK ranks at a time: every thread reads the same value there
// (a broadcast), so the rank loop is fused multiply-adds and one load of Q per column, with no 64-bit index
// products in it (integer work per load would otherwise bound the kernel far below the memory's speed). The
// sums run over k in ascending order, as the host version's do, so both give the same bits.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/errors.h"
#include "core/lora_merge.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace colomem {

namespace {

constexpr int kMergeThreads = 256;
constexpr int kRows = 16;
constexpr int kCols = 4;
constexpr int kTileK = 32;
constexpr unsigned int kMaxGridY = 65535;

template <MergeFactors Kind>
__device__ __forceinline__ float load_factor(uintptr_t base, int64_t index) {
  if constexpr (Kind == MergeFactors::kFp32) {
    return reinterpret_cast<const float*>(base)[index];
  } else {
    return merge_detail::bf16_float(reinterpret_cast<const uint16_t*>(base)[index]);
  }
}

template <MergeFactors Kind>
__global__ void __launch_bounds__(kMergeThreads) lora_merge_kernel(LoraMergeArgs a) {
  using namespace merge_detail;
  __shared__ __align__(16) float p_tile[kTileK][kRows];  // p_tile[kk][i] = P[row0 + i, k0 + kk]
  const auto* w = reinterpret_cast<const uint16_t*>(a.w);
  auto* out = reinterpret_cast<uint16_t*>(a.out);
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * blockDim.x * kCols + threadIdx.x;
  int64_t q_col[kCols];  // the column's offset in Q
  bool in_cols[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t j = col0 + static_cast<int64_t>(c) * blockDim.x;
    in_cols[c] = j < a.n;
    q_col[c] = j * a.qs1;
  }
  // every thread of the block runs the same iterations of both loops (the barriers below need that)
  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows; row0 < a.m;
       row0 += static_cast<int64_t>(gridDim.y) * kRows) {
    float acc[kRows][kCols];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[i][c] = 0.0f;
    for (int64_t k0 = 0; k0 < a.r; k0 += kTileK) {
      const int kn = a.r - k0 < kTileK ? static_cast<int>(a.r - k0) : kTileK;
      __syncthreads();  // the previous tile's readers are done with it
      for (int t = threadIdx.x; t < kTileK * kRows; t += blockDim.x) {
        const int kk = t / kRows, i = t % kRows;
        const int64_t row = row0 + i;
        p_tile[kk][i] = (row < a.m && kk < kn) ? load_factor<Kind>(a.p, row * a.ps0 + (k0 + kk) * a.ps1) : 0.0f;
      }
      __syncthreads();
      int64_t q_row = k0 * a.qs0;
      for (int kk = 0; kk < kn; ++kk, q_row += a.qs0) {
        float qv[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) qv[c] = in_cols[c] ? load_factor<Kind>(a.q, q_row + q_col[c]) : 0.0f;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          const float pv = p_tile[kk][i];
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[i][c] = fma_rn(pv, qv[c], acc[i][c]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int64_t row = row0 + i;
      if (row >= a.m) continue;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        if (!in_cols[c]) continue;
        const int64_t j = col0 + static_cast<int64_t>(c) * blockDim.x;
        const float wv = bf16_float(w[row * a.ws0 + j * a.ws1]);
        out[row * a.os0 + j * a.os1] = float_bf16(fma_rn(a.scale, acc[i][c], wv));
      }
    }
  }
}

}  // namespace

void device_lora_merge(const LoraMergeArgs& a, uintptr_t stream, int device) {
  check_lora_merge_args(a);
  if (a.m == 0 || a.n == 0) return;
  require_device(device, "lora_merge");
  DeviceGuard guard(device);
  // the first element of each operand is device memory of this GPU (a host tensor's address would fault)
  check_device_pointer(a.w, 2, device, "lora_merge");
  check_device_pointer(a.out, 2, device, "lora_merge");
  if (a.r > 0) {
    check_device_pointer(a.p, 2, device, "lora_merge");
    check_device_pointer(a.q, 2, device, "lora_merge");
  }
  const int64_t cols_per_block = static_cast<int64_t>(kMergeThreads) * kCols;
  const int64_t grid_x = (a.n + cols_per_block - 1) / cols_per_block;
  require(grid_x <= 0x7FFFFFFF, cat("lora_merge: ", a.n, " columns are more than one launch covers"));
  const int64_t row_blocks = (a.m + kRows - 1) / kRows;
  const dim3 grid(static_cast<unsigned int>(grid_x),
                  static_cast<unsigned int>(std::min<int64_t>(row_blocks, kMaxGridY)));
  auto* s = reinterpret_cast<cudaStream_t>(stream);
  if (a.factors == MergeFactors::kFp32) {
    lora_merge_kernel<MergeFactors::kFp32><<<grid, kMergeThreads, 0, s>>>(a);
  } else {
    lora_merge_kernel<MergeFactors::kBf16><<<grid, kMergeThreads, 0, s>>>(a);
  }
  COLOMEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace colomem
