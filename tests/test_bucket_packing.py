"""The bridge's packing plan on the CPU: layout, alignment, splitting, metadata, and a byte-exact round trip
through CPU "buckets" (uint8 tensors) and serialised messages, for every common dtype and odd sizes."""

import json
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colomem import _C
from colomem.bridge.buckets import (ALIGN, BucketMessage, Entry, Reassembler, dtype_from_name, dtype_name, entry_view,
                                    pack_bucket, plan_buckets)
from colomem.errors import InvalidArgumentError, PeerError
from random_bytes import random_tensor

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64]
DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def transfer(named, bucket_bytes, nbuffers=2, version=3, wire=json):
    """Producer -> consumer through CPU buckets, the way the bridge does it (one message per bucket, dicts
    through a serialiser, buffers in rotation); returns the consumer's {name: tensor} copies and the msgs."""
    buffers = [torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8) for _ in range(nbuffers)]
    plans = list(plan_buckets(named, bucket_bytes))
    reasm, got, msgs = Reassembler(), {}, []
    for seq, plan in enumerate(plans):
        i = seq % nbuffers
        pack_bucket(plan, buffers[i])
        msg = BucketMessage(buffer=i, version=version, seq=seq, last=seq == len(plans) - 1, nbytes=plan.nbytes,
                            checksum=_C.checksum(buffers[i].data_ptr(), plan.nbytes, 1, 0, -1), checksum_stride=1,
                            entries=tuple(plan.entries))
        d = wire.loads(wire.dumps(msg.to_dict()))
        m = BucketMessage.from_dict(d)
        assert m == msg
        assert _C.checksum(buffers[m.buffer].data_ptr(), m.nbytes, 1, 0, -1) == m.checksum
        for e in m.entries:
            out = reasm.add(e, entry_view(buffers[m.buffer], e))
            if out is not None:
                got[out[0]] = out[1].clone()  # the buffer is reused two messages later: copy, like a consumer
        msgs.append(m)
    assert reasm.pending() == []
    return got, msgs


