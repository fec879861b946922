"""The sampling noise drawn for every seeded request of a decode step at once (csrc/core/seeded_noise.h,
colomem/engines/vllm/worker/seeded_noise.py): Philox4x32-10 against its published answers, the values the
host core writes, the exponential distribution, and the patched sampler on a stand-in of vLLM's module."""
import math
import types

import pytest
import torch

from colomem.engines.vllm.worker import seeded_noise as sn
from colomem.errors import InvalidArgumentError
from fakes.vllm import fake_vllm  # noqa: F401  (fixture: vLLM's modules stubbed)

MASK = 0xFFFFFFFF


def philox(ctr, key):
    """Philox4x32-10 written from its paper, to check the core's against."""
    c, (k0, k1) = list(ctr), key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c[3] ^ k1) & MASK, p0 & MASK]
    return c


def expected(seed, offset, vocab):
    seed &= (1 << 64) - 1
    out = []
    for quad in range((vocab + 3) // 4):
        words = philox([quad & MASK, quad >> 32, offset & MASK, offset >> 32], [seed & MASK, seed >> 32])
        out += [-math.log(((w >> 9) + 0.5) / 2 ** 23) for w in words]
    return out[:vocab]


def test_the_reference_matches_philox_published_answers():
    assert philox([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox([MASK] * 4, [MASK] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert philox([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]) == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.parametrize("seed,offset", [(0, 0), (12345, 8), (-1, 4 * 7), (2 ** 40 + 3, 2 ** 33)])
def test_the_core_writes_the_reference_values_into_the_rows_asked(seed, offset):
    q = torch.full((3, 11), -7.0)
    meta = torch.tensor([[1], [seed], [offset]], dtype=torch.int64)
    sn.exponential_rows(q, meta)
    assert torch.allclose(q[1], torch.tensor(expected(seed, offset, 11)), rtol=1e-5, atol=1e-6)  # float32 log
    assert (q[0] == -7).all() and (q[2] == -7).all()          # other rows untouched


def test_a_row_depends_on_its_seed_and_offset_only():
    a = torch.zeros(4, 1000)
    b = torch.zeros(2, 1000)
    sn.exponential_rows(a, torch.tensor([[0, 3], [5, 6], [0, 4]]))
    sn.exponential_rows(b, torch.tensor([[1, 0], [5, 6], [0, 4]]))       # other rows, other batch
    assert torch.equal(a[0], b[1]) and torch.equal(a[3], b[0])
    c = torch.zeros(1, 1000)
    sn.exponential_rows(c, torch.tensor([[0], [5], [4]]))                   # the next draw differs
    assert not torch.equal(a[0], c[0])


def test_the_noise_is_exponential_and_never_zero_or_infinite():
    q = torch.zeros(64, 40_000)
    sn.exponential_rows(q, torch.stack([torch.arange(64), torch.arange(64) * 7919, torch.zeros(64, dtype=torch.long)]))
    assert torch.isfinite(q).all() and (q > 0).all()
    assert abs(q.mean().item() - 1.0) < 0.01 and abs(q.var().item() - 1.0) < 0.02
    for t in (0.5, 1.0, 3.0):                                  # P(q > t) = exp(-t)
        assert abs((q > t).double().mean().item() - math.exp(-t)) < 0.005


def test_the_uniform_stays_inside_0_and_1_in_float32_for_every_23_bit_value():
    import numpy as np

    k = np.arange(2 ** 23, dtype=np.float32)                 # what the core computes, in float32 as it does
    u = (k + np.float32(0.5)) * np.float32(1.0 / 8388608.0)
    assert u.dtype == np.float32 and u.min() > 0 and u.max() < 1
    assert (-np.log(u)).min() > 0 and np.isfinite(-np.log(u)).all()


def test_bad_input_is_refused_before_anything_is_written():
    q = torch.zeros(2, 8)
    with pytest.raises(InvalidArgumentError, match="outside"):
        sn.exponential_rows(q, torch.tensor([[2], [0], [0]]))
    with pytest.raises(InvalidArgumentError, match="float32"):
        sn.exponential_rows(q.double(), torch.tensor([[0], [0], [0]]))
    with pytest.raises(InvalidArgumentError, match="int64"):
        sn.exponential_rows(q, torch.tensor([[0.0], [0.0], [0.0]]))
    assert (q == 0).all()


class Gen:
    """What the batched draw reads of a torch CUDA generator: its seed and its Philox offset."""

    def __init__(self, seed, offset=0):
        self.seed, self.offset = seed, offset

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, v):
        self.offset = v


def sampler_module():
    calls = []

    def random_sample(probs, generators, use_fp64_gumbel=False):
        calls.append(len(generators))
        return probs.argmax(dim=-1)

    def sample_with_exponential_noise(probs, q):
        return (probs / q).argmax(dim=-1).view(-1)

    return types.SimpleNamespace(random_sample=random_sample,
                                 sample_with_exponential_noise=sample_with_exponential_noise), calls


def test_the_patched_sampler_draws_seeded_rows_by_seed_and_moves_their_offsets_like_torch():
    mod, calls = sampler_module()
    assert sn.install(mod) and sn.installed(mod) and sn.install(mod)     # twice: still one wrapper
    probs = torch.tensor([[0.25, 0.75]] * 6)
    gens = {i: Gen(1000 + i) for i in range(0, 6, 2)}                   # rows 0, 2, 4 seeded
    counts = torch.zeros(6, 2)
    for _ in range(4000):
        tok = mod.random_sample(probs.clone(), gens)
        counts[torch.arange(6), tok] += 1
    assert calls == []                                                  # vLLM's loop never ran
    freq = counts[:, 1] / counts.sum(1)
    assert ((freq - 0.75).abs() < 0.03).all()                          # sampled with the right probabilities
    assert [g.offset for g in gens.values()] == [4 * 4000] * 3
    again = {i: Gen(1000 + i) for i in range(0, 6, 2)}
    t1 = mod.random_sample(probs.clone(), again)
    for g in again.values():
        g.set_offset(g.get_offset() - sn.ROW_OFFSET)                   # vLLM's rewind of a partial prefill
    t2 = mod.random_sample(probs.clone(), again)
    assert torch.equal(t1[[0, 2, 4]], t2[[0, 2, 4]])                   # the rewound draw repeats
    sn.uninstall(mod)
    assert not sn.installed(mod)
    mod.random_sample(probs.clone(), gens)
    assert calls == [3]


def test_few_seeded_rows_or_fp64_noise_stay_with_vllm():
    mod, calls = sampler_module()
    sn.install(mod)
    probs = torch.tensor([[0.5, 0.5]] * 3)
    mod.random_sample(probs, {0: Gen(1)})
    mod.random_sample(probs, {0: Gen(1), 1: Gen(2)}, True)
    mod.random_sample(probs, {})
    assert calls == [1, 2, 0]


def test_a_vllm_without_the_names_keeps_its_own_sampler():
    mod = types.SimpleNamespace(random_sample=lambda *a: None)
    assert not sn.install(mod) and not sn.installed(mod)


def test_the_rollout_turns_the_batched_draw_on_in_its_worker_and_off_again(fake_vllm, monkeypatch):
    import sys

    from fakes.vllm import make

    mod, calls = sampler_module()
    monkeypatch.setitem(sys.modules, sn.SAMPLER_MODULE, mod)
    r = make(seeded_noise="batched")
    assert r.seeded_noise == "batched" and sn.installed(mod)
    assert r.set_seeded_noise("vllm") == "vllm" and not sn.installed(mod)
    with pytest.raises(InvalidArgumentError, match="seeded_noise"):
        r.set_seeded_noise("fast")
    r.close()


def test_without_vllms_sampler_the_rollout_keeps_vllms_draws(fake_vllm, monkeypatch, caplog):
    import sys

    from fakes.vllm import make

    monkeypatch.setitem(sys.modules, sn.SAMPLER_MODULE, None)      # import fails
    r = make(seeded_noise="batched")
    assert r.seeded_noise == "vllm"
    assert "per-request draws stay" in caplog.text
    r.close()
