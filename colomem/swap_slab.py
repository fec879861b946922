"""Small storages of a SwapSet re-homed onto shared slab storages, so a cycle resizes a few slabs, not each one.

Staging chunks (swap_coalesce) make the copies of many small storages cheap, but every storage is still
released (`resize_(0)`) on offload and re-grown on reload, one by one: about ten microseconds of Python and
allocator work each on a GPU, which for tens of thousands of storages costs more than the copy itself. With
`pack_small=N` a set moves the tensors of storages below N bytes, once, onto slabs: one device storage of up to
SLAB_BYTES holds many of them at 256-byte aligned offsets. A tensor's data pointer is its storage's plus its
offset, so `t.set_(slab, offset, size, stride)` keeps the same tensor (or Parameter) object, dtype, shape and
strides, and from then on one `resize_` of the slab releases or re-grows all of them and one copy moves them.
Tensors of every dtype share a slab (`set_` takes an UntypedStorage with any dtype).

When: at the first offload (and, for small storages that appeared since, at later ones), not at construction.
A callable source yields gradients and optimizer state only once they exist, the set's device is known only
then, and whatever the owner re-assigns between construction and the first offload would be moved for nothing.
The gather runs on the current stream right before the offload's copy (which waits for that stream), and the
old storages go back to the allocator as each slab fills, so the extra memory is about one slab.

Which storages: only those every holder of which is a tensor the set yields. The StorageImpl's use count
(`torch._C._storage_Use_Count`) must equal the set's distinct tensors on it plus what the storage's own Python
object holds, and that Python object must have no other referrer (both measured on a probe tensor, so the
check follows torch's reference scheme). The base a view of the set keeps alive (`t._base`) is reachable, so it
moves along; an outside view, a tensor autograd saved as a separate alias or a held `untyped_storage()` keeps
the storage where it is, on the ordinary path, and so do inference tensors and subclasses with their own
`__torch_dispatch__`; a later offload looks at such storages again. A tensor replaced later (a new `.grad`, new
optimizer state) simply is not on a slab; the plan of every offload still covers whatever storages the set's
tensors hold then, small new ones are re-homed onto a new slab, and a slab no tensor of the set holds any more
is dropped from the plan (its memory goes with its last tensor).

What it changes for callers: tensors on one slab share a storage (`untyped_storage()` is the slab; `torch.save`
of a few of them writes the whole slab; safetensors refuses shared storages: clone first), a tensor on a slab
must not be grown in place (`resize_` past its size would run into its neighbour), and a tensor that leaves
the set but stays alive moves with its slab, as an outside view of any storage of a set does. The autograd
version counters are kept (the bytes did not change).

The plan itself costs a pass over the set's tensors; to keep it off the wall clock when nothing changed, the
set compares each tensor's data pointer with where the last plan left it (relative to its storage, which the
reload moved): the same storage alive at the same size holds that address, so the last plan's storages still
hold every tensor and the pass is skipped.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from colomem.swap import SwapSet, _Entry

MiB = 1 << 20
# A set packs storages smaller than PACK_SMALL_ON when asked (pack_small=...). Off unless asked
# (PACK_SMALL_DEFAULT 0) until its GPU test and the small-tensor benchmark ran on a GPU.
PACK_SMALL_ON = 1 * MiB
PACK_SMALL_DEFAULT = 0
SLAB_BYTES = 256 * MiB  # the largest slab: bounds the extra memory while re-homing
MIN_STORAGES = 2        # fewer would only copy bytes around
ALIGN = 256             # each storage's offset in its slab: a multiple of every itemsize, keeps loads vectorized

# The StorageImpl's strong reference count, by its address (`UntypedStorage._cdata`); without it (a torch that
# lacks it) nothing is re-homed.
_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)
_set_versions: Optional[Callable[..., Any]] = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_data_ptr = torch.Tensor.data_ptr


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Holder:
    """Holds a storage the way an _Entry does, so the Python reference counts of the probe and of a candidate
    are read through the same expression."""

    def __init__(self, storage):
        self.storage = storage


def _py_refs(holder) -> int:
    return sys.getrefcount(holder.storage)


_baseline: Optional[tuple[int, int]] = None


def _uses(storage) -> int:
    assert _use_count is not None
    return _use_count(storage._cdata)


def _counts_of_one_tensor() -> tuple[int, int]:
    """(use count, Python references through one holder) of a storage whose only user is one tensor."""
    global _baseline
    if _baseline is None:
        probe = torch.empty(1)
        h = _Holder(probe.untyped_storage())
        _baseline = (_uses(h.storage), _py_refs(h))
    return _baseline


def _movable(t: torch.Tensor) -> bool:
    return not t.is_inference() and getattr(type(t), "__torch_dispatch__", None) is _PLAIN_DISPATCH


@dataclass
class _Candidate:
    entry: "_Entry"
    tensors: list


@dataclass
class _Seen:
    """Where the last plan left each tensor: index of its entry (-1: not moved by the set) and its data
    pointer relative to that entry's storage (absolute for -1)."""
    count: int
    keys: list          # the entries' StorageImpls, to tell the set's entries are still the ones planned
    idx: torch.Tensor
    rel: torch.Tensor


