"""GPU-only swap behaviours: memory really back with the driver, no growth over cycles, overlap with compute."""

import gc

import pytest
import torch

import colomem

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def driver_free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_offload_returns_memory_to_the_driver():
    # cuBLAS keeps a workspace for the process once it ran; create it before the baseline
    w = torch.nn.Linear(64, 64, dtype=torch.bfloat16).cuda()
    w(torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    del w
    torch.cuda.empty_cache()
    baseline = driver_free()
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, dtype=torch.bfloat16) for _ in range(16)]).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    torch.cuda.empty_cache()  # the backward's temporaries are cached, not live: they are not the sets' bytes
    used = baseline - driver_free()
    assert used > 1000 * MiB
    pool = colomem.PinnedPool("2GiB")
    sets = [colomem.SwapSet.from_module(model, pool, grads=True), colomem.SwapSet.from_optimizer(opt, pool)]
    for s in sets:
        s.offload()
    assert abs(driver_free() - baseline) <= 64 * MiB, "offloaded memory must be back with the driver"
    for s in sets:
        s.reload()
    assert baseline - driver_free() >= used - 64 * MiB
    for s in sets:
        s.close()
    pool.close()


def test_two_hundred_cycles_no_growth():
    torch.cuda.empty_cache()
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    ref = [p.detach().clone() for p in model.parameters()]
    pool = colomem.PinnedPool("64MiB")
    s = colomem.SwapSet.from_module(model, pool)
    s.offload(); s.reload()
    free0, pool0 = driver_free(), pool.stats()
    for _ in range(200):
        s.offload()
        s.reload()
    gc.collect()
    free1, pool1 = driver_free(), pool.stats()
    assert abs(free1 - free0) <= 8 * MiB
    assert pool1["reserved_bytes"] == pool0["reserved_bytes"] and pool1["in_use_bytes"] == pool0["in_use_bytes"]
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref))
    s.close()
    pool.close()


def test_bidirectional_swap_while_compute_runs_on_the_default_stream():
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = [torch.randn(8 * MiB, device="cuda", generator=gen) for _ in range(4)]  # 128 MiB
    b = [torch.randn(8 * MiB, device="cuda", generator=gen) for _ in range(4)]
    a_ref = [t.clone() for t in a]
    b_ref = [t.clone() for t in b]
    pool = colomem.PinnedPool("512MiB")
    sa = colomem.SwapSet.from_tensors(a, pool, name="a")
    sb = colomem.SwapSet.from_tensors(b, pool, name="b")
    sb.offload()
    x = torch.randn(4096, 4096, device="cuda", generator=gen)
    for _ in range(3):
        # queue work that writes `a` right before the swap: the D2H must see its final values
        for t in a:
            t.mul_(2.0)
        busy = x
        for _ in range(20):
            busy = busy @ x / 64.0  # keeps the SMs busy while both copy streams run
        colomem.swap(offload=sa, reload=sb)
        # kernels queued after the reload see the restored bytes
        sums = [t.sum() for t in b]
        colomem.swap(offload=sb, reload=sa)
        a_ref = [t * 2.0 for t in a_ref]
        assert all(torch.equal(t, r) for t, r in zip(a, a_ref))
        assert all(torch.allclose(s, r.sum()) for s, r in zip(sums, b_ref))
        assert torch.isfinite(busy).all()
    sb.reload()
    sa.close(); sb.close()
    pool.close()


def test_reload_oom_rolls_back_and_keeps_the_data():
    t = torch.randn(256 * MiB // 4, device="cuda")
    ref = t.cpu()
    pool = colomem.PinnedPool("256MiB")
    s = colomem.SwapSet.from_tensors([t], pool)
    s.offload()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - 128 * MiB, dtype=torch.uint8, device="cuda")  # leave too little for the reload
    with pytest.raises(colomem.CudaOutOfMemoryError, match="reload needs"):
        s.reload()
    assert s.state == "offloaded" and t.untyped_storage().nbytes() == 0
    del hog
    torch.cuda.empty_cache()
    s.reload()
    assert torch.equal(t.cpu(), ref)
    s.close()
    pool.close()


def test_other_device_tensor_is_refused():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    s = colomem.SwapSet.from_tensors([torch.ones(3, device="cuda:0"), torch.ones(3, device="cuda:1")])
    with pytest.raises(colomem.DeviceMismatchError):
        s.offload()


def test_pool_of_16gb_is_pinned():
    pool = colomem.PinnedPool("16GiB")
    st = pool.stats()
    assert st["pinned"] and st["reserved_bytes"] == 16 << 30
    b = pool.alloc(1 << 30)
    host = b.as_tensor()
    assert host.is_pinned()
    b.release()
    pool.close()
