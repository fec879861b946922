// colomem._C.lora_merge: the LoRA merge of core/lora_merge.h, on the host or on a GPU.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "core/lora_merge.h"
#include "cuda/kernels.h"

namespace py = pybind11;
using namespace colomem;

void register_merge(py::module_& m) {
  m.def(
      "lora_merge",
      [](uintptr_t w, int64_t ws0, int64_t ws1, uintptr_t p, int64_t ps0, int64_t ps1, uintptr_t q, int64_t qs0,
         int64_t qs1, uintptr_t out, int64_t os0, int64_t os1, int64_t m, int64_t n, int64_t r, float scale,
         int factors, uintptr_t stream, int device) {
        LoraMergeArgs a;
        a.w = w, a.ws0 = ws0, a.ws1 = ws1, a.p = p, a.ps0 = ps0, a.ps1 = ps1, a.q = q, a.qs0 = qs0, a.qs1 = qs1;
        a.out = out, a.os0 = os0, a.os1 = os1, a.m = m, a.n = n, a.r = r, a.scale = scale;
        a.factors = static_cast<MergeFactors>(factors);
        py::gil_scoped_release nogil;
        if (device < 0)
          host_lora_merge(a);
        else
          device_lora_merge(a, stream, device);
      },
      py::arg("w"), py::arg("ws0"), py::arg("ws1"), py::arg("p"), py::arg("ps0"), py::arg("ps1"), py::arg("q"),
      py::arg("qs0"), py::arg("qs1"), py::arg("out"), py::arg("os0"), py::arg("os1"), py::arg("m"), py::arg("n"),
      py::arg("r"), py::arg("scale"), py::arg("factors") = 0, py::arg("stream") = 0, py::arg("device") = -1,
      "out = bf16(w + scale * p @ q) with one rounding: w and out bf16 m x n, p m x r and q r x n (bf16 with "
      "factors=0, fp32 with factors=1), each an address and two element strides; out may be w. The product is "
      "summed in fp32 (fused multiply-adds, k ascending) and added to the weight in fp32. device=-1: host "
      "memory; else device memory on that GPU, one launch on `stream`, asynchronous, bit for bit the host's "
      "result.");
}
