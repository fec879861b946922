// Python classes for the C++ exceptions, with Python built-ins as second bases where they fit
// (PoolExhaustedError is also a MemoryError, TransferTimeoutError also a TimeoutError, ...).
#include <pybind11/pybind11.h>

#include "bindings/errors.h"

#include "core/errors.h"

namespace py = pybind11;
using namespace colomem;

namespace {

PyObject* g_base = nullptr;
PyObject* g_invalid = nullptr;
PyObject* g_exhausted = nullptr;
PyObject* g_double = nullptr;
PyObject* g_closed = nullptr;
PyObject* g_busy = nullptr;
PyObject* g_timeout = nullptr;
PyObject* g_unavailable = nullptr;
PyObject* g_peer = nullptr;
PyObject* g_cuda = nullptr;
PyObject* g_oom = nullptr;

PyObject* make(py::module_& m, const char* name, std::initializer_list<PyObject*> bases, const char* doc) {
  py::tuple t(bases.size());
  size_t i = 0;
  for (PyObject* b : bases) t[i++] = py::reinterpret_borrow<py::object>(b);
  std::string full = std::string("colomem.errors.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(full.c_str(), doc, t.ptr(), nullptr);
  if (!cls) throw py::error_already_set();
  m.attr(name) = py::reinterpret_borrow<py::object>(cls);  // the module keeps a reference; so do we
  return cls;
}

void raise_cuda(PyObject* cls, const CudaError& e) {
  PyObject* inst = PyObject_CallFunction(cls, "s", e.what());
  if (!inst) return;  // the constructor's own error is already set
  PyObject* status = PyLong_FromLong(e.status());
  PyObject* name = PyUnicode_FromString(e.status_name().c_str());
  PyObject_SetAttrString(inst, "status", status);
  PyObject_SetAttrString(inst, "status_name", name);
  Py_XDECREF(status);
  Py_XDECREF(name);
  PyErr_SetObject(cls, inst);
  Py_DECREF(inst);
}

}  // namespace

void register_errors(py::module_& m) {
  g_base = make(m, "ColomemError", {PyExc_RuntimeError}, "Base class of every error colomem raises on purpose.");
  g_invalid = make(m, "InvalidArgumentError", {g_base, PyExc_ValueError}, "Bad input; nothing was changed.");
  g_exhausted = make(m, "PoolExhaustedError", {g_base, PyExc_MemoryError},
                     "The pinned pool is at its cap; raise max_bytes or release blocks.");
  g_double = make(m, "DoubleReleaseError", {g_base}, "A pool block was released twice or is not from this pool.");
  g_closed = make(m, "PoolClosedError", {g_base}, "Use of a pool, transfer or bridge after it was closed.");
  g_busy = make(m, "PoolBusyError", {g_base}, "close() while blocks still hold data; reload or force.");
  g_timeout = make(m, "TransferTimeoutError", {g_base, PyExc_TimeoutError},
                   "A bounded wait ran out; the operation keeps running, wait again.");
  g_unavailable = make(m, "NotAvailableError", {g_base},
                       "A CUDA-only call in a host-only build, or no CUDA device visible.");
  g_peer = make(m, "PeerError", {g_base}, "An IPC peer died, refused the connection, or sent malformed data.");
  g_cuda = make(m, "CudaError", {g_base}, "A CUDA call failed; .status and .status_name say how.");
  g_oom = make(m, "CudaOutOfMemoryError", {g_cuda, PyExc_MemoryError},
               "CUDA ran out of device memory; free some (offload, lower the KV cache) and retry.");

  py::register_exception_translator([](std::exception_ptr p) {
    if (p) set_python_error(p, /*fallback=*/false);
  });
}

bool set_python_error(std::exception_ptr p, bool fallback) {
  try {
    std::rethrow_exception(p);
  } catch (const CudaOutOfMemory& e) {
    raise_cuda(g_oom, e);
  } catch (const CudaError& e) {
    raise_cuda(g_cuda, e);
  } catch (const InvalidArgument& e) {
    PyErr_SetString(g_invalid, e.what());
  } catch (const PoolExhausted& e) {
    PyErr_SetString(g_exhausted, e.what());
  } catch (const DoubleRelease& e) {
    PyErr_SetString(g_double, e.what());
  } catch (const PoolClosed& e) {
    PyErr_SetString(g_closed, e.what());
  } catch (const PoolBusy& e) {
    PyErr_SetString(g_busy, e.what());
  } catch (const Timeout& e) {
    PyErr_SetString(g_timeout, e.what());
  } catch (const NotAvailable& e) {
    PyErr_SetString(g_unavailable, e.what());
  } catch (const PeerError& e) {
    PyErr_SetString(g_peer, e.what());
  } catch (const Error& e) {
    PyErr_SetString(g_base, e.what());
  } catch (const std::exception& e) {
    if (!fallback) throw;  // pybind11's own translators map the standard exceptions
    PyErr_SetString(g_base, e.what());
  } catch (...) {
    if (!fallback) throw;
    PyErr_SetString(g_base, "unknown C++ exception in the colomem core");
  }
  return true;
}
