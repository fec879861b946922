"""MappedSet: tensors moved into memory colomem maps itself, offloaded and reloaded one chunk at a time.

A SwapSet moves storages the caching allocator owns: each comes back as one allocation, grown whole before
its first byte is copied, and leaves whole once its copy ended. Here the tensors are copied once into a
MappedMemory (colomem/mapped.py) and live there from then on: an offload frees each chunk (cuMemUnmap +
cuMemRelease) as soon as its copy out ended, while later chunks still copy; a reload maps each chunk right
before its copy back, the next chunk's mapping behind the copy before it; and a reload may stop at a byte
budget, so part of a tensor comes back early (behind the forward and backward, as far as the memory left
beside them allows) and the rest later (at the optimizer's step).

Each chunk is either on the device (mapped, its bytes authoritative) or in the pool (its bytes in its pool
block; unmapped once nothing queued touches it). A copy that fails leaves its chunk where its bytes are still
whole, so after any error the set is a mix of the two that a later offload or reload completes. The memory is
outside torch's caching allocator: torch's memory figures do not count it (`resident_bytes` does).

The tensors must not be read or written while any chunk is in the pool: a kernel that touches an unmapped
chunk faults. The owner (the trainer) reloads in full before the optimizer reads its state.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Optional, Sequence

import torch

from colomem import _torch
from colomem.errors import ColomemError, CudaOutOfMemoryError, DeviceMismatchError, InvalidArgumentError
from colomem.mapped import CHUNK_BYTES_DEFAULT, MappedMemory, layout
from colomem.pool import Block, PinnedPool, default_pool
from colomem.swap_coalesce import Transfers, _done, _settle
from colomem.swap_handles import DEFAULT_TIMEOUT_S
from colomem.swap_mapped_handle import DEVICE, POOL, MappedHandle, MappedStats
from colomem.units import format_bytes

class MappedSet:
    """Tensors (name, tensor) on one device, copied into one MappedMemory at construction; `tensors` holds
    the new tensors in the same order, same dtypes and shapes, for the caller to use in place of the old
    ones (which it then drops). The copy runs on the current stream."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]], pool: Optional[PinnedPool] = None, *,
                 name: str = "mapped", chunk_bytes: int = CHUNK_BYTES_DEFAULT, _on_device: bool = True):
        items = list(tensors)
        if not items:
            raise InvalidArgumentError(f"MappedSet {name!r} needs at least one tensor")
        device = items[0][1].device
        for n, t in items:
            if t.device != device:
                raise DeviceMismatchError(f"MappedSet {name!r}: {n} is on {t.device}, the others on {device}")
        self.name = name
        self.names = [n for n, _ in items]
        self.device = device
        self._pool = pool if pool is not None else default_pool()
        self.offsets, total = layout([t.numel() * t.element_size() for _, t in items])
        self.memory = MappedMemory(total, device, chunk_bytes)
        if _on_device:
            self.memory.map()
        self.tensors: list[torch.Tensor] = []
        for (_, t), off in zip(items, self.offsets):
            if _on_device:
                new = self.memory.tensor_at(off, t)
                new.copy_(t)
            else:
                # torch asks the driver which device a pointer is on when it wraps it (cudaPointerGetAttributes),
                # which an unmapped address cannot answer: the tensor's first chunk is mapped while it is made
                first = off // self.memory.range.chunk_bytes
                self.memory.map(first, 1)
                try:
                    new = self.memory.tensor_at(off, t)
                finally:
                    self.memory.unmap(first, 1)
            self.tensors.append(new)
        self._where = [DEVICE if _on_device else POOL] * self.memory.nchunks
        # One pool block per tensor (as a SwapSet has one per storage): a chunk's copy has a piece for each
        # tensor it holds part of, and an offloaded tensor has a host view (a checkpoint reads it there)
        self._sizes = [t.numel() * t.element_size() for _, t in items]
        self._blocks: list[Optional[Block]] = [None] * len(items)
        self._pending: Optional[MappedHandle] = None
        self._broken = ""  # why the set's bytes are not whole (a failed moving_out): nothing can come back
        self._writing: dict[int, object] = {}  # chunk -> a failed reload's copy that may still write it
        self._lock = threading.RLock()

    @classmethod
    def moving_out(cls, tensors: Iterable[tuple[str, torch.Tensor]], pool: Optional[PinnedPool] = None, *,
                   name: str = "mapped", chunk_bytes: int = CHUNK_BYTES_DEFAULT,
                   timing: bool = False) -> tuple["MappedSet", MappedHandle]:
        """A set made offloaded, without mapping anything: the tensors' bytes copy from where they are straight
        into the set's pool blocks (after the current stream's work), so moving them into mapped memory costs
        no GPU memory beyond theirs. The set's `tensors` view the unmapped range: put them in place of the old
        ones only once the handle's wait() returned; the old ones may go then. If the copy fails, the set
        cannot be reloaded (the old tensors still hold the bytes): close it."""
        items = list(tensors)
        for n, t in items:
            if not t.is_contiguous():
                raise InvalidArgumentError(f"MappedSet {name!r}: {n} is not contiguous; its bytes cannot be copied "
                                           "out as they lie")
        s = cls(items, pool, name=name, chunk_bytes=chunk_bytes, _on_device=False)

        def failed(exc: BaseException, idle: bool) -> None:
            s._broken = f"its first copy out failed ({exc})"
            if idle:
                s.close()  # nothing of it runs any more: its pool blocks go back

        sources = [t.data_ptr() for _, t in items]

        def copies(i: int) -> list:  # from where the tensors are now into their blocks
            return [(s._blocks_address(j) + at, sources[j] + at, n) for j, at, n in s._pieces(i)]

        with s._lock:
            h = s._copy_out("move out", list(range(s.memory.nchunks)), copies, timing, failed)
            h.filling = True
            return s, h

    # -- where the bytes are ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.memory.range.reserved_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes of the chunks whose bytes are on the device (a reload in flight counts once it was waited for)."""
        return sum(self.memory.chunk_span(i)[1] for i, w in enumerate(self._where) if w == DEVICE)

    @property
    def resident(self) -> bool:
        """Every chunk on the device and nothing in flight: the tensors may be used."""
        return self._pending is None and all(w == DEVICE for w in self._where)

    @property
    def pending(self) -> Optional[MappedHandle]:
        return self._pending

    # -- moving ----------------------------------------------------------------------------------------------
    def offload(self, *, timing: bool = False) -> MappedHandle:
        """Queues the copy out of every chunk on the device, each after the current stream's work (the copies
        read what it wrote); the handle's wait() unmaps each chunk as its copy ends. A transfer still in
        flight is finished first."""
        with self._lock:
            self._finish_pending()
            t0 = time.perf_counter()
            for i, w in enumerate(self._where):
                if w == POOL:  # mapped but not filled by a reload that failed
                    self._unmap_when_quiet(i)
            chunks = [i for i, w in enumerate(self._where) if w == DEVICE]

            def copies(i: int) -> list:
                return [(self._blocks_address(j) + at, self._device_address(j) + at, n) for j, at, n in self._pieces(i)]

            return self._copy_out("offload", chunks, copies, timing, lambda exc, idle: None, t0)

    def _copy_out(self, what: str, chunks: list[int], copies: Callable[[int], list], timing: bool,
                  failed: Callable[[BaseException, bool], None], t0: Optional[float] = None) -> MappedHandle:
        """One D2H submission per chunk (its `copies`), each after the current stream's work; -> the handle.
        A failed submission is abandoned (_abandon), `failed(exc, nothing still running)` told, and raised."""
        t0 = time.perf_counter() if t0 is None else t0
        cur = _torch.stream_handle(self.device)
        eng = _torch.engine_for(self.device)
        token = self._begin(what, chunks)
        parts: list = []
        try:
            for i in chunks:
                parts.append(eng.submit("d2h", copies(i), wait_stream=cur, timing=timing))
        except BaseException as exc:
            failed(exc, self._abandon(parts, token, exc))
            raise
        return self._start("d2h", chunks, parts, token, t0, 0.0, timing)

    def reload(self, budget_bytes: Optional[int] = None, *, ordered: bool = True, timing: bool = False,
               up_to_room: bool = False) -> MappedHandle:
        """Maps the chunks in the pool, in order, and queues each one's copy back as soon as it is mapped (the
        next one is mapped behind it), stopping before the chunks brought back would pass `budget_bytes`
        (None: all of them). With `ordered`, work queued on the current stream after this call sees every
        chunk on the device, this reload's and an earlier one's. A transfer still in flight is finished first,
        unless it is a reload and this one is ordered: then the current stream waits for both.
        `up_to_room` (unordered only; a prefetch): stop at the first chunk the device has no free memory for,
        without freeing torch's cache, and bring back the chunks before it."""
        if up_to_room and ordered:
            raise InvalidArgumentError("MappedSet.reload: up_to_room is for an unordered reload (a prefetch)")
        with self._lock:
            if self._broken:
                raise ColomemError(f"MappedSet {self.name!r} cannot come back: {self._broken}; its old tensors still "
                                   "hold the bytes, close this set")
            earlier = self._pending
            if earlier is not None and not (earlier.direction == "h2d" and ordered):
                self._finish_pending()
                earlier = None
            t0 = time.perf_counter()
            todo = [i for i, w in enumerate(self._where) if w == POOL and not self._in_flight(i)]
            if budget_bytes is not None:
                todo = _within(todo, [self.memory.chunk_span(i)[1] for i in todo], budget_bytes)
            if not todo:
                if earlier is not None:
                    earlier.wait()  # nothing to order the stream behind: the host waits for the earlier copies
                return self._start("h2d", [], [], None, t0, 0.0, timing)
            cur = _torch.stream_handle(self.device)
            eng = _torch.engine_for(self.device)
            token = self._begin("reload", todo)
            parts: list = []
            map_s, releases = 0.0, 0
            try:
                for n, i in enumerate(todo):
                    t = time.perf_counter()
                    if up_to_room:
                        try:
                            self.memory.map(i, 1)
                        except CudaOutOfMemoryError:
                            todo = todo[:n]  # no room for this one: the chunks queued so far are the reload
                            break
                    else:
                        releases += self._map_for_copy(i)
                    map_s += time.perf_counter() - t
                    last = n == len(todo) - 1
                    copies = [(self._device_address(j) + at, self._blocks_address(j) + at, k)
                              for j, at, k in self._pieces(i)]
                    parts.append(eng.submit("h2d", copies, signal_stream=cur if ordered and last else 0,
                                            timing=timing))
            except BaseException as exc:
                # Mapped, or not, with no copy of theirs left running: their bytes are the pool's still.
                self._abandon(parts, token, exc, unmap=todo[len(parts):], chunks=todo)
                raise
            handle = self._start("h2d", todo, parts, token, t0, map_s * 1e3, timing, releases)
            handle.before = earlier
            return handle

    def _map_for_copy(self, i: int) -> int:
        """Maps chunk i for its copy back; -> 1 when torch's cached blocks had to be freed first, else 0.

        The memory a step frees (activations, buckets) stays in torch's cache, where only torch can use it; a
        torch allocation that finds no room frees that cache and tries again, and so does this. A second
        failure goes to the caller with the chunk's bytes whole in the pool."""
        try:
            self.memory.map(i, 1)
            return 0
        except CudaOutOfMemoryError:
            _torch.release_cached(self.device)
        try:
            self.memory.map(i, 1)
        except CudaOutOfMemoryError as exc:
            off, size = self.memory.chunk_span(i)
            raise CudaOutOfMemoryError(
                f"bringing back {format_bytes(size)} of MappedSet {self.name!r} (bytes {off}+) found no free GPU "
                f"memory even after torch's cached blocks were freed ({exc}). Its bytes stay in the pinned pool; "
                "free GPU memory (a smaller batch or micro-batch) or keep this state in torch's memory") from exc
        return 1

    def wait(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> Optional[MappedStats]:
        """Finishes the transfer in flight, if any (an earlier reload an ordered one was queued behind first)."""
        with self._lock:
            h = self._pending
            return None if h is None else h.wait(timeout)

    def close(self) -> None:
        """Finishes what is in flight, unmaps the memory (the tensors are gone) and gives the pool blocks back.
        A transfer that failed does not stop it (its copies were waited for when it failed); one that is still
        running after the default bound does (TransferTimeoutError: close again)."""
        with self._lock:
            try:
                self._finish_pending()
            except TimeoutError:
                raise
            except ColomemError:
                pass
            self.memory.close()
            for i, b in enumerate(self._blocks):
                if b is not None:
                    b.release()
                    self._blocks[i] = None
            self.tensors = []

    # -- helpers ---------------------------------------------------------------------------------------------
    def _finish_pending(self) -> None:
        if self._pending is not None:
            self.wait(DEFAULT_TIMEOUT_S)

    def _in_flight(self, i: int) -> bool:
        """Whether chunk i is being copied back by the reload in flight or one it was queued behind."""
        h = self._pending
        while h is not None:
            if h.direction == "h2d" and not h.done() and i in h.chunks:
                return True
            h = h.before
        return False

    def _pieces(self, i: int) -> list[tuple[int, int, int]]:
        """(tensor, offset in the tensor, bytes) of each part of a tensor that lies in chunk i (the alignment
        gaps between tensors are not copied)."""
        lo, size = self.memory.chunk_span(i)
        hi = lo + size
        out = []
        for j, (off, n) in enumerate(zip(self.offsets, self._sizes)):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out.append((j, a - off, b - a))
        return out

    def _device_address(self, j: int) -> int:
        return self.memory.range.ptr + self.offsets[j]

    def _blocks_address(self, j: int) -> int:
        """Where tensor j's bytes go in the pool (every tensor's block allocated at the first use of any, so a
        pool too small fails before anything is copied)."""
        if self._blocks[j] is None:
            for k, n in enumerate(self._sizes):
                if self._blocks[k] is None:
                    self._blocks[k] = self._pool.alloc(n)
        b = self._blocks[j]
        assert b is not None
        return b.address

    def host_view(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """A CPU tensor over the pool copy of t (one of `tensors`: same dtype and shape), valid while its chunks
        are in the pool and the set is not closed; None for another tensor, or for one whose chunks are not all
        in the pool with nothing copying them out."""
        with self._lock:
            j = next((k for k, x in enumerate(self.tensors) if x is t), None)
            if j is None or self._broken or self._blocks[j] is None:
                return None
            chunks = self.memory.chunks_of(self.offsets[j], self._sizes[j])
            if any(self._where[i] != POOL for i in chunks) or \
                    (self._pending is not None and self._pending.direction == "d2h"):
                return None
            b = self._blocks[j]
            assert b is not None
            return b.as_tensor(self._sizes[j]).view(t.dtype).view(t.shape)

    def _begin(self, what: str, chunks: list[int]) -> int:
        nbytes = sum(self.memory.chunk_span(i)[1] for i in chunks)
        return self._pool._copies.begin(self._pool, f"MappedSet {self.name!r} {what} of {format_bytes(nbytes)}")

    def _start(self, direction: str, chunks: list[int], parts: list, token: Optional[int], t0: float,
               map_ms: float, timing: bool, cache_releases: int = 0) -> MappedHandle:
        h = MappedHandle(self, direction, chunks, parts, token, t0, map_ms, timing, cache_releases)
        if token is not None:
            self._pool._copies.attach(token, Transfers(parts, h.nbytes))
        if parts:
            self._pending = h
        else:
            h._finish()
        return h

    def _abandon(self, parts: list, token: int, exc: BaseException, unmap: Iterable[int] = (),
                 chunks: Sequence[int] = ()) -> bool:
        """A submission failed. The copies already queued (and those the failed one queued, `exc.transfer`)
        are waited for, bounded. A reload's chunks whose copies completed (`chunks`, in the order of `parts`)
        are on the device now; the others stay where their bytes are whole (the pool's for a reload, the
        device's for an offload). `unmap`: chunks to unmap once nothing queued writes them. -> whether nothing
        queued runs any more."""
        queued = getattr(exc, "transfer", None)
        running = parts + ([queued] if queued is not None else [])
        _settle(running)
        idle = all(_done(p) for p in running)
        if idle:
            self._pool._copies.end(token)
        else:
            self._pool._copies.attach(token, Transfers(running, 0))
        for i, p in zip(chunks, parts):
            if _succeeded(p):
                self._where[i] = DEVICE
            else:
                self._unmap_when_quiet(i, p)  # its copy failed (or still runs): the pool's bytes are the chunk's
        for n, i in enumerate(unmap):
            if self._where[i] == POOL:
                # the failed submission's own chunk: what it queued may still write it
                self._unmap_when_quiet(i, queued if n == 0 else None)
        return idle

    def _unmap_when_quiet(self, i: int, writer=None) -> None:
        """Unmaps chunk i (in the pool's state) unless a copy queued into it still runs (`writer`, or one an
        earlier failure left): then it stays mapped until a later offload finds that copy ended."""
        if writer is not None:
            self._writing[i] = writer
        w = self._writing.get(i)
        if w is not None and not _done(w):
            return
        self._writing.pop(i, None)
        self.memory.unmap(i, 1)


def _succeeded(p) -> bool:
    try:
        return bool(p.done())
    except Exception:  # noqa: B036  (the copy failed)
        return False


def _within(chunks: list[int], sizes: list[int], budget: int) -> list[int]:
    """The leading chunks whose sizes sum to at most `budget`."""
    out, total = [], 0
    for i, n in zip(chunks, sizes):
        if total + n > budget:
            break
        out.append(i)
        total += n
    return out


__all__ = ["MappedHandle", "MappedSet", "MappedStats"]
