"""Packing a sync's sources on the host path: a set's pool copies (host views), a pageable host tensor and
the rest into host buckets, byte for byte; how pack_bucket classifies sources; what BridgeStats counts."""

import pytest
import torch

import colomem
from colomem.bridge import WeightBridge
from colomem.bridge.buckets import LOCAL, PINNED, TORCH, pack_bucket, plan_buckets, source_kind
from pool_sources import nbytes, offloaded_sources, same_bytes, unpack

BUCKET = 16 << 10  # smaller than the largest source: it is split across buckets


@pytest.fixture
def pool():
    p = colomem.PinnedPool("4MiB", pin=False)
    yield p
    p.close(force=True)


def test_host_views_and_pageable_tensors_pack_into_host_buckets_byte_for_byte(pool):
    swap, expected, sources = offloaded_sources("cpu", pool)
    plans = list(plan_buckets(sources, BUCKET))
    assert len(plans) > 2
    buffers = [torch.full((BUCKET,), 0xAB, dtype=torch.uint8) for _ in plans]
    packed = [pack_bucket(p, b) for p, b in zip(plans, buffers)]
    got = unpack(plans, buffers)
    assert set(got) == set(expected)
    for n, want in expected.items():
        assert same_bytes(got[n], want), n
    # every source is host memory, as the host bucket is: all raw copies, none through torch
    assert sum(p.local_bytes for p in packed) == sum(nbytes(t) for t in expected.values())
    assert sum(p.pinned_bytes + p.torch_bytes for p in packed) == 0
    swap.reload()
    swap.close()


def test_source_kinds():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device name needs no GPU
    host = torch.arange(10, dtype=torch.float32)
    assert source_kind(host, cpu) == LOCAL
    # pageable host memory into a GPU bucket goes through torch (its copy stages it); without a driver no
    # memory is page-locked
    assert not host.is_pinned()
    assert source_kind(host, gpu) == TORCH
    assert source_kind(host[3:7], gpu) == TORCH
    assert PINNED not in (source_kind(host, cpu), source_kind(host, gpu))


def test_bridge_stats_count_the_bytes_and_every_bucket(pool):
    swap, expected, sources = offloaded_sources("cpu", pool)
    with WeightBridge(bucket_bytes=BUCKET, buffers=2, device="cpu", checksum="full", timeout=30) as bridge:
        from colomem.bridge import BridgeImporter

        imp = BridgeImporter.connect(bridge.address, timeout=30)
        bridge.wait_for_importers(1, 30)
        got = {}

        def send(d):
            for name, t in imp.tensors(d, verify="full"):
                got[name] = t.clone()
            return {"version": d["version"], "seq": d["seq"]}

        stats = bridge.sync(sources, version=4, send=send)
        imp.close()
    for n, want in expected.items():
        assert same_bytes(got[n], want), n
    total = sum(nbytes(t) for t in expected.values())
    assert stats.nbytes == total == stats.local_bytes
    assert stats.pinned_bytes == stats.torch_bytes == 0
    assert len(stats.buckets) == stats.messages > 2
    assert [b["seq"] for b in stats.buckets] == list(range(stats.messages))
    assert all(b["ack_ms"] is not None and b["ack_ms"] >= 0 for b in stats.buckets)
    assert all(0 < b["nbytes"] <= BUCKET for b in stats.buckets)
    assert stats.pack_copy_seconds > 0 and stats.pack_issue_seconds > 0
    swap.reload()
    swap.close()
