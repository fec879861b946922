#include <pybind11/pybind11.h>

#include "core/pinning.h"
#ifdef COLOMEM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;

#ifndef COLOMEM_VERSION
#define COLOMEM_VERSION "unknown"
#endif

void register_info(py::module_& m) {
  m.def("build_info", [] {
    py::dict d;
    d["version"] = COLOMEM_VERSION;
    d["sanitizers"] = COLOMEM_SANITIZERS;
#ifdef COLOMEM_WITH_CUDA
    d["cuda"] = true;
    d["cuda_version"] = CUDART_VERSION;
    d["cuda_archs"] = COLOMEM_CUDA_ARCHS;
    int driver = 0;
    d["driver_version"] = cudaDriverGetVersion(&driver) == cudaSuccess ? driver : 0;
#else
    d["cuda"] = false;
    d["cuda_version"] = 0;
    d["cuda_archs"] = "";
    d["driver_version"] = 0;
#endif
    d["device_count"] = colomem::visible_device_count();
    return d;
  }, "How this module was built, and what it sees at run time.");
  m.def("device_count", &colomem::visible_device_count,
        "Visible CUDA devices (0 in the host-only build or without a driver).");
}
