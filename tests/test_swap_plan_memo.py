"""A SwapSet reuses its last plan while its source yields tensors on the same storages, and plans again,
moving the right bytes, as soon as a tensor, a storage or its size changed."""
import pytest
import torch

import colomem
from colomem.errors import InvalidArgumentError
from colomem.swap import SwapSet
from random_bytes import random_tensor as _random_tensor


def random_tensor(shape, dtype, seed):
    return _random_tensor(shape, dtype, torch.Generator().manual_seed(seed))


@pytest.fixture
def pool():
    p = colomem.PinnedPool("8MiB")
    yield p
    p.close(force=True)


@pytest.fixture
def planned(monkeypatch):
    """Counts the full plans (the pass that checks every tensor)."""
    calls = []
    real = SwapSet._plan_items

    def counting(self, items, groups):
        calls.append(len(items))
        return real(self, items, groups)
    monkeypatch.setattr(SwapSet, "_plan_items", counting)
    return calls


def _cycle(s, tensors):
    before = [t.clone() for t in tensors]
    s.offload()
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    s.reload()
    # bytes, not values: random bytes hold NaNs
    assert all(torch.equal(t.view(torch.uint8), b.view(torch.uint8)) for t, b in zip(tensors, before))


def test_an_unchanged_source_is_planned_once(pool, planned):
    held = {f"w{i}": random_tensor((257 + i,), torch.bfloat16, seed=i) for i in range(12)}
    held["view"] = held["w0"][3:9]                              # a view: its storage moves once
    s = SwapSet.from_tensors(lambda: held, pool, name="memo", device="cpu")
    for _ in range(4):
        _cycle(s, list(held.values()))
    assert planned == [13]
    s.close()


@pytest.mark.parametrize("change", ["replaced", "data", "resized", "added", "dropped"])
def test_any_change_of_the_storages_plans_again_and_moves_the_new_bytes(pool, planned, change):
    held = {f"w{i}": random_tensor((300,), torch.float32, seed=i) for i in range(6)}
    s = SwapSet.from_tensors(lambda: held, pool, name="memo", device="cpu")
    _cycle(s, list(held.values()))
    if change == "replaced":                       # a new tensor object (a fresh gradient, new state)
        held["w2"] = random_tensor((300,), torch.float32, seed=99)
    elif change == "data":                         # the same object on another storage
        held["w3"].data = random_tensor((500,), torch.float32, seed=98)
    elif change == "resized":                      # the same storage, another size
        held["w4"].untyped_storage().resize_(4 * 600)
    elif change == "added":
        held["w6"] = random_tensor((64,), torch.float32, seed=97)
    else:
        del held["w5"]
    tensors = list(held.values())
    _cycle(s, tensors)
    assert len(planned) == 2
    _cycle(s, tensors)                             # and the new plan is reused in turn
    assert len(planned) == 2
    s.close()


def test_a_bad_item_after_a_reused_plan_is_refused_as_before(pool):
    held = [random_tensor((64,), torch.float32, seed=1), random_tensor((64,), torch.float32, seed=2)]
    s = SwapSet.from_tensors(lambda: held, pool, name="memo", device="cpu")
    _cycle(s, held)
    held[1] = "not a tensor"
    with pytest.raises(InvalidArgumentError, match="not a torch.Tensor"):
        s.offload()
    held[1] = random_tensor((64,), torch.float32, seed=3)
    _cycle(s, held)
    s.close()
