"""LoadPlan: load_weights recorded once, replayed as plain copies; everything it cannot replay exactly is
refused and keeps going through load_weights. Real torch on CPU; the loaders mimic vLLM's (fused q/k/v and
gate/up with narrow + copy_, a vocab embedding whose padding rows are zeroed, a read-ahead groupby)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.utils._python_dispatch

from colomem.bridge.buckets import Entry, Reassembler, entry_view, pack_bucket, plan_buckets
from colomem.engines.vllm.worker.load_plan import LoadPlan, VersionRecord

H, V, PAD = 8, 10, 16          # hidden size, vocab rows sent, vocab rows held (padded like vLLM)


class VllmLike(torch.nn.Module):
    def __init__(self, cast: str = ""):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.empty(3 * H, H))
        self.gate_up = torch.nn.Parameter(torch.empty(4 * H, H))
        self.down = torch.nn.Parameter(torch.empty(H, 2 * H))
        self.norm = torch.nn.Parameter(torch.empty(H))
        self.embed = torch.nn.Parameter(torch.empty(PAD, H))
        self.register_buffer("inv_freq", torch.arange(4.0))
        self.cast = cast

    def load_weights(self, weights):
        loaded = set()
        stacked = {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "gate": ("gate_up", 0), "up": ("gate_up", 1)}
        # groupby reads one item ahead, like vLLM's AutoWeightsLoader
        for _, group in itertools.groupby(weights, key=lambda nw: nw[0][:1]):
            for name, w in group:
                if name == "rotary.inv_freq":
                    continue                                   # skipped, as vLLM skips it
                if name in stacked:
                    pname, shard = stacked[name]
                    p = getattr(self, pname)
                    n = w.shape[0]
                    p.data.narrow(0, shard * n, n).copy_(w)
                elif name == "embed":
                    pname = "embed"
                    self.embed[: w.shape[0]].data.copy_(w)
                    self.embed[w.shape[0]:].data.fill_(0)
                elif name == "down" and self.cast == "scale":
                    pname = "down"
                    self.down.data.copy_(w * 2)                  # arithmetic on the source
                elif name == "down" and self.cast == "temp":
                    pname = "down"
                    tmp = torch.empty_like(w)
                    tmp.copy_(w)                                 # through a temporary
                    self.down.data.copy_(tmp)
                elif name == "norm" and self.cast == "const":
                    pname = "norm"
                    self.norm.data.copy_(w)
                    self.norm.data.add_(1.0)                     # a write of computed data
                else:
                    pname = name
                    getattr(self, name).data.copy_(w.view(getattr(self, name).shape))
                loaded.add(pname)
        return loaded


def hf_weights(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    shapes = [("q", (H, H)), ("k", (H, H)), ("v", (H, H)), ("gate", (2 * H, H)), ("up", (2 * H, H)),
              ("down", (H, 2 * H)), ("norm", (H,)), ("embed", (V, H)), ("rotary.inv_freq", (4,))]
    return [(n, torch.randn(s, generator=g)) for n, s in shapes]


def state(m) -> dict:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def trash(m) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(float("nan"))


def bucketed(named, bucket_bytes):
    """(Entry, view) per bucket entry, as a BridgeImporter hands them out (parts of split tensors included)."""
    for plan in plan_buckets(named, bucket_bytes):
        buf = torch.zeros(bucket_bytes, dtype=torch.uint8)
        pack_bucket(plan, buf)
        for e in plan.entries:
            yield e, entry_view(buf, e)


def load(m, lp: LoadPlan, named, bucket_bytes=1 << 20) -> tuple[int, set]:
    """What the worker does with one version: replay what the plan knows, load_weights (recording) the rest."""
    reasm, ready, replayed, loaded = Reassembler(), [], 0, set()
    for e, view in bucketed(named, bucket_bytes):
        if lp.can_replay(e):
            loaded |= lp.replay(e, view)
            replayed += e.part is None or e.part[1] == e.part[2]
            continue
        out = reasm.add(e, view)
        if out is not None:
            ready.append(out)
    if ready:
        loaded |= lp.record(m.load_weights, ready) or set()
    return replayed, loaded


def reference(seed: int, cast: str = "") -> dict:
    m = VllmLike(cast)
    trash(m)
    m.load_weights(iter(hf_weights(seed)))
    return state(m)


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 256])   # whole tensors; every tensor split over buckets
def test_replay_writes_exactly_what_load_weights_writes(bucket_bytes):
    m = VllmLike()
    lp = LoadPlan(m)
    trash(m)
    replayed, loaded = load(m, lp, hf_weights(0), bucket_bytes)
    assert replayed == 0 and loaded == {"qkv", "gate_up", "down", "norm", "embed"}
    assert lp.summary()["replayable"] == 9 and not lp.refused
    for seed in (1, 2):
        trash(m)                                      # nothing of the previous bytes may survive a replay
        replayed, loaded = load(m, lp, hf_weights(seed), bucket_bytes)
        assert replayed == 9 and loaded == {"qkv", "gate_up", "down", "norm", "embed"}
        got, want = state(m), reference(seed)
        assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
        assert torch.equal(m.embed[V:], torch.zeros(PAD - V, H))   # the padding fill is replayed too
    assert lp.recorded_calls == 1


class _Copies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the copies a replay makes."""
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def test_a_source_that_is_the_parameters_own_memory_is_not_copied_onto_itself():
    m = VllmLike()
    lp = LoadPlan(m)
    load(m, lp, hf_weights(0))
    # the weights handed back as views of the model's own parameters (a shared base, merged in place)
    own = [("q", m.qkv.data[:H]), ("k", m.qkv.data[H:2 * H]), ("v", m.qkv.data[2 * H:]),
           ("gate", m.gate_up.data[:2 * H]), ("up", m.gate_up.data[2 * H:]), ("down", m.down.data)]
    with torch.no_grad():
        for _, t in own:
            t.mul_(3.0)                                  # what a merge in place writes
    want = state(m)
    with _Copies() as counted:
        for name, t in own:
            e = Entry(name, "float32", tuple(t.shape), 0, t.numel() * t.element_size())
            assert lp.can_replay(e)
            assert lp.replay(e, t) <= {"qkv", "gate_up", "down"}
    assert counted.n == 0
    assert all(torch.equal(v, want[n]) for n, v in state(m).items())
    # another tensor of the same name is still copied in
    fresh = torch.full((H, H), 7.0)
    with _Copies() as counted:
        lp.replay(Entry("q", "float32", (H, H), 0, fresh.numel() * 4), fresh)
    assert counted.n == 1 and torch.equal(m.qkv[:H], fresh)


