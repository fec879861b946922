// The LoRA merge of core/lora_merge.h on a GPU: one launch a layer, the weight read once and written once.
// Each block covers kRows rows and kCols * blockDim.x columns; a thread holds kRows x kCols fp32 sums, its
// columns blockDim.x apart so that a warp's loads and stores of the weight are contiguous. The factors are
// small (r rows or columns) and stay in the caches.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/errors.h"
#include "core/lora_merge.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace colomem {

namespace {

constexpr int kMergeThreads = 256;
constexpr int kRows = 8;
constexpr int kCols = 4;
constexpr unsigned int kMaxGridY = 65535;

__global__ void lora_merge_kernel(LoraMergeArgs a) {
  using namespace merge_detail;
  const auto* w = reinterpret_cast<const uint16_t*>(a.w);
  auto* out = reinterpret_cast<uint16_t*>(a.out);
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * blockDim.x * kCols + threadIdx.x;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows; row0 < a.m;
       row0 += static_cast<int64_t>(gridDim.y) * kRows) {
    float acc[kRows][kCols];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[i][c] = 0.0f;
    for (int64_t k = 0; k < a.r; ++k) {  // k ascending, as the host version sums
      float qv[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int64_t j = col0 + static_cast<int64_t>(c) * blockDim.x;
        qv[c] = j < a.n ? factor(a.q, k * a.qs0 + j * a.qs1, a.factors) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int64_t row = row0 + i;
        if (row >= a.m) break;
        const float pv = factor(a.p, row * a.ps0 + k * a.ps1, a.factors);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[i][c] = fma_rn(pv, qv[c], acc[i][c]);
      }
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int64_t row = row0 + i;
      if (row >= a.m) break;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int64_t j = col0 + static_cast<int64_t>(c) * blockDim.x;
        if (j >= a.n) continue;
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
  lora_merge_kernel<<<grid, kMergeThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(a);
  COLOMEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace colomem
