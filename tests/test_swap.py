"""SwapSet behaviour, one body per behaviour, run on the host path and (marked gpu) on CUDA."""

import copy
import gc

import pytest
import torch

import colomem
from random_bytes import random_tensor
from colomem.errors import (DeviceMismatchError, ForeignTensorError, PhaseOrderError, PoolClosedError,
                            PoolExhaustedError, TransferTimeoutError)

DEVICES = [pytest.param("cpu", id="host"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.complex64]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def as_bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().clone() if t.numel() else torch.empty(0)


@pytest.fixture
def pool():
    p = colomem.PinnedPool("8MiB")
    yield p
    p.close(force=True)


@pytest.mark.parametrize("device", DEVICES)
def test_exact_bytes_round_trip_all_dtypes_odd_sizes(device, pool):
    gen = torch.Generator().manual_seed(0)
    shapes = [(1,), (3,), (7, 5), (1023,), (33, 17, 3), (0,), (4097,)]
    tensors = {f"{dt}-{s}": random_tensor(s, dt, gen, device) for dt in DTYPES for s in shapes}
    before = {k: as_bytes(v) for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool, device=device)
    for _ in range(3):
        s.offload()
        assert all(v.untyped_storage().nbytes() == 0 for v in tensors.values())
        s.reload()
        for k, v in tensors.items():
            assert torch.equal(as_bytes(v), before[k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_views_and_optimizer_keep_identity(device, pool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16, device=device)
    model(x).square().mean().backward()
    opt.step()
    params = list(model.parameters())
    view = params[0][2:5, ::3]  # a non-contiguous view into a parameter
    snapshot = [p.detach().clone() for p in params]
    view_before, view_stride = view.clone(), view.stride()
    state_before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    sets = [colomem.SwapSet.from_module(model, pool, device=device, grads=True),
            colomem.SwapSet.from_optimizer(opt, pool, device=device)]
    with colomem.offloaded(*sets):
        assert params[0].untyped_storage().nbytes() == 0
    assert [p is q for p, q in zip(model.parameters(), params)] == [True] * len(params)
    assert all(torch.equal(p, q) for p, q in zip(params, snapshot))
    assert torch.equal(view, view_before) and view.stride() == view_stride
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in state_before.items())
    # training continues exactly like a model that was never offloaded
    twin, twin_opt = copy.deepcopy((model, opt))  # one memo: the copy's optimizer holds the copy's params
    with colomem.offloaded(*sets):
        pass
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("device", DEVICES)
def test_shared_storage_moves_once(device, pool):
    flat = torch.arange(100, dtype=torch.float32, device=device)
    a, b = flat[:50], flat[50:].view(5, 10)
    s = colomem.SwapSet.from_tensors([a, b, flat], pool, device=device)
    s.offload()
    assert s.nbytes == 400 and len(s._entries) == 1
    s.reload()
    assert torch.equal(b[0], torch.arange(50, 60, dtype=torch.float32, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_callable_source_picks_up_new_tensors(device, pool):
    p = torch.nn.Parameter(torch.ones(10, device=device))
    s = colomem.SwapSet.from_tensors(lambda: [p] + ([p.grad] if p.grad is not None else []), pool, device=device)
    s.offload(); s.reload()
    assert s.nbytes == 40
    (p * 2).sum().backward()
    s.offload()
    assert s.nbytes == 80 and p.grad.untyped_storage().nbytes() == 0
    s.reload()
    assert torch.equal(p.grad, torch.full((10,), 2.0, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_second_cycle_allocates_nothing(device, pool):
    t = torch.randn(1000, device=device)
    s = colomem.SwapSet.from_tensors([t], pool, device=device)
    s.offload(); s.reload()
    allocs = pool.stats()["allocs"]
    for _ in range(5):
        s.offload(); s.reload()
    assert pool.stats()["allocs"] == allocs
    s.close()
    assert pool.stats()["in_use_bytes"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_bidirectional_swap(device, pool):
    gen = torch.Generator().manual_seed(1)
    a = [random_tensor((513, 7), torch.float32, gen, device) for _ in range(3)]
    b = [random_tensor((1001,), torch.bfloat16, gen, device) for _ in range(4)]
    a_bytes, b_bytes = [as_bytes(t) for t in a], [as_bytes(t) for t in b]
    sa = colomem.SwapSet.from_tensors(a, pool, device=device, name="a")
    sb = colomem.SwapSet.from_tensors(b, pool, device=device, name="b")
    sb.offload()
    out, inn = colomem.swap(offload=sa, reload=sb)
    assert (out.direction, inn.direction) == ("d2h", "h2d")
    assert sa.state == "offloaded" and sb.state == "resident"
    assert all(torch.equal(as_bytes(t), x) for t, x in zip(b, b_bytes))
    colomem.swap(offload=sb, reload=sa)
    assert all(torch.equal(as_bytes(t), x) for t, x in zip(a, a_bytes))


@pytest.mark.parametrize("device", DEVICES)
def test_pool_exhausted_leaves_tensors_intact(device):
    small = colomem.PinnedPool(0, max_bytes="1MiB", segment_bytes="1MiB")
    keep = torch.randn(100_000, device=device)
    big = torch.randn(300_000, device=device)  # 1.2 MB: does not fit after `keep`
    before = big.clone()
    s = colomem.SwapSet.from_tensors([keep, big], small, device=device)
    with pytest.raises(PoolExhaustedError, match="max_bytes"):
        s.offload()
    assert s.state == "resident" and torch.equal(big, before)
    assert small.stats()["in_use_bytes"] == 0  # blocks taken before the failure were given back
    small.close()


@pytest.mark.parametrize("device", DEVICES)
def test_order_errors(device, pool):
    s = colomem.SwapSet.from_tensors([torch.ones(4, device=device)], pool, device=device)
    with pytest.raises(PhaseOrderError, match="offload it first"):
        s.reload()
    s.offload()
    with pytest.raises(PhaseOrderError, match="reload"):
        s.offload()
    with pytest.raises(PhaseOrderError, match="no data is lost"):
        s.close()
    s.reload()


@pytest.mark.parametrize("device", DEVICES)
def test_reload_after_pool_closed_is_refused(device):
    p = colomem.PinnedPool("1MiB")
    s = colomem.SwapSet.from_tensors([torch.ones(4, device=device)], p, device=device)
    s.offload()
    p.close(force=True)
    with pytest.raises(PoolClosedError, match="closed"):
        s.reload()


@pytest.mark.parametrize("device", DEVICES)
def test_wait_times_out_and_can_be_retried(device):
    p = colomem.PinnedPool("512MiB")
    t = torch.ones(128 << 20, dtype=torch.uint8, device=device) * 7
    s = colomem.SwapSet.from_tensors([t], p, device=device)
    h = s.offload_async()
    with pytest.raises(TransferTimeoutError, match="wait again") as ei:
        h.wait(timeout=0)
    assert isinstance(ei.value, TimeoutError)
    assert t.untyped_storage().nbytes() == 128 << 20  # nothing freed before the copy completed
    h.wait(timeout=60)
    s.reload()
    assert int(t.min()) == 7 == int(t.max())
    s.close()
    p.close()


def test_cpu_tensor_in_a_cuda_set_is_refused(pool):
    with pytest.raises(DeviceMismatchError, match="device='cpu'"):
        colomem.SwapSet.from_tensors([torch.ones(3)], pool).offload()


def test_mixed_devices_are_refused(pool):
    s = colomem.SwapSet.from_tensors([torch.ones(3), torch.ones(3, device="meta")], pool, device="cpu")
    with pytest.raises(colomem.InvalidArgumentError):
        s.offload()


def test_foreign_memory_is_refused(pool):
    buf = bytearray(64)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    with pytest.raises(ForeignTensorError, match="cannot free"):
        s.offload()
    assert s.state == "resident"


def test_not_a_tensor_is_refused(pool):
    with pytest.raises(colomem.InvalidArgumentError, match="not a torch.Tensor"):
        colomem.SwapSet.from_tensors([[1, 2, 3]], pool, device="cpu").offload()


def test_offloaded_context_reloads_on_error(pool):
    t = torch.arange(10.0)
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    with pytest.raises(KeyError):
        with colomem.offloaded(s):
            raise KeyError("boom")
    assert s.state == "resident" and torch.equal(t, torch.arange(10.0))


def test_many_cycles_do_not_grow_the_pool(pool):
    model = torch.nn.Linear(64, 64)
    s = colomem.SwapSet.from_module(model, pool, device="cpu")
    s.offload(); s.reload()
    before = pool.stats()
    for _ in range(200):
        s.offload(); s.reload()
    gc.collect()
    after = pool.stats()
    assert after["reserved_bytes"] == before["reserved_bytes"]
    assert after["in_use_bytes"] == before["in_use_bytes"]


@pytest.mark.parametrize("device", DEVICES)
def test_host_view_reads_the_offloaded_copy(device, pool):
    base = torch.arange(60, dtype=torch.float32, device=device).reshape(6, 10)
    view = base[1:4, ::2]
    other = torch.ones(3, device=device)
    s = colomem.SwapSet.from_tensors([base, view], pool, device=device)
    s.offload()
    hv = s.host_view(view)
    assert hv.device.type == "cpu" and hv.shape == view.shape and hv.stride() == view.stride()
    assert torch.equal(hv, torch.arange(60, dtype=torch.float32).reshape(6, 10)[1:4, ::2])
    assert s.host_view(other) is None
    s.reload()
    assert s.host_view(view) is None  # resident: no offloaded copy to read


@pytest.mark.parametrize("device", DEVICES)
def test_discard_drops_the_copy_and_allows_close(device):
    p = colomem.PinnedPool("1MiB")
    t = torch.ones(1000, device=device)
    s = colomem.SwapSet.from_tensors([t], p, device=device)
    s.offload()
    with pytest.raises(PhaseOrderError, match="discard"):
        s.close()
    s.discard()
    assert s.state == "discarded" and t.untyped_storage().nbytes() == 0
    s.close()
    assert p.stats()["in_use_bytes"] == 0
    p.close()
