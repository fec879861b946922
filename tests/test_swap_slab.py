"""SwapSet's slabs on the host path: small storages re-homed onto shared slab storages keep every byte, every
tensor and Parameter object, their dtype, shape, strides and autograd versions; a storage with a holder outside
the set stays where it is and still round-trips; optimizer state on slabs drives AdamW bit for bit like state
never moved; the slabs hold no bytes while offloaded; failures part way leave a usable set."""

import copy

import pytest
import torch

import colomem
from colomem import swap_coalesce, swap_slab
from colomem.errors import InvalidArgumentError, PhaseOrderError, TransferTimeoutError
from random_bytes import random_tensor
from swap_faults import failing_engine  # noqa: F401  (fixture)

KiB = 1 << 10
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.complex64, torch.complex128]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES += [torch.float8_e4m3fn, torch.float8_e5m2]
PACK = swap_slab.PACK_SMALL_ON


def as_bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).clone() if t.numel() else torch.empty(0)


def key(t):
    return t.untyped_storage()._cdata


def mixed_set(n_small=300, seed=0):
    """Small tensors of every dtype at odd sizes, two large ones, views of one base, a non-contiguous tensor,
    a Parameter and an empty tensor: {name: tensor}."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n_small):
        out[f"small{i}"] = random_tensor((1 + (i * 37) % 997,), DTYPES[i % len(DTYPES)], gen)
    for i in range(2):
        out[f"large{i}"] = random_tensor((600 * KiB + 13 * i,), torch.int16, gen)  # > 1 MiB each
    base = random_tensor((64, 33), torch.float32, gen)
    out["base"], out["view_of_base"] = base, base[3:9, 1::2]
    out["as_int"] = base.view(torch.int32)[5:]  # another dtype over the same storage
    out["transposed"] = random_tensor((17, 29), torch.bfloat16, gen).t()
    out["param"] = torch.nn.Parameter(random_tensor((40, 3), torch.float32, gen))
    out["empty"] = torch.empty(0, dtype=torch.float16)
    return out


@pytest.fixture
def pool():
    p = colomem.PinnedPool("32MiB", pin=False)
    yield p
    p.close(force=True)


def small_names(tensors):
    return [k for k, v in tensors.items() if 0 < v.untyped_storage().nbytes() < PACK]


def cycle_and_check(s, tensors, cycles=3):
    before = {k: as_bytes(v) for k, v in tensors.items()}
    meta = {k: (id(v), v.dtype, v.shape, v.stride(), v._version) for k, v in tensors.items()}
    for _ in range(cycles):
        s.offload()
        assert all(v.untyped_storage().nbytes() == 0 for v in tensors.values())
        assert all(e.storage.nbytes() == 0 for e in s._entries)  # the slabs too
        s.reload()
        for k, v in tensors.items():
            assert (id(v), v.dtype, v.shape, v.stride(), v._version) == meta[k], k
            assert torch.equal(as_bytes(v), before[k]), k


def test_small_storages_share_slabs_and_keep_bytes_objects_and_layout(pool, monkeypatch):
    monkeypatch.setattr(swap_slab, "SLAB_BYTES", 64 * KiB)  # several slabs
    tensors = mixed_set()
    small = small_names(tensors)
    param = tensors["param"]
    offset_bytes = {k: v.storage_offset() * v.element_size() for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    cycle_and_check(s, tensors)
    slabs = {key(tensors[k]) for k in small}
    assert slabs == s._packer.slab_keys and len(slabs) > 3
    assert len(s._entries) == len(slabs) + 2  # the slabs and the two large storages
    assert {e.nbytes for e in s._entries if e.storage._cdata not in slabs} == {
        tensors["large0"].untyped_storage().nbytes(), tensors["large1"].untyped_storage().nbytes()}
    assert tensors["param"] is param and isinstance(param, torch.nn.Parameter) and param.requires_grad
    views = [tensors[k] for k in ("base", "view_of_base", "as_int")]
    assert len({key(v) for v in views}) == 1  # views of one storage moved together
    for e in s._entries:
        if e.storage._cdata in slabs:
            assert e.nbytes <= 64 * KiB + PACK
    for k in small:  # each old storage starts at an aligned offset of its slab, the tensor where it was in it
        t = tensors[k]
        assert (t.storage_offset() * t.element_size() - offset_bytes[k]) % swap_slab.ALIGN == 0, k


def test_a_storage_with_an_outside_holder_stays_off_the_slab_and_round_trips(pool):
    tensors = mixed_set(40)
    outside_view = tensors["small3"][1:]          # a view the set does not hold
    held = tensors["small4"].untyped_storage()    # a storage object held outside
    tensors["only_view"] = tensors.pop("small5")[2:]  # its base, reachable through ._base, moves along
    moved_base = torch.arange(12.0)
    tensors["view_of_moved_base"] = moved_base[4:]
    moved_base.data = torch.zeros(12)             # the view's ._base now uses another storage: it stays put
    x = torch.nn.Parameter(random_tensor((8,), torch.float32, torch.Generator().manual_seed(1)))
    tensors["saved"] = x
    alias = x.t()
    loss = (alias * alias).sum()                  # autograd keeps an alias of x's storage
    del alias
    x_before = x.detach().clone()
    stays = {k: key(tensors[k]) for k in ("small3", "small4")}
    outside_before = as_bytes(outside_view)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    cycle_and_check(s, tensors, cycles=2)
    for k, cdata in stays.items():
        assert key(tensors[k]) == cdata and cdata not in s._packer.slab_keys, k
    assert key(outside_view) == key(tensors["small3"]) and torch.equal(as_bytes(outside_view), outside_before)
    assert held._cdata == key(tensors["small4"])
    assert key(tensors["small6"]) in s._packer.slab_keys
    only_view = tensors["only_view"]
    assert key(only_view) in s._packer.slab_keys and key(only_view._base) == key(only_view)
    assert key(tensors["view_of_moved_base"]) in s._packer.slab_keys and key(moved_base) not in s._packer.slab_keys
    assert torch.equal(moved_base, torch.zeros(12)) and torch.equal(tensors["view_of_moved_base"],
                                                                    torch.arange(4.0, 12.0))
    assert key(x) not in s._packer.slab_keys
    loss.backward()                               # still works: x's version and bytes are unchanged
    del loss, held, outside_view
    s.offload(); s.reload()                       # the holders are gone: the next plan moves them
    assert {key(tensors[k]) for k in ("small3", "small4", "saved")} <= s._packer.slab_keys
    assert torch.equal(x.grad, 2 * x_before) and torch.equal(x.detach(), x_before)


def test_inference_tensors_and_dispatch_subclasses_stay_where_they_are(pool):
    class Logged(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        inf = torch.arange(50, dtype=torch.int32)
    tensors = {"inf": inf, "a": torch.ones(100), "b": torch.arange(30.0), "c": torch.zeros(7, dtype=torch.int64)}
    before = {k: as_bytes(v) for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    s.offload(); s.reload()
    assert key(inf) not in s._packer.slab_keys and key(tensors["a"]) in s._packer.slab_keys
    assert all(torch.equal(as_bytes(v), before[k]) for k, v in tensors.items())
    assert swap_slab._movable(torch.ones(2)) and not swap_slab._movable(torch.Tensor._make_subclass(
        Logged, torch.ones(2)))


def grads_for(params, step):
    """Gradients for a step, the same bytes for a model and its twin (no matmul: its results may depend on
    where the operands sit in memory, and this is about the optimizer)."""
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def adamw_step(model, opt, step, between=None):
    opt.zero_grad()  # set_to_none: every step's gradients are new tensors, off the slabs until the next offload
    for p, g in zip(model.parameters(), grads_for(list(model.parameters()), step)):
        p.grad = g
    if between is not None:
        between()
    opt.step()


def test_adamw_on_slabs_steps_bit_identically_to_state_never_moved(pool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(6)], torch.nn.LayerNorm(24))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adamw_step(model, opt, 0)
    twin, twin_opt = copy.deepcopy((model, opt))
    params = list(model.parameters())
    state_objs = [v for st in opt.state.values() for v in st.values()]
    sets = [colomem.SwapSet.from_module(model, pool, device="cpu", grads=True, pack_small=PACK),
            colomem.SwapSet.from_optimizer(opt, pool, device="cpu", pack_small=PACK)]
    def cycle():  # the step reads gradients, parameters and moments that sit on slabs
        with colomem.offloaded(*sets):
            assert all(p.untyped_storage().nbytes() == 0 for p in params)
        on = {key(p) for p in params} | {key(p.grad) for p in params}  # this step's gradients: a slab of their own
        assert len({key(p) for p in params}) == 1 and on <= sets[0]._packer.slab_keys
        assert len(sets[0]._packer.slab_keys) == len(on) <= 2  # the last step's gradient slab is gone
        assert len({key(v) for v in state_objs}) == 1 and key(state_objs[0]) in sets[1]._packer.slab_keys

    for step in range(1, 5):
        adamw_step(model, opt, step, between=cycle)
        adamw_step(twin, twin_opt, step)
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert all(v is w for v, w in zip((v for st in opt.state.values() for v in st.values()), state_objs))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(as_bytes(p), as_bytes(q))
    for a, b in zip(opt.state.values(), twin_opt.state.values()):
        assert all(torch.equal(as_bytes(a[k]), as_bytes(b[k])) for k in a)


def test_host_view_and_host_storage_read_a_rehomed_tensor_while_offloaded(pool):
    tensors = mixed_set(60)
    want = {k: v.detach().clone() for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    s.offload()
    for k in ("small3", "small17", "small42", "transposed", "view_of_base", "as_int", "param", "large1"):
        hv = s.host_view(tensors[k])
        assert hv.shape == want[k].shape and hv.stride() == tensors[k].stride()
        assert torch.equal(as_bytes(hv), as_bytes(want[k])), k
    raw = s.host_storage(tensors["small5"])  # the tensor's storage is its slab: the whole slab
    slab = next(e for e in s._entries if e.storage._cdata == key(tensors["small5"]))
    assert raw.numel() == slab.nbytes
    t = tensors["small5"]
    at = t.storage_offset() * t.element_size()
    assert torch.equal(raw[at:at + t.nbytes], as_bytes(want["small5"]))
    s.reload()
    assert s.host_view(tensors["small3"]) is None


def test_new_and_replaced_tensors_are_planned_and_dead_slabs_dropped(pool):
    tensors = mixed_set(50)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    s.offload(); s.reload()
    first = set(s._packer.slab_keys)
    assert s._packer._seen is not None  # nothing left behind: the next plan can skip the pass
    tensors["new_a"], tensors["new_b"] = torch.arange(77, dtype=torch.int16), torch.full((9,), 3.5)
    with torch.no_grad():
        tensors["small7"].data = torch.arange(tensors["small7"].numel()).to(tensors["small7"].dtype)
    cycle_and_check(s, tensors, cycles=2)
    assert key(tensors["new_a"]) == key(tensors["new_b"]) and key(tensors["new_a"]) not in first
    # every tensor replaced: the set's plan holds the new storages only, no slab that no tensor uses
    for k in list(tensors):
        tensors[k] = tensors[k].detach().clone()
    cycle_and_check(s, tensors, cycles=1)
    held = {key(v) for v in tensors.values() if v.untyped_storage().nbytes()}
    assert {e.storage._cdata for e in s._entries} == held and s._packer.slab_keys <= held


def test_a_set_with_one_small_storage_moves_it_on_its_own(pool):
    t = torch.arange(10.0)
    s = colomem.SwapSet.from_tensors([t, torch.zeros(600 * KiB, dtype=torch.int16)], pool, device="cpu",
                                     pack_small=PACK)
    k = key(t)
    cycle_and_check(s, {"t": t}, cycles=2)
    assert key(t) == k and not s._packer.slab_keys


@pytest.mark.parametrize("bad", [-1, 1.5, "1MiB"])
def test_bad_pack_small_is_refused(pool, bad):
    with pytest.raises(InvalidArgumentError, match="pack_small"):
        colomem.SwapSet.from_tensors([torch.ones(3)], pool, device="cpu", pack_small=bad)


def test_discard_and_close_with_slabs(pool):
    tensors = mixed_set(30)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK, keep_blocks=False)
    s.offload()
    with pytest.raises(PhaseOrderError):
        s.close()
    s.discard()
    assert s.state == "discarded" and all(v.untyped_storage().nbytes() == 0 for v in tensors.values())
    s.close()
    assert pool.stats()["in_use_bytes"] == 0


def test_a_timed_out_wait_frees_nothing_and_can_wait_again(pool):
    big = colomem.PinnedPool(0, pin=False)
    gen = torch.Generator().manual_seed(2)
    tensors = {f"t{i}": random_tensor((16 * KiB,), torch.int32, gen) for i in range(2048)}  # 128 MiB
    want = {k: as_bytes(v) for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, big, device="cpu", pack_small=PACK)
    h = s.offload_async()
    with pytest.raises(TransferTimeoutError):
        h.wait(timeout=0)
    assert all(e.storage.nbytes() == e.nbytes for e in s._entries)  # nothing freed before the copy ended
    h.wait(timeout=60)
    s.reload()
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in tensors.items())
    s.close()
    big.close()


def test_swap_and_unordered_reload_of_slab_sets(pool):
    a, b = mixed_set(80, seed=1), mixed_set(80, seed=2)
    want_a, want_b = ({k: as_bytes(v) for k, v in t.items()} for t in (a, b))
    sa = colomem.SwapSet.from_tensors(a, pool, device="cpu", pack_small=PACK, name="a")
    sb = colomem.SwapSet.from_tensors(b, pool, device="cpu", pack_small=PACK, name="b")
    sb.offload()
    colomem.swap(offload=sa, reload=sb)
    colomem.swap(offload=sb, reload=sa)
    pending = colomem.PendingReloads()
    pending.add(sb.reload_async(ordered=False))
    pending.wait(60)
    for t, want in ((a, want_a), (b, want_b)):
        assert all(torch.equal(as_bytes(v), want[k]) for k, v in t.items())
    assert sa._packer.slab_keys and sb._packer.slab_keys


def test_with_coalescing_the_storages_left_off_the_slabs_move_in_chunks(pool):
    tensors = mixed_set(80)
    keep = [tensors[f"small{i}"][1:] for i in range(0, 80, 4)]  # outside views: these stay off the slabs
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK,
                                     coalesce_below=swap_coalesce.COALESCE_BELOW_ON)
    cycle_and_check(s, tensors, cycles=2)
    assert s._layout.chunks and s._packer.slab_keys
    assert all(key(tensors[f"small{i}"]) not in s._packer.slab_keys for i in range(0, 80, 4))
    del keep


def test_no_room_for_a_slab_leaves_the_storages_where_they_are(pool, monkeypatch):
    tensors = mixed_set(40)
    keys = {k: key(v) for k, v in tensors.items()}

    def full(self, batch, device, n):
        raise torch.OutOfMemoryError("no room for the slab")

    monkeypatch.setattr(swap_slab.Packer, "_rehome", full)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    cycle_and_check(s, tensors, cycles=2)
    assert {k: key(v) for k, v in tensors.items()} == keys and not s._packer.slab_keys
    monkeypatch.undo()
    cycle_and_check(s, tensors, cycles=1)  # room again: the next offload packs them
    assert s._packer.slab_keys


def test_a_failed_first_offload_leaves_the_rehomed_tensors_resident_and_intact(pool, failing_engine):
    arm, disarm = failing_engine
    tensors = mixed_set(100)
    before = {k: as_bytes(v) for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    arm(1)
    with pytest.raises(InvalidArgumentError, match="injected"):
        s.offload()
    disarm()
    assert s.state == "resident" and pool.stats()["in_use_bytes"] == 0
    assert s._packer.slab_keys and key(tensors["small1"]) in s._packer.slab_keys  # re-homed before the copy
    assert all(torch.equal(as_bytes(v), before[k]) for k, v in tensors.items())
    cycle_and_check(s, tensors, cycles=2)


def test_a_failed_reload_leaves_the_slabs_offloaded_with_their_bytes_in_the_pool(pool, failing_engine):
    arm, disarm = failing_engine
    tensors = mixed_set(100)
    before = {k: as_bytes(v) for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    s.offload(); s.reload()
    s.offload()
    arm(1)
    with pytest.raises(InvalidArgumentError, match="injected"):
        s.reload()
    disarm()
    assert s.state == "offloaded" and all(e.storage.nbytes() == 0 for e in s._entries)
    assert torch.equal(as_bytes(s.host_view(tensors["small9"])), before["small9"])
    s.reload()
    assert all(torch.equal(as_bytes(v), before[k]) for k, v in tensors.items())
    cycle_and_check(s, tensors, cycles=1)


def test_an_unchanged_set_skips_the_plan_pass_and_a_changed_one_does_not(pool, monkeypatch):
    tensors = mixed_set(60)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    passes = []
    real = colomem.SwapSet._plan
    monkeypatch.setattr(colomem.SwapSet, "_plan", lambda self, *a, **kw: passes.append(1) or real(self, *a, **kw))
    cycle_and_check(s, tensors, cycles=3)
    assert len(passes) == 1  # the first offload; later ones found every tensor where it left them
    tensors["small9"] = torch.arange(5, dtype=torch.int64)  # another storage at the same place in the source
    cycle_and_check(s, tensors, cycles=2)
    assert len(passes) == 2
    tensors["small9"].set_(torch.zeros(5, dtype=torch.int64).untyped_storage())  # a storage swapped in place
    cycle_and_check(s, tensors, cycles=1)
    assert len(passes) == 3 and key(tensors["small9"]) in {e.storage._cdata for e in s._entries}


def test_two_threads_offloading_one_set_rehome_once(pool):
    import threading

    tensors = mixed_set(200)
    want = {k: as_bytes(v) for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", pack_small=PACK)
    start, errors, done = threading.Barrier(2), [], []

    def go():
        start.wait()
        try:
            done.append(s.offload())
        except PhaseOrderError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(done) == 1 and len(errors) == 1 and s.state == "offloaded"  # the other found it busy or done
    s.reload()
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in tensors.items())
