// Bindings for the weight bridge's core: the Unix socket (bytes + fds), the VMM IPC buffers, the checksum
// and GPU selection by UUID. Addresses, fds and stream handles are Python ints; blocking calls drop the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "core/checksum.h"
#include "core/copy_engine.h"  // wait_bound
#include "core/errors.h"
#include "core/unix_socket.h"
#include "cuda/ipc_buffer.h"
#include "cuda/kernels.h"

namespace py = pybind11;
using namespace colomem;

namespace {

void register_socket(py::module_& m) {
  py::class_<UnixConnection, std::shared_ptr<UnixConnection>>(
      m, "UnixConnection",
      "A connected bridge socket: framed byte messages plus file descriptors, same-uid peers only.")
      .def_static(
          "connect",
          [](const std::string& path, double timeout, std::string peer_role) {
            py::gil_scoped_release nogil;
            return std::shared_ptr<UnixConnection>(UnixConnection::connect(path, timeout, std::move(peer_role)));
          },
          py::arg("path"), py::arg("timeout") = 30.0, py::arg("peer_role") = "exporter",
          "Connect to a UnixServer. PeerError if nobody listens or the server belongs to another user.")
      .def(
          "send",
          [](UnixConnection& c, const py::bytes& data, const std::vector<int>& fds, double timeout) {
            std::string payload = data;
            py::gil_scoped_release nogil;
            c.send(payload, fds, timeout);
          },
          py::arg("data"), py::arg("fds") = std::vector<int>{}, py::arg("timeout") = 30.0,
          "Send one message; fds are borrowed (the peer gets duplicates). Threads sharing the connection take "
          "turns; waiting for the turn counts against timeout.")
      .def(
          "recv",
          [](UnixConnection& c, double timeout) {
            SocketMessage msg;
            {
              py::gil_scoped_release nogil;
              msg = c.recv(timeout);
            }
            return py::make_tuple(py::bytes(msg.data), py::cast(msg.fds));
          },
          py::arg("timeout") = 30.0,
          "Receive one message -> (bytes, [fd, ...]); the caller owns the fds. TransferTimeoutError if none "
          "arrived in time, including while another thread held the connection that long (the connection stays "
          "usable); PeerError if the peer hung up or died.")
      .def("close", &UnixConnection::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &UnixConnection::closed)
      .def_property_readonly("peer_pid", &UnixConnection::peer_pid)
      .def_property_readonly("peer_uid", &UnixConnection::peer_uid)
      .def_property_readonly("peer_role", &UnixConnection::peer_role);

  py::class_<UnixServer, std::shared_ptr<UnixServer>>(
      m, "UnixServer",
      "A listening bridge socket in a fresh 0700 directory (socket mode 0600) that also holds owner.pid, this "
      "process's pid (a later bridge removes the directory once that process is gone).")
      .def(py::init<const std::string&, const std::string&>(), py::arg("dir") = "", py::arg("name") = "bridge.sock")
      .def(
          "accept",
          [](UnixServer& s, double timeout, std::string peer_role) {
            py::gil_scoped_release nogil;
            return std::shared_ptr<UnixConnection>(s.accept(timeout, std::move(peer_role)));
          },
          py::arg("timeout") = 30.0, py::arg("peer_role") = "importer",
          "Wait for one connection. TransferTimeoutError if none; PeerError for a peer of another user, or when "
          "no file descriptor was left for it within timeout (it sleeps between tries, never spins).")
      .def_property_readonly("path", &UnixServer::path)
      .def("close", &UnixServer::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &UnixServer::closed);
}

void register_buffers(py::module_& m) {
  py::class_<IpcBuffer, std::shared_ptr<IpcBuffer>>(m, "IpcBuffer", "A VMM device buffer mapped in this process.")
      .def_property_readonly("ptr", &IpcBuffer::ptr)
      .def_property_readonly("nbytes", &IpcBuffer::nbytes)
      .def_property_readonly("device", &IpcBuffer::device)
      .def_property_readonly("uuid", &IpcBuffer::uuid)
      .def_property_readonly("closed", &IpcBuffer::closed)
      .def("close", &IpcBuffer::close, py::arg("timeout_s") = IpcBuffer::kCloseWaitS,
           py::call_guard<py::gil_scoped_release>(),
           "Waits up to timeout_s (inf: no bound) for the work queued on the device before the call, then "
           "unmaps and releases this process's share. TransferTimeoutError if that work still runs: the buffer "
           "stays mapped and usable, close again. Idempotent.");

  py::class_<ExportableBuffer, IpcBuffer, std::shared_ptr<ExportableBuffer>>(
      m, "ExportableBuffer", "Device memory another process can map (cuMemCreate, POSIX-fd handle).")
      .def(py::init([](int device, size_t nbytes) {
             py::gil_scoped_release nogil;
             return std::make_shared<ExportableBuffer>(device, nbytes);
           }),
           py::arg("device"), py::arg("nbytes"))
      .def_property_readonly("requested_nbytes", &ExportableBuffer::requested_nbytes)
      .def("export_fd", &ExportableBuffer::export_fd,
           "A new fd for the allocation; the caller owns it (send it, then os.close it).");

  py::class_<ImportedBuffer, IpcBuffer, std::shared_ptr<ImportedBuffer>>(
      m, "ImportedBuffer", "Another process's ExportableBuffer, mapped here.")
      .def(py::init([](int fd, size_t nbytes, int device) {
             py::gil_scoped_release nogil;
             return std::make_shared<ImportedBuffer>(fd, nbytes, device);
           }),
           py::arg("fd"), py::arg("nbytes"), py::arg("device"),
           "fd stays owned by the caller; nbytes is the exporter's nbytes.");

  m.def("device_uuid", &device_uuid, py::arg("device"), "The GPU's UUID, 'GPU-xxxxxxxx-...'.");
  m.def("device_by_uuid", &device_by_uuid, py::arg("uuid"),
        "This process's ordinal of the GPU with that UUID; NotAvailableError if it is not visible here.");
  m.def("ipc_granularity", &ipc_granularity, py::arg("device"), "VMM allocation granularity (bytes).");
}

void register_checksum(py::module_& m) {
  m.def(
      "checksum",
      [](uintptr_t ptr, size_t nbytes, size_t stride_words, uintptr_t stream, int device,
         double timeout_s) -> uint64_t {
        (void)wait_bound(timeout_s);  // refused the same way on both paths
        py::gil_scoped_release nogil;
        if (device < 0) return host_checksum(reinterpret_cast<const void*>(ptr), nbytes, stride_words);
        return device_checksum(ptr, nbytes, stride_words, stream, device, timeout_s);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("stride_words") = 1, py::arg("stream") = 0, py::arg("device") = -1,
      py::arg("timeout_s") = kChecksumWaitS,
      "64-bit order-dependent checksum of [ptr, ptr+nbytes). stride_words=1 reads every 8-byte word, N every "
      "N-th plus the last word and the tail. device=-1: host memory; else device memory on that GPU, computed "
      "on `stream`, waiting up to timeout_s (inf: no bound) for that stream only: TransferTimeoutError after "
      "that (nothing is left waiting; retry). NaN or negative timeout_s: InvalidArgumentError.");
  m.def(
      "checksum_into",
      [](uintptr_t ptr, size_t nbytes, size_t stride_words, uintptr_t out, uintptr_t stream, int device,
         uintptr_t host_out) {
        py::gil_scoped_release nogil;
        device_checksum_into(ptr, nbytes, stride_words, out, stream, device, host_out);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("stride_words"), py::arg("out"), py::arg("stream"),
      py::arg("device"), py::arg("host_out") = 0,
      "Asynchronous GPU checksum: the value (uint64) lands at device address `out` in stream order, and at "
      "`host_out` (page-locked host memory, e.g. a pinned tensor's data_ptr()) too when it is not 0: stored "
      "by the kernel, so reading it back never queues behind a copy in flight on a copy engine.");
  m.def(
      "checksum_many_into",
      [](uintptr_t descs, size_t n, uintptr_t out, uintptr_t stream, int device, uintptr_t host_out) {
        py::gil_scoped_release nogil;
        if (device < 0) {
          require(host_out != 0 && host_out % 8 == 0,
                  "checksum_many_into on host memory (device=-1) writes its values at `host_out`: pass an 8-byte "
                  "aligned host address of n words");
          host_checksum_many(reinterpret_cast<const uint64_t*>(descs), n, reinterpret_cast<uint64_t*>(host_out));
          return;
        }
        device_checksum_many_into(descs, n, out, stream, device, host_out);
      },
      py::arg("descs"), py::arg("n"), py::arg("out"), py::arg("stream"), py::arg("device"), py::arg("host_out") = 0,
      "The checksums of n windows at once. descs: the address of n * 3 uint64 (a window's address, nbytes, "
      "stride_words), page-locked host memory for a GPU (the kernels read it: keep it unchanged until the "
      "stream passed them). device=-1: host memory, computed now into the n words at host_out (out unused). "
      "Else asynchronous on `stream` of that GPU, three launches in all: the values land at device address "
      "`out` (n words) and at host_out (page-locked) too when it is not 0.");
  m.def(
      "checksum_buffer",
      [](const py::object& obj, size_t stride_words) -> uint64_t {
        Py_buffer view;
        if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();  // contiguous
        struct Release {
          Py_buffer* v;
          ~Release() { PyBuffer_Release(v); }
        } release{&view};
        const void* p = view.buf;
        const size_t n = static_cast<size_t>(view.len);
        py::gil_scoped_release nogil;
        return host_checksum(p, n, stride_words);
      },
      py::arg("data"), py::arg("stride_words") = 1, "The checksum of a bytes-like object (host memory).");
  m.def(
      "store_words",
      [](uintptr_t src, size_t n_words, uintptr_t host_out, uintptr_t stream, int device) {
        py::gil_scoped_release nogil;
        device_store_words(src, n_words, host_out, stream, device);
      },
      py::arg("src"), py::arg("n_words"), py::arg("host_out"), py::arg("stream"), py::arg("device"),
      "Copies n_words 8-byte words of device memory at `src` to page-locked host memory at `host_out` by a "
      "kernel on `stream` (asynchronous): a small result read back without a copy engine, so it does not "
      "queue behind a long copy in flight. At most 2**20 words.");
}

}  // namespace

void register_ipc(py::module_& m) {
  register_socket(m);
  register_buffers(m);
  register_checksum(m);
}
