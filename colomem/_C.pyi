"""Type stub of colomem's compiled core (pinned host pool, chunked copy engine, CUDA-IPC buffers, bridge
sockets, checksums). Pointers, sizes and stream handles are Python ints; the core never links libtorch.

tests/test_c_stub.py checks that this file names exactly what the built module has.
"""
from __future__ import annotations

import collections.abc
import typing


class ColomemError(RuntimeError): ...
class InvalidArgumentError(ColomemError, ValueError): ...
class PoolExhaustedError(ColomemError, MemoryError): ...
class DoubleReleaseError(ColomemError): ...
class PoolClosedError(ColomemError): ...
class PoolBusyError(ColomemError): ...
class TransferTimeoutError(ColomemError, TimeoutError): ...
class NotAvailableError(ColomemError): ...
class CudaError(ColomemError):
    status: int
    status_name: str
class CudaOutOfMemoryError(CudaError, MemoryError): ...
class PeerError(ColomemError): ...

__all__: list[str] = ['ColomemError', 'CopyEngine', 'CudaError', 'CudaOutOfMemoryError', 'DoubleReleaseError', 'ExportableBuffer', 'HostPool', 'ImportedBuffer', 'InvalidArgumentError', 'IpcBuffer', 'MappedRange', 'NotAvailableError', 'PeerError', 'PoolBusyError', 'PoolClosedError', 'PoolExhaustedError', 'Transfer', 'TransferTimeoutError', 'UnixConnection', 'UnixServer', 'build_info', 'checksum', 'checksum_buffer', 'checksum_into', 'checksum_many_into', 'copy_ranges', 'device_by_uuid', 'device_count', 'device_uuid', 'ipc_granularity', 'pin_range', 'store_words', 'unpin_range']
class HostPool:
    """
    Pinned (or plain) host memory, sub-allocated.
    """
    def __init__(self, initial_bytes: int = 0, max_bytes: int = 0, segment_bytes: int = 1073741824, pin: bool = True, huge_pages: bool = True, prefault_threads: int = 0, alignment: int = 4096, populate: bool = False) -> None:
        ...
    def alloc(self, nbytes: int) -> tuple[int, int, int]:
        """
        Returns (block_id, address, rounded size). InvalidArgumentError above 64 GiB (the largest block) or where rounding to the alignment would overflow; PoolExhaustedError at the cap.
        """
    def close(self, force: bool = False) -> None:
        ...
    def free(self, block_id: int) -> None:
        ...
    def reserve(self, nbytes: int) -> None:
        """
        Grows the pool so one block of nbytes fits. InvalidArgumentError above 64 GiB, the largest block.
        """
    def stats(self) -> dict:
        ...
    @property
    def alignment(self) -> int:
        ...
    @property
    def closed(self) -> bool:
        ...
    @property
    def pinned(self) -> bool:
        ...
class Transfer:
    """
    An in-flight submission of copies.
    """
    def completed_copies(self) -> int:
        ...
    def done(self) -> bool:
        ...
    def elapsed_ms(self) -> float:
        ...
    def span_ms(self, others: collections.abc.Sequence[Transfer]) -> float:
        """
        Device ms from the earliest start to the latest end of this and `others` (timed, finished).
        """
    def wait(self, timeout_s: float) -> None:
        """
        Blocks until done; TransferTimeoutError after timeout_s seconds (the copies keep running: wait again). inf (or 1e9 s and more) waits without bound; NaN or negative: InvalidArgumentError. In a fork() child of the process that made a host engine: NotAvailableError.
        """
    @property
    def direction(self) -> str:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def nchunks(self) -> int:
        ...
    @property
    def ncopies(self) -> int:
        ...
class CopyEngine:
    """
    Chunked async copies; one stream per direction.
    """
    def __init__(self, device: int, chunk_bytes: int = 67108864, small_copy_bytes: int = 1048576, failure_wait_s: float = 30.0) -> None:
        """
        failure_wait_s: how long a submit() that failed after queueing some copies waits for them before it raises (inf: no bound). Past it, the error carries .transfer, done once those copies are: keep their memory until then.
        """
    def stream(self, arg0: str) -> int:
        ...
    def submit(self, direction: str, copies: collections.abc.Sequence[tuple[int, int, int]], wait_stream: int = 0, signal_stream: int = 0, timing: bool = False) -> Transfer:
        """
        copies: list of (dst_address, src_address, nbytes). The engine stream first waits for work queued on wait_stream; signal_stream waits for completion. A failure after some copies were queued is raised once those finished; if they still ran after failure_wait_s, the error's .transfer is done when they are (until then their memory must stay allocated).
        """
    @property
    def chunk_bytes(self) -> int:
        ...
    @property
    def device(self) -> int:
        ...