def _tensors_of(items) -> list:
    """The tensors of a materialised source, in swap_sources.iter_named's order."""
    if isinstance(items, dict):
        return list(items.values())
    return [it[1] if isinstance(it, tuple) and len(it) == 2 and isinstance(it[0], str) else it for it in items]


class Packer:
    """A SwapSet's slabs and its memory of the last plan (used under the set's lock only)."""

    def __init__(self, below: int):
        self.below = below
        self.slab_keys: set[int] = set()
        self._seen: Optional[_Seen] = None
        self._retry = False  # the last plan left small storages off the slabs that a later one may move

    # -- the plan -----------------------------------------------------------------------------------------
    def plan(self, s: "SwapSet") -> list["_Entry"]:
        """SwapSet._plan with small storages re-homed onto slabs, skipped when nothing moved since the last."""
        got = s._source() if callable(s._source) else s._source
        if not isinstance(got, (dict, list, tuple)):
            got = list(got)  # a generator: read once, used by both passes below
        tensors = _tensors_of(got)
        entries = self._unchanged(s, tensors)
        if entries is not None:
            return entries
        self._seen = None
        groups: dict[int, list] = {}
        entries = self._pack(s, s._plan(got, groups), groups)
        if not self._retry:  # else the next plan looks at them again (their outside holder may be gone)
            self._remember(tensors, entries)
        return entries

    def _unchanged(self, s: "SwapSet", tensors: list) -> Optional[list["_Entry"]]:
        """The last plan's entries again when every tensor is where that plan left it; None otherwise."""
        seen, last = self._seen, s._entries
        if seen is None or len(tensors) != seen.count or len(last) != len(seen.keys):
            return None
        for e, key in zip(last, seen.keys):
            if e.storage._cdata != key or e.storage.nbytes() != e.nbytes:
                return None  # not the planned storages any more (a failed offload, discard) or resized
        try:
            ptrs = torch.tensor(list(map(_data_ptr, tensors)), dtype=torch.int64)
        except Exception:  # noqa: BLE001  (not a tensor, or one without storage: the full plan says what)
            return None
        bases = torch.tensor([e.storage.data_ptr() for e in last] + [0], dtype=torch.int64)
        if not torch.equal(ptrs, bases[seen.idx] + seen.rel):
            return None
        from colomem.swap import _Entry
        return [_Entry(e.name, e.storage, e.nbytes) for e in last]

    def _remember(self, tensors: list, entries: list["_Entry"]) -> None:
        index = {e.storage._cdata: j for j, e in enumerate(entries)}
        bases = [e.storage.data_ptr() for e in entries]
        idx, rel = [], []
        for t in tensors:
            j = index.get(t.untyped_storage()._cdata, -1)
            idx.append(j)
            rel.append(t.data_ptr() - (bases[j] if j >= 0 else 0))
        self._seen = _Seen(len(tensors), list(index), torch.tensor(idx, dtype=torch.int64),
                           torch.tensor(rel, dtype=torch.int64))

    # -- re-homing ----------------------------------------------------------------------------------------
    def _pack(self, s: "SwapSet", entries: list["_Entry"], groups: dict[int, list]) -> list["_Entry"]:
        slabs_now: set[int] = set()
        cands: list[_Candidate] = []
        for e in entries:
            key = e.storage._cdata
            if key in self.slab_keys:
                slabs_now.add(key)
            elif e.nbytes < self.below:
                ts = _with_bases(groups[e.storage.data_ptr()], key)
                if all(map(_movable, ts)):
                    cands.append(_Candidate(e, ts))
        self.slab_keys = slabs_now  # a slab none of the set's tensors holds is the set's no more
        self._retry = False
        if len(cands) < MIN_STORAGES or _use_count is None:
            return entries
        # The set's own references to these storages (the last plan's storage objects, its chunk views) go
        # first, so the counts below see only the tensors' holders. Both are rebuilt by this offload.
        s._entries, s._layout = [], None
        sole = [c for c in cands if self._held_by_set_only(c)]
        self._retry = len(sole) < len(cands)
        cands = sole
        if len(cands) < MIN_STORAGES:
            return entries
        moving = {id(c.entry) for c in cands}
        rest = [e for e in entries if id(e) not in moving]
        entries.clear()  # the old storages go back to the allocator as their slab fills (see _rehome)
        device = s._device
        assert device is not None
        slabs: list["_Entry"] = []
        for batch in _batches(cands):
            cands = []  # the batches hold the candidates; each batch's old storages go when it is done
            if len(batch) < MIN_STORAGES:
                rest.extend(c.entry for c in batch)
                continue
            try:
                slabs.append(self._rehome(batch, device, len(self.slab_keys)))
            except torch.OutOfMemoryError:
                rest.extend(c.entry for c in batch)  # no room for another slab: these stay where they are
                self._retry = True
            batch.clear()
        return slabs + rest

    def _held_by_set_only(self, c: _Candidate) -> bool:
        one_uses, one_refs = _counts_of_one_tensor()
        return _uses(c.entry.storage) == len(c.tensors) + one_uses - 1 and _py_refs(c.entry) == one_refs

    def _rehome(self, batch: list[_Candidate], device: torch.device, n: int) -> "_Entry":
        """Gathers the batch's storages into a new slab and moves their tensors onto it; -> the slab's entry.
        torch.OutOfMemoryError (nothing moved) when the slab does not fit."""
        offsets, at = [], 0
        for c in batch:
            offsets.append(at)
            at += _pad(c.entry.nbytes)
        flat = torch.empty(at, dtype=torch.uint8, device=device)
        olds = [torch.empty(0, dtype=torch.uint8, device=device).set_(c.entry.storage) for c in batch]
        # one batched copy on the current stream: the offload's copy waits for that stream, and the caching
        # allocator hands the old storages' memory only to work queued after this kernel
        torch._foreach_copy_([flat[o:o + c.entry.nbytes] for o, c in zip(offsets, batch)], olds)
        del olds
        slab = flat.untyped_storage()
        del flat  # the slab's users are its tensors (and the set's entry) only
        # every version read before any set_: views share their base's counter, which each set_ bumps
        moves = [(t, c.entry.storage, off // t.element_size() + t.storage_offset(), t.storage_offset(), t._version)
                 for c, off in zip(batch, offsets) for t in c.tensors]
        done = 0
        try:
            with torch.no_grad():
                for t, _, offset, _, _ in moves:
                    t.set_(slab, offset, t.size(), t.stride())
                    done += 1
        except BaseException:
            with torch.no_grad():  # a group half moved would split views of one storage: move all back
                for t, old, _, old_offset, _ in moves[:done]:
                    t.set_(old, old_offset, t.size(), t.stride())
            raise
        _keep_versions([m[0] for m in moves], [m[4] for m in moves])
        key = slab._cdata
        self.slab_keys.add(key)
        from colomem.swap import _Entry
        return _Entry(f"slab[{n}] ({len(batch)} storages)", slab, at)


def _with_bases(tensors: list, key: int) -> list:
    """The distinct tensors, with the base each view keeps alive (reachable, so it moves with them) where that
    base still uses the same storage (`.data =` may have given it another since)."""
    out = {id(t): t for t in tensors}
    for t in tensors:
        b = t._base
        if b is not None and id(b) not in out and b.untyped_storage()._cdata == key:
            out[id(b)] = b
    return list(out.values())


def _batches(cands: list[_Candidate]) -> list[list[_Candidate]]:
    out: list[list[_Candidate]] = []
    run: list[_Candidate] = []
    size = 0
    for c in cands:
        p = _pad(c.entry.nbytes)
        if run and size + p > SLAB_BYTES:
            out.append(run)
            run, size = [], 0
        run.append(c)
        size += p
    if len(run) == 1 and out:
        out[-1].append(run[0])  # a slab of one would move nothing: its predecessor grows a little instead
    elif run:
        out.append(run)
    return out


def _keep_versions(tensors: list, versions: list) -> None:
    """set_ counts as an in-place change; the bytes are the same, so the versions autograd checks stay."""
    if _set_versions is None or not tensors:
        return
    try:
        _set_versions(tuple(tensors), tuple(versions))
    except TypeError:  # an older signature: one tensor at a time
        for t, v in zip(tensors, versions):
            _set_versions(t, v)
