// Bindings for MappedRange (core/mapped_range.h): memory mapped chunk by chunk at fixed addresses. Addresses
// are Python ints; calls that map, unmap or wait drop the GIL.
#include <pybind11/pybind11.h>

#include <memory>

#include "core/mapped_range.h"

namespace py = pybind11;
using namespace colomem;

void register_mapped(py::module_& m) {
  py::class_<MappedRange, std::shared_ptr<MappedRange>>(
      m, "MappedRange",
      "Memory mapped chunk by chunk inside one reserved address range (CUDA VMM on a GPU, anonymous mappings on "
      "the host): unmapped chunks give their memory back and keep their addresses. Reading an unmapped chunk "
      "faults.")
      .def(py::init([](int device, size_t nbytes, size_t chunk_bytes) {
             py::gil_scoped_release nogil;
             return make_mapped_range(device, nbytes, chunk_bytes);
           }),
           py::arg("device"), py::arg("nbytes"), py::arg("chunk_bytes"),
           "device -1: host memory. chunk_bytes is rounded up to the mapping granularity; nothing is mapped yet.")
      .def_static(
          "attach",
          [](int device, uintptr_t address, size_t nbytes, size_t chunk_bytes) {
            py::gil_scoped_release nogil;
            return attach_mapped_range(device, address, nbytes, chunk_bytes);
          },
          py::arg("device"), py::arg("address"), py::arg("nbytes"), py::arg("chunk_bytes"),
          "A range laid over [address, address + nbytes), addresses another allocator reserved and keeps, with "
          "nothing mapped there now (its owner took its own mapping down first). address and nbytes are multiples "
          "of the mapping granularity (the driver's smallest on a GPU, the page size on the host). Its chunks map "
          "and unmap as any range's; close() unmaps them and leaves the addresses reserved to their owner.")
      .def_property_readonly("ptr", &MappedRange::ptr)
      .def_property_readonly("nbytes", &MappedRange::nbytes)
      .def_property_readonly("chunk_bytes", &MappedRange::chunk_bytes)
      .def_property_readonly("nchunks", &MappedRange::nchunks)
      .def_property_readonly("reserved_bytes", &MappedRange::reserved_bytes)
      .def_property_readonly("granularity", &MappedRange::granularity)
      .def_property_readonly("device", &MappedRange::device)
      .def_property_readonly("mapped_chunks", &MappedRange::mapped_chunks)
      .def_property_readonly("mapped_bytes", &MappedRange::mapped_bytes)
      .def_property_readonly("closed", &MappedRange::closed)
      .def_property_readonly("owns_addresses", &MappedRange::owns_addresses)
      .def("chunk_offset", &MappedRange::chunk_offset, py::arg("i"))
      .def("chunk_size", &MappedRange::chunk_size, py::arg("i"))
      .def("is_mapped", &MappedRange::is_mapped, py::arg("i"))
      .def("map", &MappedRange::map, py::arg("first"), py::arg("count"), py::call_guard<py::gil_scoped_release>(),
           "Maps the unmapped chunks of [first, first + count); returns how many. On failure (out of memory) "
           "the chunks this call mapped are unmapped again before the error is raised.")
      .def("unmap", &MappedRange::unmap, py::arg("first"), py::arg("count"), py::call_guard<py::gil_scoped_release>(),
           "Unmaps the mapped chunks of [first, first + count); returns how many. Does not wait for the device: "
           "nothing queued may still use them.")
      .def("close", &MappedRange::close, py::arg("timeout_s") = MappedRange::kCloseWaitS,
           py::call_guard<py::gil_scoped_release>(),
           "Waits up to timeout_s (inf: no bound) for the work queued on the device, then unmaps every chunk and "
           "frees the addresses (an attached range leaves them reserved to their owner). TransferTimeoutError if "
           "that work still runs (nothing changed: close again). Idempotent.");
}
