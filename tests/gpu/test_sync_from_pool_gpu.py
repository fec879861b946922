"""A weight sync read from a set's pool copies on a real GPU (what the loop does after the trainer's
offload): the pool's host views are page-locked, so pack_bucket copies them into CUDA buckets with the same
batched copy as device tensors; a pageable host tensor goes through torch; the bytes arrive unchanged, through
pack_bucket and through a WeightBridge sync."""

import pytest
import torch

import colomem
from colomem.bridge.buckets import LOCAL, PINNED, TORCH, pack_bucket, plan_buckets, source_kind
from pool_sources import nbytes, offloaded_sources, same_bytes, unpack

pytestmark = pytest.mark.gpu

BUCKET = 64 << 10  # smaller than the largest source: it is split across buckets
HOST_VIEWS = "pageable", "resident"  # the two sources that are not pool copies


@pytest.fixture
def pool():
    p = colomem.PinnedPool("16MiB")
    assert p.pinned
    yield p
    p.close(force=True)


def split_bytes(expected: dict) -> tuple:
    """(bytes of the pool copies, of the pageable tensor, of the resident tensor)."""
    views = sum(nbytes(t) for n, t in expected.items() if n not in HOST_VIEWS)
    return views, nbytes(expected["pageable"]), nbytes(expected["resident"])


def test_pool_host_views_are_page_locked_and_classified_as_such(pool):
    swap, _, sources = offloaded_sources("cuda", pool)
    dev = torch.device("cuda", torch.cuda.current_device())
    kinds = {n: source_kind(t, dev) for n, t in sources if t.numel()}
    for n, t in sources:
        if n not in HOST_VIEWS and t.numel():
            assert t.is_pinned(), f"{n}: the pool's registered memory is not reported as page-locked"
            assert kinds[n] == PINNED, n
    assert kinds["pageable"] == TORCH and kinds["resident"] == LOCAL
    swap.reload()
    swap.close()


def test_host_views_pack_into_cuda_buckets_byte_for_byte(pool):
    swap, expected, sources = offloaded_sources("cuda", pool)
    plans = list(plan_buckets(sources, BUCKET))
    assert len(plans) > 2
    buffers = [torch.full((BUCKET,), 0xAB, dtype=torch.uint8, device="cuda") for _ in plans]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # as the bridge packs: on a stream of its own
        packed = [pack_bucket(p, b) for p, b in zip(plans, buffers)]
    side.synchronize()
    got = unpack(plans, buffers)
    assert set(got) == set(expected)
    for n, want in expected.items():
        assert same_bytes(got[n], want), n
    views, pageable, resident = split_bytes(expected)
    assert sum(p.pinned_bytes for p in packed) == views
    assert sum(p.torch_bytes for p in packed) == pageable
    assert sum(p.local_bytes for p in packed) == resident
    swap.reload()  # the pool copies were only read
    swap.close()


@pytest.mark.ipc
def test_bridge_sync_from_host_views_delivers_the_same_bytes(pool):
    from colomem.bridge import BridgeImporter, WeightBridge

    swap, expected, sources = offloaded_sources("cuda", pool, seed=3)
    with WeightBridge(bucket_bytes=BUCKET, buffers=2, device=0, checksum="full", timeout=60) as bridge:
        imp = BridgeImporter.connect(bridge.address, timeout=60)
        bridge.wait_for_importers(1, 60)
        got = {}

        def apply(d):  # what vLLM's worker does inside collective_rpc
            for name, t in imp.tensors(d, verify="full"):
                got[name] = t.clone()
            return {"version": d["version"], "seq": d["seq"], "ok": True}

        stats = bridge.sync(sources, version=1, send=apply)
        imp.close()
    assert set(got) == set(expected)
    for n, want in expected.items():
        assert same_bytes(got[n], want), n
    views, pageable, resident = split_bytes(expected)
    assert (stats.pinned_bytes, stats.torch_bytes, stats.local_bytes) == (views, pageable, resident)
    assert len(stats.buckets) == stats.messages > 2
    assert stats.pack_copy_seconds > 0
    swap.reload()
    swap.close()
