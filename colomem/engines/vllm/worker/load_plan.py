"""Where a model's `load_weights` puts each named tensor, recorded once and replayed as plain copies.

vLLM's `load_weights` maps HF names to its fused parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj),
narrows to the tensor-parallel shard and copies, one Python weight loader call per tensor. On a large model
that Python costs more per sync than the copies themselves (docs/performance.md). The copies it makes are
the same every sync, so `LoadPlan.record` runs `load_weights` once under a TorchDispatchMode that sees every aten op,
and keeps, per source name, the copies from that source into the model's parameters (plus constant fills such
as the zeroed padding rows of a vocab embedding). Later syncs of the same names `replay` those copies.

A source is only replayed when everything the loader did with it was a view or a copy into a parameter; any
other use (a dtype cast, arithmetic, a copy into a temporary, a write into a parameter from computed data)
marks that name as "not replayable" and it keeps going through `load_weights`. The plan is dropped when a
parameter's storage moved (a reloaded model), so a replay never writes into memory the model left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colomem.bridge.buckets import Entry, dtype_name
from colomem._torch import ranges_tensor

_aten = torch.ops.aten
_COPY = _aten.copy_.default
_FILLS = {_aten.fill_.Scalar, _aten.zero_.default}


@dataclass
class _Copy:
    src_offset: int          # first element of the flattened source tensor
    numel: int
    dst: torch.Tensor        # 1-D contiguous view into a model parameter (keeps the storage alive)


@dataclass
class NamePlan:
    """What loading one source name does: copies into parameters, constant fills, the parameters written."""

    dtype: torch.dtype
    shape: tuple
    copies: list = field(default_factory=list)
    fills: list = field(default_factory=list)       # (tensor view, value)
    params: set = field(default_factory=set)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of a strided tensor's elements (empty for zero elements)."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size())


class _Source(NamedTuple):
    """A tensor handed to load_weights: its byte range, name and dtype."""
    start: int
    end: int
    name: str
    dtype: torch.dtype


class _Recorder(TorchDispatchMode):
    """Watches aten ops while load_weights runs; attributes every write into the model to a source name."""

    def __init__(self, storages: dict):
        super().__init__()
        self.storages = storages          # storage data_ptr -> parameter name
        self.sources: list = []           # _Source per tensor handed out, newest last
        self.current: Optional[str] = None
        self.plans: dict = {}             # name -> NamePlan
        self.bad: dict = {}               # name -> why it cannot be replayed
        self.global_bad: Optional[str] = None
        self.keep: list = []              # the sources stay alive while recording: no address is reused

    # -- classification --------------------------------------------------------------------------------
    def source_of(self, t: torch.Tensor) -> tuple[Optional[_Source], bool]:
        """(the source t reads, whether t lies inside it); a t that overlaps a source without lying inside
        it is not a view we understand."""
        if t.numel() == 0 or t.device.type == "meta":
            return None, False
        lo, hi = _extent(t)
        for src in reversed(self.sources):
            if src.start <= lo and hi <= src.end:
                return src, True
            if lo < src.end and src.start < hi:
                return src, False
        return None, False

    def param_of(self, t: torch.Tensor) -> Optional[str]:
        try:
            return self.storages.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return None

    def mark_bad(self, name: Optional[str], why: str) -> None:
        if name is None:
            self.global_bad = self.global_bad or why
        else:
            self.bad.setdefault(name, why)

    # -- the mode ----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            self.observe(func, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - recording must never break the real load
            self.mark_bad(None, f"recording failed: {exc}")
        return func(*args, **kwargs)

    def observe(self, func, args, kwargs) -> None:
        if func is _COPY:
            self.on_copy(args[0], args[1])
            return
        if func in _FILLS:
            self.on_fill(func, args)
            return
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if func._schema.is_mutable:
            for arg, val in zip(func._schema.arguments, args):
                info = arg.alias_info
                written = self.param_of(val) if info is not None and info.is_write and isinstance(val, torch.Tensor) \
                    else None
                if written:
                    # which source it belongs to is not knowable (loaders read ahead): nothing is replayed
                    self.mark_bad(None, f"{func} writes parameter {written}")
        if not func.is_view:
            for t in tensors:
                src, _ = self.source_of(t)
                if src is not None:
                    self.mark_bad(src.name, f"{func} reads it (only views and copies are replayed)")

    def on_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        s, inside = self.source_of(src)
        p = self.param_of(dst)
        if s is None:
            if p is not None:
                self.mark_bad(None, f"parameter {p} written from computed data")
            return
        name = s.name
        if not inside:
            self.mark_bad(name, "a copy reads a range that straddles its tensor")
        elif p is None:
            self.mark_bad(name, "copied into a temporary, not into a parameter")
        elif not (src.is_contiguous() and dst.is_contiguous()):
            self.mark_bad(name, "non-contiguous copy")
        elif src.dtype != s.dtype:
            self.mark_bad(name, f"read as {src.dtype} instead of {s.dtype}")
        elif src.numel() != dst.numel():
            self.mark_bad(name, "broadcasting copy")
        else:
            plan = self.plans[name]
            off = (src.data_ptr() - s.start) // src.element_size()
            plan.copies.append(_Copy(off, src.numel(), dst.detach().view(-1)))
            plan.params.add(p)

    def on_fill(self, func, args) -> None:
        dst = args[0]
        p = self.param_of(dst)
        if p is None:
            return
        if self.current is None:  # before the first source: not tied to any name
            self.mark_bad(None, f"parameter {p} filled outside of any tensor's load")
            return
        # Attributed to the latest source handed out (a loader that reads ahead may mean another one): a
        # constant fill is replayed with that name, and _overlapping refuses it if the order could matter.
        value = 0 if func is _aten.zero_.default else args[1]
        if isinstance(value, torch.Tensor):
            self.mark_bad(None, "a fill with a tensor value")
            return
        self.plans[self.current].fills.append((dst.detach(), value))

    # -- sources -----------------------------------------------------------------------------------------
    def watch(self, named: Iterable) -> Iterator[tuple]:
        for name, t in named:
            lo, hi = _extent(t)
            if name in self.plans:
                self.mark_bad(name, "sent twice in one version")
            self.plans[name] = NamePlan(t.dtype, tuple(t.shape))
            if not t.is_contiguous():
                self.mark_bad(name, "non-contiguous source")
            self.sources.append(_Source(lo, hi, name, t.dtype))
            self.keep.append(t)
            self.current = name
            yield name, t
        self.current = None


def _overlapping(plans: dict) -> set:
    """Names whose copies or fills write bytes another name also writes (their order would matter)."""
    spans = []
    for name, plan in plans.items():
        for c in plan.copies:
            spans.append((*_extent(c.dst), name))
        for t, _ in plan.fills:
            spans.append((*_extent(t), name))
    spans.sort()
    bad: set = set()
    end, owner = -1, None
    for lo, hi, name in spans:
        if lo < end and name != owner:
            bad.update((name, owner))
        if hi > end:
            end, owner = hi, name
    return bad


@dataclass
class VersionRecord:
    """What the recorded load_weights calls of one version saw so far. A version loaded in several calls
    (bridge buckets, direct chunks) is judged as if one call had loaded it: a name overlapping one of an
    earlier call, sent again, or a write no name can own refuses the earlier calls' names too."""

    plans: dict = field(default_factory=dict)      # name -> NamePlan, every call of the version
    bad: Optional[str] = None                      # why none of the version's names can be replayed