@pytest.mark.parametrize("cast", ["scale", "temp", "const"])
def test_what_cannot_be_replayed_goes_through_load_weights_and_stays_right(cast):
    # A parameter written from computed data cannot be tied to one source (loaders read ahead), so the
    # whole model keeps its load_weights; it must still come out exactly right.
    m = VllmLike(cast)
    lp = LoadPlan(m)
    names = {n for n, _ in hf_weights(0)}
    for seed in (0, 1, 2):
        trash(m)
        replayed, _ = load(m, lp, hf_weights(seed))
        got, want = state(m), reference(seed, cast)
        assert all(torch.equal(got[n], want[n]) for n in want)
        assert set(lp.refused) == names and not lp.plans and replayed == 0


def test_a_moved_parameter_invalidates_the_plan():
    m = VllmLike()
    lp = LoadPlan(m)
    load(m, lp, hf_weights(0))
    assert lp.still_valid()
    trash(m)                                 # in-place writes keep the storage: still valid
    assert lp.still_valid()
    m.norm = torch.nn.Parameter(torch.empty(H))   # a reloaded parameter: the recorded copies point elsewhere
    assert not lp.still_valid()


class Tied(torch.nn.Module):
    """Every name lands in the same parameter: their order decides what it holds."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(4, 4))

    def load_weights(self, weights):
        for _, t in weights:
            self.w.data.copy_(t)
        return {"w"}


def test_names_writing_the_same_bytes_are_refused():
    m = Tied()
    lp = LoadPlan(m)
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(4, 4, generator=g)), ("b", torch.randn(4, 4, generator=g))]
    lp.record(m.load_weights, named)
    assert set(lp.refused) == {"a", "b"} and not lp.plans


def test_names_writing_the_same_bytes_in_calls_of_one_version_are_refused():
    # A version loaded in several calls (buckets, direct chunks) is judged as one: "a", accepted by the
    # first call, is refused once the second shows "b" writes its bytes.
    m = Tied()
    g = torch.Generator().manual_seed(0)
    a, b = ("a", torch.randn(4, 4, generator=g)), ("b", torch.randn(4, 4, generator=g))
    lp = LoadPlan(m)
    version = VersionRecord()
    lp.record(m.load_weights, [a], version)
    assert set(lp.plans) == {"a"}
    lp.record(m.load_weights, [b], version)
    assert set(lp.refused) == {"a", "b"} and not lp.plans
    assert torch.equal(m.w.detach(), b[1])          # what load_weights wrote stays
    alone = LoadPlan(m)                             # calls of no version: each judged by itself
    alone.record(m.load_weights, [a])
    alone.record(m.load_weights, [b])
    assert set(alone.plans) == {"a", "b"} and not alone.refused


def test_a_name_sent_again_in_a_later_call_of_the_version_is_refused():
    m = VllmLike()
    lp = LoadPlan(m)
    named = dict(hf_weights(0))
    version = VersionRecord()
    lp.record(m.load_weights, [("norm", named["norm"]), ("q", named["q"])], version)
    lp.record(m.load_weights, [("norm", named["norm"])], version)
    assert set(lp.refused) == {"norm"} and "sent twice" in lp.refused["norm"] and "q" in lp.plans


def test_a_write_no_name_owns_refuses_the_earlier_calls_of_its_version():
    m = VllmLike("const")                           # norm's loader adds to the parameter: nothing is replayed
    lp = LoadPlan(m)
    named = hf_weights(0)
    first, rest = [nw for nw in named if nw[0] != "norm"], [nw for nw in named if nw[0] == "norm"]
    version = VersionRecord()
    lp.record(m.load_weights, first, version)
    assert "q" in lp.plans and not lp.refused
    lp.record(m.load_weights, rest, version)
    assert not lp.plans and set(lp.refused) == {n for n, _ in named}
    lp2 = LoadPlan(m)                               # the same in one call
    lp2.record(m.load_weights, named)
    assert lp2.refused.keys() == lp.refused.keys()


def test_a_changed_shape_or_dtype_is_not_replayed():
    m = VllmLike()
    lp = LoadPlan(m)
    load(m, lp, hf_weights(0))
    assert lp.can_replay(Entry("norm", "float32", (H,), 0, 4 * H))
    assert not lp.can_replay(Entry("norm", "bfloat16", (H,), 0, 2 * H))
    assert not lp.can_replay(Entry("norm", "float32", (H, 1), 0, 4 * H))
    assert not lp.can_replay(Entry("unknown", "float32", (H,), 0, 4 * H))


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 256])
def test_compiled_buckets_write_exactly_what_replay_writes(bucket_bytes):
    from colomem._torch import copy_ranges

    m = VllmLike()
    lp = LoadPlan(m)
    load(m, lp, hf_weights(0), bucket_bytes)                        # recorded
    cpu = torch.device("cpu")
    for seed in (1, 2):
        trash(m)
        for k, plan in enumerate(plan_buckets(hf_weights(seed), bucket_bytes)):
            buf = torch.zeros(bucket_bytes, dtype=torch.uint8)
            pack_bucket(plan, buf)
            cb = lp.compiled.get(("b", k)) or lp.compile(("b", k), plan.entries, cpu)
            assert cb is not None
            copy_ranges(cb.ranges, cpu, src_base=buf.data_ptr())
            cb.fill()
        got, want = state(m), reference(seed)
        assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
    assert sum(cb.tensors for cb in lp.compiled.values()) == 9       # every tensor completed exactly once


def test_compile_refuses_converting_copies_and_unknown_names():
    class Half(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(4, dtype=torch.float16))

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data.copy_(t)          # float32 -> float16: a raw byte copy would be wrong
            return {"w"}

    m = Half()
    lp = LoadPlan(m)
    named = [("w", torch.arange(4.0))]
    lp.record(m.load_weights, named)
    assert lp.can_replay(Entry("w", "float32", (4,), 0, 16))
    assert lp.compile("k", [Entry("w", "float32", (4,), 0, 16)], torch.device("cpu")) is None
    assert lp.compile("k", [Entry("x", "float32", (4,), 0, 16)], torch.device("cpu")) is None
    assert lp.compile("k", [Entry("w", "float32", (4,), 0, 16)], torch.device("meta")) is None
    assert not lp.compiled
