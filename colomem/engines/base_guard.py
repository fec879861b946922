"""A guard that nobody writes into the base the trainer shares with vLLM: checksums compared to the ones taken
when it was armed.

Each tensor's bytes are split into `parts` pieces whose checksums (the core's, `colomem._C.checksum`, every
8-byte word) are taken once when the guard is armed. `sampled()` (cheap, once a step) reads a fixed strided
sample of every tensor (about `sample_words` words spread over it, the first and last included) plus one
piece per tensor that rotates with each call, so `parts` consecutive calls have read every byte once.
`full()` reads every piece of every tensor. A difference raises BaseWrittenError naming the tensor and its
byte range. The windows of one call are one batch of the core's checksum; on the GPU it is queued on a side
stream (ordered after the current stream's work), stored by its kernel into page-locked memory, and waited
for with a bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from colomem import _C
from colomem.bridge.buffers import wait_event
from colomem.bridge.wire import U64
from colomem.errors import BaseWrittenError, InvalidArgumentError

DEFAULT_PARTS = 64
DEFAULT_SAMPLE_WORDS = 4096         # 8-byte words per tensor in the strided sample: 32 KiB read per tensor


@dataclass(frozen=True)
class _Window:
    name: str
    what: str                        # "sample" or "part i"
    offset: int                      # bytes from the tensor's first byte
    nbytes: int
    stride: int                      # words: 1 reads every word


class BaseChecksum:
    """Checksums of the shared base tensors (vLLM's weights the trainer reads), armed at construction."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, parts: int = DEFAULT_PARTS,
                 sample_words: int = DEFAULT_SAMPLE_WORDS, timeout_s: float = 60.0):
        if parts < 1 or sample_words < 1:
            raise InvalidArgumentError(f"parts ({parts}) and sample_words ({sample_words}) must be at least 1")
        if not tensors:
            raise InvalidArgumentError("BaseChecksum needs at least one tensor to guard")
        self.timeout_s = float(timeout_s)
        self._tensors = dict(tensors)
        devices = {t.device for t in self._tensors.values()}
        if len(devices) != 1:
            raise InvalidArgumentError(f"the guarded tensors are on several devices ({sorted(map(str, devices))})")
        self.device = devices.pop()
        self._sample: list[_Window] = []
        self._parts: list[list[_Window]] = []
        for name, t in self._tensors.items():
            if not t.is_contiguous():
                raise InvalidArgumentError(f"{name} is not contiguous: the guard reads byte ranges")
            n = t.numel() * t.element_size()
            self._sample.append(_Window(name, "sample", 0, n, max(1, n // 8 // sample_words)))
            self._parts.append(_split(name, n, parts))
        self.calls = 0
        self._side: Any = None
        self._in_flight: list = []          # (descriptors, host values, device values, done event) of a batch
        self._ref = {w: v for w, v in zip(self._all(), self._compute(self._all()))}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def _all(self) -> list[_Window]:
        return self._sample + [w for ps in self._parts for w in ps]

    def sampled(self) -> int:
        """The strided sample of every tensor and each tensor's next piece; returns the bytes read."""
        windows = list(self._sample)
        for ps in self._parts:
            windows.append(ps[self.calls % len(ps)])
        self.calls += 1
        self._compare(windows)
        return sum(w.nbytes // w.stride for w in windows)

    def full(self) -> int:
        """Every byte of every tensor; returns the bytes read."""
        windows = [w for ps in self._parts for w in ps]
        self._compare(windows)
        return sum(w.nbytes for w in windows)

    def digest(self) -> int:
        """One number for the armed base (the pieces' checksums combined in order): equal digests of two
        guards mean their tensors held the same bytes when armed."""
        acc = 0
        for ps in self._parts:
            for w in ps:
                acc = (acc * 1_000_003 + self._ref[w]) & U64
        return acc

    def _compare(self, windows: list[_Window]) -> None:
        for w, v in zip(windows, self._compute(windows)):
            if v != self._ref[w]:
                raise BaseWrittenError(
                    f"the shared base {w.name} changed ({w.what}: bytes [{w.offset}, {w.offset + w.nbytes})): "
                    "something wrote into the frozen weights the trainer and vLLM share. Only the adapter may "
                    "change; look for an optimizer, a weight load or an in-place op that reaches the base")

    def _compute(self, windows: list[_Window]) -> list[int]:
        """The windows' checksums in one batch (the core's checksum_many_into: three kernel launches on a GPU
        whatever their number, where one call a window launched three each)."""
        ptrs = {name: t.data_ptr() for name, t in self._tensors.items()}
        cuda = self.device.type == "cuda"
        n = len(windows)
        descs = torch.tensor([v for w in windows for v in (ptrs[w.name] + w.offset, w.nbytes, w.stride)],
                             dtype=torch.int64)
        host = torch.empty(n, dtype=torch.int64)
        if not cuda:
            _C.checksum_many_into(descs.data_ptr(), n, 0, 0, -1, host.data_ptr())
            return [int(v) & U64 for v in host.tolist()]
        dev = self.device
        if self._side is None:
            self._side = torch.cuda.Stream(dev)
        side = self._side
        # the kernels read the descriptors and store the values in page-locked memory where they run: those
        # buffers stay referenced until their batch is known done, even past a wait that timed out
        self._in_flight = [b for b in self._in_flight if not b[-1].query()]
        descs, host = descs.pin_memory(), host.pin_memory()
        side.wait_stream(torch.cuda.current_stream(dev))       # the writes queued so far come first
        with torch.cuda.stream(side):
            out = torch.empty(n, dtype=torch.int64, device=dev)
            _C.checksum_many_into(descs.data_ptr(), n, out.data_ptr(), side.cuda_stream, dev.index, host.data_ptr())
            done = torch.cuda.Event()
            done.record(side)
        self._in_flight.append((descs, host, out, done))
        wait_event(done, self.timeout_s, "the shared-base checksum")
        return [int(v) & U64 for v in host.tolist()]


def _split(name: str, nbytes: int, parts: int) -> list[_Window]:
    """`parts` pieces (fewer for a small tensor) on 8-byte boundaries covering [0, nbytes)."""
    words = -(-nbytes // 8)
    k = max(1, min(parts, words))
    bounds = [min(nbytes, (words * i // k) * 8) for i in range(k + 1)]
    bounds[-1] = nbytes
    return [_Window(name, f"part {i}", bounds[i], bounds[i + 1] - bounds[i], 1)
            for i in range(k) if bounds[i + 1] > bounds[i]]


__all__ = ["BaseChecksum", "DEFAULT_PARTS", "DEFAULT_SAMPLE_WORDS"]