class MappedRange:
    """
    Memory mapped chunk by chunk inside one reserved address range (CUDA VMM on a GPU, anonymous mappings on the host): unmapped chunks give their memory back and keep their addresses. Reading an unmapped chunk faults.
    """
    def __init__(self, device: int, nbytes: int, chunk_bytes: int) -> None:
        """
        device -1: host memory. chunk_bytes is rounded up to the mapping granularity; nothing is mapped yet.
        """
    @staticmethod
    def attach(device: int, address: int, nbytes: int, chunk_bytes: int) -> MappedRange:
        """
        A range laid over [address, address + nbytes), addresses another allocator reserved and keeps, with nothing mapped there now (its owner took its own mapping down first). address and nbytes are multiples of the mapping granularity (the driver's smallest on a GPU, the page size on the host). Its chunks map and unmap as any range's; close() unmaps them and leaves the addresses reserved to their owner.
        """
    def chunk_offset(self, i: int) -> int:
        ...
    def chunk_size(self, i: int) -> int:
        ...
    def close(self, timeout_s: float = 60.0) -> None:
        """
        Waits up to timeout_s (inf: no bound) for the work queued on the device, then unmaps every chunk and frees the addresses (an attached range leaves them reserved to their owner). TransferTimeoutError if that work still runs (nothing changed: close again). Idempotent.
        """
    def is_mapped(self, i: int) -> bool:
        ...
    def map(self, first: int, count: int) -> int:
        """
        Maps the unmapped chunks of [first, first + count); returns how many. On failure (out of memory) the chunks this call mapped are unmapped again before the error is raised.
        """
    def unmap(self, first: int, count: int) -> int:
        """
        Unmaps the mapped chunks of [first, first + count); returns how many. Does not wait for the device: nothing queued may still use them.
        """
    @property
    def chunk_bytes(self) -> int:
        ...
    @property
    def closed(self) -> bool:
        ...
    @property
    def device(self) -> int:
        ...
    @property
    def granularity(self) -> int:
        ...
    @property
    def mapped_bytes(self) -> int:
        ...
    @property
    def mapped_chunks(self) -> int:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def nchunks(self) -> int:
        ...
    @property
    def owns_addresses(self) -> bool:
        ...
    @property
    def ptr(self) -> int:
        ...
    @property
    def reserved_bytes(self) -> int:
        ...
class UnixConnection:
    """
    A connected bridge socket: framed byte messages plus file descriptors, same-uid peers only.
    """
    @staticmethod
    def connect(path: str, timeout: float = 30.0, peer_role: str = 'exporter') -> UnixConnection:
        """
        Connect to a UnixServer. PeerError if nobody listens or the server belongs to another user.
        """
    def close(self) -> None:
        ...
    def recv(self, timeout: float = 30.0) -> tuple[bytes, typing.Any]:
        """
        Receive one message -> (bytes, [fd, ...]); the caller owns the fds. TransferTimeoutError if none arrived in time, including while another thread held the connection that long (the connection stays usable); PeerError if the peer hung up or died.
        """
    def send(self, data: bytes, fds: collections.abc.Sequence[int] = [], timeout: float = 30.0) -> None:
        """
        Send one message; fds are borrowed (the peer gets duplicates). Threads sharing the connection take turns; waiting for the turn counts against timeout.
        """
    @property
    def closed(self) -> bool:
        ...
    @property
    def peer_pid(self) -> int:
        ...
    @property
    def peer_role(self) -> str:
        ...
    @property
    def peer_uid(self) -> int:
        ...
class UnixServer:
    """
    A listening bridge socket in a fresh 0700 directory (socket mode 0600) that also holds owner.pid, this process's pid (a later bridge removes the directory once that process is gone).
    """
    def __init__(self, dir: str = '', name: str = 'bridge.sock') -> None:
        ...
    def accept(self, timeout: float = 30.0, peer_role: str = 'importer') -> UnixConnection:
        """
        Wait for one connection. TransferTimeoutError if none; PeerError for a peer of another user, or when no file descriptor was left for it within timeout (it sleeps between tries, never spins).
        """
    def close(self) -> None:
        ...
    @property
    def closed(self) -> bool:
        ...
    @property
    def path(self) -> str:
        ...
class IpcBuffer:
    """
    A VMM device buffer mapped in this process.
    """
    def close(self, timeout_s: float = 60.0) -> None:
        """
        Waits up to timeout_s (inf: no bound) for the work queued on the device before the call, then unmaps and releases this process's share. TransferTimeoutError if that work still runs: the buffer stays mapped and usable, close again. Idempotent.
        """
    @property
    def closed(self) -> bool:
        ...
    @property
    def device(self) -> int:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def ptr(self) -> int:
        ...
    @property
    def uuid(self) -> str:
        ...
class ExportableBuffer(IpcBuffer):
    """
    Device memory another process can map (cuMemCreate, POSIX-fd handle).
    """
    def __init__(self, device: int, nbytes: int) -> None:
        ...
    def export_fd(self) -> int:
        """
        A new fd for the allocation; the caller owns it (send it, then os.close it).
        """
    @property
    def requested_nbytes(self) -> int:
        ...