def check_layout(msgs, bucket_bytes):
    for m in msgs:
        end = 0
        for e in sorted(m.entries, key=lambda e: e.offset):
            assert e.offset % ALIGN == 0
            assert e.offset >= end, "entries overlap"
            end = e.offset + e.nbytes
            assert end <= bucket_bytes
        assert m.nbytes <= bucket_bytes


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_round_trip_every_dtype_odd_shapes(dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [(), (1,), (3,), (7, 5), (2, 3, 5), (0,), (4, 0, 3), (257,), (33, 31)]
    named = [(f"t{i}", random_tensor(s, dtype, gen)) for i, s in enumerate(shapes)]
    got, msgs = transfer(named, bucket_bytes=1024)
    assert list(got) == [n for n, _ in named]
    for name, t in named:
        assert same_bytes(got[name], t), name
    check_layout(msgs, 1024)


def test_split_tensor_parts_cover_it_in_order():
    gen = torch.Generator().manual_seed(1)
    big = random_tensor((1000, 3), torch.float32, gen)  # 12000 B with 1024-B buckets
    small = random_tensor((10,), torch.float32, gen)
    named = [("small", small), ("big", big), ("after", small.clone())]
    plans = list(plan_buckets(named, 1024))
    parts = [e for p in plans for e in p.entries if e.name == "big"]
    assert len(parts) > 1 and all(e.part is not None for e in parts)
    assert parts[0].part[0] == 0 and parts[-1].part[1] == big.numel()
    for a, b in zip(parts, parts[1:]):
        assert a.part[1] == b.part[0] and a.part[2] == b.part[2] == big.numel()
    # the first part fills what "small" left of the first bucket; middle parts fill whole buckets
    assert plans[0].entries[1].name == "big" and plans[0].entries[1].offset == ALIGN
    assert all(e.nbytes == 1024 for e in parts[1:-1])
    got, msgs = transfer(named, 1024)
    assert same_bytes(got["big"], big) and same_bytes(got["small"], small) and same_bytes(got["after"], small)
    check_layout(msgs, 1024)


def test_tensor_that_fits_a_bucket_is_never_split():
    t = torch.zeros(200, dtype=torch.float32)  # 800 B
    plans = list(plan_buckets([("a", torch.zeros(100, dtype=torch.uint8)), ("b", t)], 1024))
    assert [[e.name for e in p.entries] for p in plans] == [["a"], ["b"]]
    assert plans[1].entries[0].part is None and plans[1].entries[0].offset == 0


def test_exact_fit_and_alignment_padding():
    named = [("a", torch.zeros(1, dtype=torch.uint8)), ("b", torch.zeros(768, dtype=torch.uint8))]
    (plan,) = plan_buckets(named, 1024)
    assert [(e.offset, e.nbytes) for e in plan.entries] == [(0, 1), (256, 768)]
    assert plan.nbytes == 1024


def test_non_contiguous_inputs_are_sent_as_their_values():
    gen = torch.Generator().manual_seed(2)
    base = random_tensor((16, 24), torch.bfloat16, gen)
    named = [("t", base.t()), ("s", base[::2, 1::3]), ("e", torch.zeros(3, 1).expand(3, 5))]
    got, _ = transfer(named, 512)
    for name, t in named:
        assert got[name].is_contiguous() and same_bytes(got[name], t.contiguous())


def test_lazy_iteration_plans_one_bucket_at_a_time():
    pulled = []

    def gen():
        for i in range(10):
            pulled.append(i)
            yield f"t{i}", torch.zeros(200, dtype=torch.uint8)  # 4 fit in 1024 B (256-B aligned)

    it = plan_buckets(gen(), 1024)
    first = next(it)
    assert [e.name for e in first.entries] == ["t0", "t1", "t2", "t3"]
    assert pulled == [0, 1, 2, 3, 4]  # one lookahead tensor, not the whole model


def test_empty_input_plans_nothing():
    assert list(plan_buckets([], 1024)) == []


def test_metadata_of_a_message():
    named = [("w", torch.zeros(3, 4, dtype=torch.bfloat16)), ("b", torch.zeros(5, dtype=torch.int64))]
    _, (m,) = transfer(named, 1024, version=7)
    d = m.to_dict()
    assert d["version"] == 7 and d["seq"] == 0 and d["last"] is True and d["buffer"] == 0
    assert d["checksum_stride"] == 1 and 0 <= d["checksum"] < 1 << 64
    assert d["entries"] == [
        {"name": "w", "dtype": "bfloat16", "shape": [3, 4], "offset": 0, "nbytes": 24, "part": None},
        {"name": "b", "dtype": "int64", "shape": [5], "offset": 256, "nbytes": 40, "part": None},
    ]
    assert d["nbytes"] == 296
    assert BucketMessage.from_dict(pickle.loads(pickle.dumps(d))) == m


def test_messages_hold_only_plain_types():
    gen = torch.Generator().manual_seed(3)
    _, msgs = transfer([("x", random_tensor((500,), torch.float32, gen))], 512)

    def plain(v):
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (bool, int, str))

    assert all(plain(m.to_dict()) for m in msgs)


def test_several_versions_reuse_the_same_buffers():
    gen = torch.Generator().manual_seed(4)
    for version in range(3):
        named = [(f"p{i}", random_tensor((37 * (i + 1),), torch.float16, gen)) for i in range(12)]
        got, msgs = transfer(named, 512, nbuffers=2, version=version)
        assert all(m.version == version for m in msgs) and msgs[-1].last and not any(m.last for m in msgs[:-1])
        assert [m.seq for m in msgs] == list(range(len(msgs)))
        for name, t in named:
            assert same_bytes(got[name], t)


