#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/host_pool.h"
#include "core/pinning.h"

namespace py = pybind11;
using namespace colomem;

void register_pool(py::module_& m) {
  // Page-lock an existing host range (tests use it to force a CUDA error: registering a range twice).
  m.def("pin_range", [](uintptr_t ptr, size_t nbytes) { pin_range(reinterpret_cast<void*>(ptr), nbytes); },
        py::arg("address"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>());
  m.def("unpin_range", [](uintptr_t ptr) { unpin_range(reinterpret_cast<void*>(ptr)); }, py::arg("address"));
  py::class_<HostPool, std::shared_ptr<HostPool>>(m, "HostPool", "Pinned (or plain) host memory, sub-allocated.")
      .def(py::init([](size_t initial_bytes, size_t max_bytes, size_t segment_bytes, bool pin, bool huge_pages,
                       int prefault_threads, size_t alignment, bool populate) {
             PoolConfig c;
             c.initial_bytes = initial_bytes;
             c.max_bytes = max_bytes;
             c.segment_bytes = segment_bytes;
             c.pin = pin;
             c.huge_pages = huge_pages;
             c.prefault_threads = prefault_threads;
             c.alignment = alignment;
             c.populate = populate;
             py::gil_scoped_release nogil;  // pinning a large pool takes a while
             return std::make_shared<HostPool>(c);
           }),
           py::arg("initial_bytes") = 0, py::arg("max_bytes") = 0, py::arg("segment_bytes") = 1ull << 30,
           py::arg("pin") = true, py::arg("huge_pages") = true, py::arg("prefault_threads") = 0,
           py::arg("alignment") = 4096, py::arg("populate") = false)
      .def(
          "alloc",
          [](HostPool& p, size_t nbytes) {
            BlockInfo b;
            {
              py::gil_scoped_release nogil;
              b = p.alloc(nbytes);
            }
            return py::make_tuple(b.id, b.ptr, b.nbytes);
          },
          py::arg("nbytes"),
          "Returns (block_id, address, rounded size). InvalidArgumentError above 64 GiB (the largest block) or "
          "where rounding to the alignment would overflow; PoolExhaustedError at the cap.")
      .def("free", &HostPool::free, py::arg("block_id"))
      .def("reserve", &HostPool::reserve, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
           "Grows the pool so one block of nbytes fits. InvalidArgumentError above 64 GiB, the largest block.")
      .def("close", &HostPool::close, py::arg("force") = false)
      .def_property_readonly("closed", &HostPool::closed)
      .def_property_readonly("pinned", &HostPool::pinned)
      .def_property_readonly("alignment", [](const HostPool& p) { return p.config().alignment; })
      .def("stats", [](const HostPool& p) {
        PoolStats s = p.stats();
        py::dict d;
        d["reserved_bytes"] = s.reserved_bytes;
        d["in_use_bytes"] = s.in_use_bytes;
        d["peak_in_use_bytes"] = s.peak_in_use_bytes;
        d["free_bytes"] = s.free_bytes;
        d["largest_free_block"] = s.largest_free_block;
        d["segments"] = s.segments;
        d["blocks"] = s.blocks;
        d["allocs"] = s.allocs;
        d["frees"] = s.frees;
        d["map_seconds"] = s.map_seconds;
        d["prefault_seconds"] = s.prefault_seconds;
        d["pin_seconds"] = s.pin_seconds;
        d["pinned"] = s.pinned;
        return d;
      });
}
