// Driver queries about device addresses (vLLM's worker undoing a partial wake). Addresses are Python ints.
#include <pybind11/pybind11.h>

#include "cuda/pointer_query.h"

namespace py = pybind11;

void register_pointer(py::module_& m) {
  m.def("pointer_is_mapped", &colomem::pointer_is_mapped, py::arg("ptr"), py::call_guard<py::gil_scoped_release>(),
        "Whether physical memory is mapped at device address `ptr` (False for an address the driver does not "
        "know). CudaError on another driver failure; NotAvailableError without CUDA.");
}
