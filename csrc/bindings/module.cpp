// colomem._C: one module, one registration function per topic.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_errors(py::module_& m);
void register_info(py::module_& m);
void register_pool(py::module_& m);
void register_copy(py::module_& m);
void register_pointer(py::module_& m);
void register_noise(py::module_& m);
void register_merge(py::module_& m);
void register_mapped(py::module_& m);
// Weak until bindings/ipc.cpp lands, so the core builds on its own.
__attribute__((weak)) void register_ipc(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "colomem core: pinned host pool, chunked copy engine, CUDA-IPC buffers, mapped ranges, sampling noise "
            "(no libtorch inside)";
  register_errors(m);  // first: the other topics' bindings raise these
  register_info(m);
  register_pool(m);
  register_copy(m);
  register_pointer(m);
  register_noise(m);
  register_merge(m);
  register_mapped(m);
  if (register_ipc) register_ipc(m);
}
