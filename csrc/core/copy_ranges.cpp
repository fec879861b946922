// copy_ranges: many raw copies in one call (host memcpy here, CUDA in cuda/batch_copy.cpp).
#include <cstring>

#include "core/copy_engine.h"
#include "core/errors.h"

namespace colomem {

void copy_ranges(uintptr_t ops, size_t count, uintptr_t dst_base, uintptr_t src_base, uintptr_t stream,
                 int device) {
  require(ops != 0 || count == 0, "copy_ranges: null ops array");
  const int64_t* t = reinterpret_cast<const int64_t*>(ops);
  std::vector<CopyOp> list;
  list.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    int64_t d = t[3 * i], s = t[3 * i + 1], n = t[3 * i + 2];
    require(n >= 0 && d >= 0 && s >= 0, cat("copy_ranges: range ", i, " has a negative field"));
    if (n == 0) continue;
    // Every address sum is checked: a base plus an offset near 2^63 must not wrap around to memory the
    // caller never named (the callers bound their offsets, this is the last line).
    uintptr_t dst = 0, src = 0, dst_end = 0, src_end = 0;
    bool wraps = __builtin_add_overflow(dst_base, static_cast<uintptr_t>(d), &dst) ||
                 __builtin_add_overflow(src_base, static_cast<uintptr_t>(s), &src) ||
                 __builtin_add_overflow(dst, static_cast<uintptr_t>(n), &dst_end) ||
                 __builtin_add_overflow(src, static_cast<uintptr_t>(n), &src_end);
    require(!wraps, cat("copy_ranges: range ", i, " (", d, ", ", s, ", ", n,
                        " bytes) runs past the end of the address space; the ranges are corrupt"));
    require(dst != 0 && src != 0, cat("copy_ranges: range ", i, " has a null address"));
    list.push_back({dst, src, static_cast<size_t>(n)});
  }
  if (device < 0) {
    for (const auto& op : list)
      std::memmove(reinterpret_cast<void*>(op.dst), reinterpret_cast<const void*>(op.src), op.nbytes);
    return;
  }
  cuda_copy_ranges(list, stream, device);
}

}  // namespace colomem
