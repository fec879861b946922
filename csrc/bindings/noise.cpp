// colomem._C.exponential_rows: the sampling noise of core/seeded_noise.h, on the host or on a GPU.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "core/seeded_noise.h"
#include "cuda/kernels.h"

namespace py = pybind11;
using namespace colomem;

void register_noise(py::module_& m) {
  m.def(
      "exponential_rows",
      [](uintptr_t q, int64_t row_stride, int64_t n_q_rows, int64_t vocab, uintptr_t meta, int64_t n,
         uintptr_t stream, int device) {
        py::gil_scoped_release nogil;
        if (device < 0) {
          const auto* m3 = reinterpret_cast<const int64_t*>(meta);
          host_exponential_rows(reinterpret_cast<float*>(q), row_stride, n_q_rows, vocab, m3, m3 + n, m3 + 2 * n, n);
          return;
        }
        device_exponential_rows(q, row_stride, n_q_rows, vocab, meta, n, stream, device);
      },
      py::arg("q"), py::arg("row_stride"), py::arg("n_q_rows"), py::arg("vocab"), py::arg("meta"), py::arg("n"),
      py::arg("stream") = 0, py::arg("device") = -1,
      "Exponential noise (-log u, u in (0, 1) from Philox4x32-10 keyed by a seed, counted by an offset and the "
      "column) into n rows of the float32 matrix at q: meta holds 3 * n int64, the rows, their seeds, their "
      "offsets. device=-1: host memory (a row outside the matrix raises InvalidArgumentError); else device "
      "memory on that GPU, one launch on `stream`, asynchronous.");
}