class ImportedBuffer(IpcBuffer):
    """
    Another process's ExportableBuffer, mapped here.
    """
    def __init__(self, fd: int, nbytes: int, device: int) -> None:
        """
        fd stays owned by the caller; nbytes is the exporter's nbytes.
        """
def build_info() -> dict:
    """
    How this module was built, and what it sees at run time.
    """
def checksum(ptr: int, nbytes: int, stride_words: int = 1, stream: int = 0, device: int = -1, timeout_s: float = 60.0) -> int:
    """
    64-bit order-dependent checksum of [ptr, ptr+nbytes). stride_words=1 reads every 8-byte word, N every N-th plus the last word and the tail. device=-1: host memory; else device memory on that GPU, computed on `stream`, waiting up to timeout_s (inf: no bound) for that stream only: TransferTimeoutError after that (nothing is left waiting; retry). NaN or negative timeout_s: InvalidArgumentError.
    """
def checksum_buffer(data: typing.Any, stride_words: int = 1) -> int:
    """
    The checksum of a bytes-like object (host memory).
    """
def checksum_many_into(descs: int, n: int, out: int, stream: int, device: int, host_out: int = 0) -> None:
    """
    The checksums of n windows at once. descs: the address of n * 3 uint64 (a window's address, nbytes, stride_words), page-locked host memory for a GPU (the kernels read it: keep it unchanged until the stream passed them). device=-1: host memory, computed now into the n words at host_out (out unused). Else asynchronous on `stream` of that GPU, three launches in all: the values land at device address `out` (n words) and at host_out (page-locked) too when it is not 0.
    """
def checksum_into(ptr: int, nbytes: int, stride_words: int, out: int, stream: int, device: int, host_out: int = 0) -> None:
    """
    Asynchronous GPU checksum: the value (uint64) lands at device address `out` in stream order, and at `host_out` (page-locked host memory, e.g. a pinned tensor's data_ptr()) too when it is not 0: stored by the kernel, so reading it back never queues behind a copy in flight on a copy engine.
    """

def exponential_rows(q: int, row_stride: int, n_q_rows: int, vocab: int, meta: int, n: int, stream: int = 0,
                     device: int = -1) -> None:
    """
    Exponential noise (-log u, u in (0, 1) from Philox4x32-10 keyed by a seed, counted by an offset and the
    column) into n rows of the float32 matrix at q: meta holds 3 * n int64, the rows, their seeds, their
    offsets. device=-1: host memory; else device memory on that GPU, one launch on `stream`, asynchronous.
    """
def lora_merge(w: int, ws0: int, ws1: int, p: int, ps0: int, ps1: int, q: int, qs0: int, qs1: int, out: int,
               os0: int, os1: int, m: int, n: int, r: int, scale: float, factors: int = 0, stream: int = 0,
               device: int = -1) -> None:
    """
    out = bf16(w + scale * p @ q) with one rounding: w and out bf16 m x n, p m x r and q r x n (bf16 with
    factors=0, fp32 with factors=1), each an address and two element strides; out may be w. The product is
    summed in fp32 (fused multiply-adds, k ascending) and added to the weight in fp32. device=-1: host memory;
    else device memory on that GPU, one launch on `stream`, asynchronous, bit for bit the host's result.
    """
def copy_ranges(ops: int, count: int, dst_base: int = 0, src_base: int = 0, stream: int = 0, device: int = -1) -> None:
    """
    Copies `count` ranges, int64 triples (dst, src, nbytes) at host address `ops`, each address plus its base; destinations must not overlap (the copies may run concurrently). device >= 0: enqueued on `stream` (batched); device=-1: host memcpy now.
    """
def device_by_uuid(uuid: str) -> int:
    """
    This process's ordinal of the GPU with that UUID; NotAvailableError if it is not visible here.
    """
def device_count() -> int:
    """
    Visible CUDA devices (0 in the host-only build or without a driver).
    """
def device_uuid(device: int) -> str:
    """
    The GPU's UUID, 'GPU-xxxxxxxx-...'.
    """
def ipc_granularity(device: int) -> int:
    """
    VMM allocation granularity (bytes).
    """
def pin_range(address: int, nbytes: int) -> None:
    ...
def store_words(src: int, n_words: int, host_out: int, stream: int, device: int) -> None:
    """
    Copies n_words 8-byte words of device memory at `src` to page-locked host memory at `host_out` by a kernel on `stream` (asynchronous): a small result read back without a copy engine, so it does not queue behind a long copy in flight. At most 2**20 words.
    """
def unpin_range(address: int) -> None:
    ...
def pointer_is_mapped(ptr: int) -> bool:
    """
    True when the driver knows `ptr` as mapped device memory (False for an address it does not know). CudaError for other driver failures; NotAvailableError in the host-only build or without a driver.
    """
