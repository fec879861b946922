"""GPU slabs: a 20,000-tensor mixed-dtype set re-homed onto slabs keeps every byte and object over offload and
reload, its memory goes back to the driver while offloaded, ordered=False and swap() order correctly, a storage
with an outside view stays off the slabs, and AdamW's CUDA kernels step state on slabs bit for bit like state
never moved."""

import copy

import pytest
import torch

import colomem
from colomem import swap_slab
from colomem.bench.transfer import make_small_set
from _swap_gpu import as_bytes, driver_free, pool  # noqa: F401  (pool: a fixture)

pytestmark = pytest.mark.gpu
MiB = 1 << 20
PACK = swap_slab.PACK_SMALL_ON


def key(t):
    return t.untyped_storage()._cdata


def test_twenty_thousand_small_tensors_on_slabs_round_trip_and_free_their_memory(pool):
    tensors = make_small_set(20000, "cuda", seed=3)
    tensors["large"] = torch.randint(-2**31, 2**31 - 1, (8 * MiB,), dtype=torch.int32, device="cuda")
    ids = {k: id(v) for k, v in tensors.items()}
    want = {k: as_bytes(v) for k, v in tensors.items()}
    nbytes = sum(t.nbytes for t in tensors.values())
    torch.cuda.empty_cache()
    s = colomem.SwapSet.from_tensors(tensors, pool, pack_small=PACK)
    for cycle in range(3):
        free0 = driver_free()
        s.offload()
        slabs = s._packer.slab_keys
        assert len(slabs) >= 2 and len(s._entries) == len(slabs) + 1  # the slabs and the large tensor
        assert all(key(v) in slabs for k, v in tensors.items() if k != "large")
        assert all(e.storage.nbytes() == 0 for e in s._entries)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
        assert driver_free() - free0 >= 0.95 * nbytes, f"cycle {cycle}: memory not back with the driver"
        s.reload()
        torch.cuda.synchronize()
        for k, v in tensors.items():
            assert id(v) == ids[k] and torch.equal(as_bytes(v), want[k]), k
    s.close()


def test_unordered_reload_and_swap_of_slab_sets_read_the_copied_bytes(pool):
    a, b = make_small_set(3000, "cuda", seed=4), make_small_set(3000, "cuda", seed=5)
    want_a, want_b = ({k: as_bytes(v) for k, v in t.items()} for t in (a, b))
    sa = colomem.SwapSet.from_tensors(a, pool, name="a", pack_small=PACK)
    sb = colomem.SwapSet.from_tensors(b, pool, name="b", pack_small=PACK)
    sb.offload()
    colomem.swap(offload=sa, reload=sb, timing=True)
    # read on the current stream right after swap(): it waited for the reload of b
    assert all(torch.equal(as_bytes(v), want_b[k]) for k, v in b.items())
    colomem.swap(offload=sb, reload=sa)
    assert sa._packer.slab_keys and sb._packer.slab_keys
    sb_reload = colomem.PendingReloads()
    sb_reload.add(sb.reload_async(ordered=False))
    sb_reload.wait(60)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # another stream reads only after the handle's wait: the copy is done
        ok = all(torch.equal(as_bytes(v), want_b[k]) for k, v in b.items())
    assert ok and all(torch.equal(as_bytes(v), want_a[k]) for k, v in a.items())
    sa.close(), sb.close()


def test_a_storage_with_an_outside_view_stays_off_the_slabs(pool):
    tensors = make_small_set(200, "cuda", seed=6)
    outside = tensors["small.7"][3:]
    stays = key(tensors["small.7"])
    want = {k: as_bytes(v) for k, v in tensors.items()}
    outside_want = as_bytes(outside)
    s = colomem.SwapSet.from_tensors(tensors, pool, pack_small=PACK)
    for _ in range(2):
        s.offload()
        assert tensors["small.7"].untyped_storage().nbytes() == 0
        assert torch.equal(as_bytes(s.host_view(tensors["small.9"])), want["small.9"])
        s.reload()
        torch.cuda.synchronize()
        assert key(tensors["small.7"]) == stays and stays not in s._packer.slab_keys
        assert key(tensors["small.8"]) in s._packer.slab_keys
        assert all(torch.equal(as_bytes(v), want[k]) for k, v in tensors.items())
        assert torch.equal(as_bytes(outside), outside_want)
    s.close()


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_adamw_cuda_kernels_step_slab_state_bit_identically(pool, impl):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)], torch.nn.LayerNorm(64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{impl: True})

    def step(m, o, i, between=None):
        o.zero_grad()
        gen = torch.Generator(device="cuda").manual_seed(i)
        for p in m.parameters():  # the same gradients for both (no matmul: this is about the optimizer)
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        if between is not None:
            between()
        o.step()

    step(model, opt, 0)
    twin, twin_opt = copy.deepcopy((model, opt))
    sets = [colomem.SwapSet.from_module(model, pool, grads=True, pack_small=PACK),
            colomem.SwapSet.from_optimizer(opt, pool, pack_small=PACK)]

    def cycle():
        with colomem.offloaded(*sets):
            pass
        moments = [v for st in opt.state.values() for v in st.values() if v.is_cuda]
        assert key(moments[0]) in sets[1]._packer.slab_keys
        assert key(next(model.parameters())) in sets[0]._packer.slab_keys

    for i in range(1, 4):
        step(model, opt, i, between=cycle)
        step(twin, twin_opt, i)
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(as_bytes(p), as_bytes(q))
    for a, b in zip(opt.state.values(), twin_opt.state.values()):
        assert all(torch.equal(as_bytes(a[k]), as_bytes(b[k])) for k in a)
    for s in sets:
        s.close()