@dataclass
class CompiledBucket:
    """What replay() does for every entry of one bucket layout, as raw copies: the next bucket with that
    layout is applied with one call into the core, without parsing its entries or making a view."""

    ranges: torch.Tensor     # (n, 3) int64: destination address, offset in the bucket, bytes
    fills: list              # (tensor, value), after the copies
    params: set              # parameters written
    tensors: int             # whole tensors the bucket completes (a split tensor counts at its last part)

    def fill(self) -> None:
        for t, value in self.fills:
            t.fill_(value)


MAX_COMPILED = 4096  # bucket layouts kept per plan (a trainer whose layouts never repeat must not grow it)


class LoadPlan:
    """Per-name copy plans of one model, recorded from its load_weights and replayed without it."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._layout = self._storage_layout()
        self.plans: dict = {}          # name -> NamePlan (replayable)
        self.refused: dict = {}        # name -> why it goes through load_weights every time
        self.recorded_calls = 0
        self.compiled: dict = {}       # (buffer, layout digest) -> CompiledBucket

    def _storage_layout(self) -> dict:
        """{parameter or buffer name: storage data_ptr} of the model now."""
        out = {}
        for n, t in list(self._model.named_parameters()) + list(self._model.named_buffers()):
            try:
                out[n] = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                pass
        return out

    def still_valid(self) -> bool:
        """False when a parameter was replaced or re-allocated since recording (the plan must be dropped)."""
        return self._storage_layout() == self._layout

    def can_replay(self, e: Entry) -> bool:
        p = self.plans.get(e.name)
        return p is not None and p.shape == tuple(e.shape) and dtype_name(p.dtype) == e.dtype

    def replay(self, e: Entry, view: torch.Tensor) -> set:
        """Does for one bucket entry (a whole tensor, or a part of a split one) what load_weights did for it:
        copies (on the current stream) and, with the entry holding the tensor's start, the fills. A copy whose
        source already is its destination's memory is skipped (it would write every byte onto itself).
        Returns the parameters written."""
        plan = self.plans[e.name]
        flat = view.reshape(-1)
        p0, p1 = (e.part[0], e.part[1]) if e.part is not None else (0, flat.numel())
        for c in plan.copies:
            lo, hi = max(c.src_offset, p0), min(c.src_offset + c.numel, p1)
            if lo < hi:
                dst, src = c.dst[lo - c.src_offset:hi - c.src_offset], flat[lo - p0:hi - p0]
                if dst.data_ptr() == src.data_ptr() and dst.dtype == src.dtype:
                    continue     # the source is the parameter's own memory (a shared base merged in place)
                dst.copy_(src, non_blocking=True)
        if p0 == 0:
            for t, value in plan.fills:
                t.fill_(value)
        return plan.params

    def compile(self, key, entries: Iterable[Entry], device: torch.device) -> Optional[CompiledBucket]:
        """The raw copies replay() makes for these entries (a bucket's layout), kept under `key`; None when
        an entry is not replayable or a copy converts dtypes or leaves `device` (torch must do those)."""
        ranges, fills, params, tensors = [], [], set(), 0
        for e in entries:
            if not self.can_replay(e):
                return None
            plan = self.plans[e.name]
            size = plan.dtype.itemsize
            p0, p1 = (e.part[0], e.part[1]) if e.part is not None else (0, e.numel)
            for c in plan.copies:
                if c.dst.dtype != plan.dtype or c.dst.device != device:
                    return None
                lo, hi = max(c.src_offset, p0), min(c.src_offset + c.numel, p1)
                if lo < hi:
                    ranges.append((c.dst.data_ptr() + (lo - c.src_offset) * size, e.offset + (lo - p0) * size,
                                   (hi - lo) * size))
            if p0 == 0:
                fills.extend(plan.fills)
            params |= plan.params
            tensors += e.part is None or e.part[1] == e.part[2]
        if len(self.compiled) >= MAX_COMPILED:
            self.compiled.clear()
        out = self.compiled[key] = CompiledBucket(ranges_tensor(ranges), fills, params, tensors)
        return out

    def record(self, load: Callable[[Iterable], Optional[Iterable]], named: Iterable,
               version: Optional[VersionRecord] = None) -> Optional[set]:
        """Runs load(named) (the model's load_weights) while recording; returns what load returned. Names
        that load cleanly become replayable, the others are remembered as refused with the reason.
        version: what earlier calls of the same version recorded (updated here); None: this call alone."""
        rec = _Recorder({ptr: n for n, ptr in self._layout.items()})
        with rec:
            loaded = load(rec.watch(named))
        self.recorded_calls += 1
        seen = version if version is not None else VersionRecord()
        for name in rec.plans:
            if name in seen.plans:
                rec.mark_bad(name, "sent twice in one version")
        seen.plans.update(rec.plans)
        seen.bad = seen.bad or rec.global_bad
        crossed = _overlapping(seen.plans)
        # the earlier calls' names too: what this call did may refuse them
        for name, plan in seen.plans.items():
            why = seen.bad or rec.bad.get(name) or (
                "writes bytes another tensor also writes" if name in crossed else None)
            if why:
                self.refused[name] = why
                self.plans.pop(name, None)
            elif name not in self.refused:
                self.plans[name] = plan
        return set(loaded) if loaded is not None else None

    def summary(self) -> dict:
        return {"replayable": len(self.plans), "refused": len(self.refused),
                "refused_examples": dict(list(self.refused.items())[:4]),
                "copies": sum(len(p.copies) for p in self.plans.values())}