def test_bad_inputs():
    with pytest.raises(InvalidArgumentError, match="twice"):
        list(plan_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], 1024))
    with pytest.raises(InvalidArgumentError):
        list(plan_buckets([("a", torch.zeros(1))], 1000))  # not a multiple of 256
    with pytest.raises(InvalidArgumentError):
        list(plan_buckets([("a", torch.zeros(1))], 0))
    with pytest.raises(InvalidArgumentError):
        list(plan_buckets([("a", [1, 2, 3])], 1024))
    with pytest.raises(InvalidArgumentError):
        list(plan_buckets([torch.zeros(1)], 1024))
    with pytest.raises(InvalidArgumentError):
        list(plan_buckets([("s", torch.zeros(4, 4).to_sparse())], 1024))
    with pytest.raises(InvalidArgumentError):
        (plan,) = plan_buckets([("a", torch.zeros(100))], 1024)
        pack_bucket(plan, torch.zeros(100, dtype=torch.uint8))  # destination too small


def good_dict():
    return {"buffer": 0, "version": 1, "seq": 0, "last": True, "nbytes": 296, "checksum": 5, "checksum_stride": 64,
            "entries": [{"name": "w", "dtype": "bfloat16", "shape": [3, 4], "offset": 0, "nbytes": 24, "part": None},
                        {"name": "b", "dtype": "int64", "shape": [5], "offset": 256, "nbytes": 40, "part": None}]}


@pytest.mark.parametrize("corrupt", [
    lambda d: d.pop("entries"),
    lambda d: d.update(seq=-1),
    lambda d: d.update(checksum=1 << 64),
    lambda d: d.update(nbytes=100),                                  # entries end past nbytes
    lambda d: d["entries"][0].update(dtype="no_such_dtype"),
    lambda d: d["entries"][0].update(dtype="__class__"),
    lambda d: d["entries"][0].update(nbytes=23),                     # not numel * itemsize
    lambda d: d["entries"][1].update(offset=100),                    # not aligned
    lambda d: d["entries"][0].update(shape=[3, -4]),
    lambda d: d["entries"][0].update(part=[0, 12, 13]),              # total != numel of shape
    lambda d: d["entries"][0].update(part=[5, 5, 12]),               # empty part
    lambda d: d["entries"][0].pop("name"),
], ids=range(12))
def test_malformed_messages_are_peer_errors(corrupt):
    d = good_dict()
    BucketMessage.from_dict(d)  # the uncorrupted one is fine
    corrupt(d)
    with pytest.raises(PeerError):
        BucketMessage.from_dict(d)
    with pytest.raises(PeerError):
        BucketMessage.from_dict([1, 2])


def test_reassembler_refuses_parts_out_of_order():
    r = Reassembler()
    e = Entry("x", "float32", (10,), 0, 16, (4, 8, 10))
    with pytest.raises(PeerError, match="starts at element 4"):
        r.add(e, torch.zeros(4))
    assert r.add(Entry("x", "float32", (10,), 0, 16, (0, 4, 10)), torch.zeros(4)) is None
    with pytest.raises(PeerError):
        r.add(Entry("x", "float32", (10,), 0, 8, (6, 8, 10)), torch.zeros(2))  # a gap
    assert r.pending() == ["x"]
    r.reset()
    assert r.pending() == []


def test_dtype_names_round_trip():
    for d in DTYPES:
        assert dtype_from_name(dtype_name(d)) is d


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 700), st.sampled_from(DTYPES)), min_size=0, max_size=12),
    bucket_bytes=st.sampled_from([256, 512, 768, 2048]),
    nbuffers=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_property(sizes, bucket_bytes, nbuffers, seed):
    gen = torch.Generator().manual_seed(seed)
    named = [(f"t{i}", random_tensor((n,), dt, gen)) for i, (n, dt) in enumerate(sizes)]
    got, msgs = transfer(named, bucket_bytes, nbuffers=nbuffers)
    assert sorted(got) == sorted(n for n, _ in named)
    for name, t in named:
        assert same_bytes(got[name], t)
    check_layout(msgs, bucket_bytes)
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert sum(e.nbytes for m in msgs for e in m.entries) == total
