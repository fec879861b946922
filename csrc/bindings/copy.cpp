#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/errors.h"
#include "core/copy_engine.h"
#include "core/errors.h"

namespace py = pybind11;
using namespace colomem;

namespace {
Direction parse_direction(const std::string& s) {
  if (s == "d2h") return Direction::D2H;
  if (s == "h2d") return Direction::H2D;
  throw InvalidArgument(cat("direction must be 'd2h' or 'h2d', got '", s, "'"));
}

// A submission that failed with copies still running: the cause's Python class, with the transfer of those
// copies as `.transfer` (the caller keeps their memory until it is done). GIL held.
[[noreturn]] void raise_partial(const PartialSubmission& p) {
  py::object running = py::cast(p.running());
  set_python_error(p.cause(), /*fallback=*/true);
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (value) PyObject_SetAttrString(value, "transfer", running.ptr());
  PyErr_Restore(type, value, tb);
  throw py::error_already_set();
}
}  // namespace

void register_copy(py::module_& m) {
  py::class_<Transfer, std::shared_ptr<Transfer>>(m, "Transfer", "An in-flight submission of copies.")
      .def("done", &Transfer::done, py::call_guard<py::gil_scoped_release>())
      .def("wait", &Transfer::wait, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "Blocks until done; TransferTimeoutError after timeout_s seconds (the copies keep running: wait "
           "again). inf (or 1e9 s and more) waits without bound; NaN or negative: InvalidArgumentError. In a "
           "fork() child of the process that made a host engine: NotAvailableError.")
      .def("completed_copies", &Transfer::completed_copies, py::call_guard<py::gil_scoped_release>())
      .def("elapsed_ms", &Transfer::elapsed_ms)
      .def("span_ms", &Transfer::span_ms, py::arg("others"),
           "Device ms from the earliest start to the latest end of this and `others` (timed, finished).")
      .def_property_readonly("direction", [](const Transfer& t) { return direction_name(t.direction); })
      .def_readonly("nbytes", &Transfer::nbytes)
      .def_readonly("ncopies", &Transfer::ncopies)
      .def_readonly("nchunks", &Transfer::nchunks);

  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "CopyEngine",
                                                      "Chunked async copies; one stream per direction.")
      .def(py::init(&make_copy_engine), py::arg("device"), py::arg("chunk_bytes") = 64ull << 20,
           py::arg("small_copy_bytes") = 1ull << 20, py::arg("failure_wait_s") = kFailedSubmitWaitS,
           "failure_wait_s: how long a submit() that failed after queueing some copies waits for them before "
           "it raises (inf: no bound). Past it, the error carries .transfer, done once those copies are: keep "
           "their memory until then.")
      .def(
          "submit",
          [](CopyEngine& e, const std::string& direction, const std::vector<std::tuple<uintptr_t, uintptr_t, size_t>>& copies,
             uintptr_t wait_stream, uintptr_t signal_stream, bool timing) {
            std::vector<CopyOp> ops;
            ops.reserve(copies.size());
            for (const auto& [dst, src, n] : copies) ops.push_back({dst, src, n});
            Direction d = parse_direction(direction);
            try {
              py::gil_scoped_release nogil;
              return e.submit(d, ops, wait_stream, signal_stream, timing);
            } catch (const PartialSubmission& p) {  // the GIL is back: nogil ended with the try block
              raise_partial(p);
            }
          },
          py::arg("direction"), py::arg("copies"), py::arg("wait_stream") = 0, py::arg("signal_stream") = 0,
          py::arg("timing") = false,
          "copies: list of (dst_address, src_address, nbytes). The engine stream first waits for work queued on "
          "wait_stream; signal_stream waits for completion. A failure after some copies were queued is raised "
          "once those finished; if they still ran after failure_wait_s, the error's .transfer is done when they "
          "are (until then their memory must stay allocated).")
      .def_property_readonly("device", &CopyEngine::device)
      .def_property_readonly("chunk_bytes", &CopyEngine::chunk_bytes)
      .def("stream", [](const CopyEngine& e, const std::string& d) { return e.stream(parse_direction(d)); });

  m.def(
      "copy_ranges",
      [](uintptr_t ops, size_t count, uintptr_t dst_base, uintptr_t src_base, uintptr_t stream, int device) {
        py::gil_scoped_release nogil;
        copy_ranges(ops, count, dst_base, src_base, stream, device);
      },
      py::arg("ops"), py::arg("count"), py::arg("dst_base") = 0, py::arg("src_base") = 0, py::arg("stream") = 0,
      py::arg("device") = -1,
      "Copies `count` ranges, int64 triples (dst, src, nbytes) at host address `ops`, each address plus its "
      "base; destinations must not overlap (the copies may run concurrently). device >= 0: enqueued on "
      "`stream` (batched); device=-1: host memcpy now.");
}
