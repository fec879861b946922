"""The direct transport (vLLM's engine in the trainer's process) in chunks: every tensor arrives bit for bit
with the report of one whole call, at most about one chunk of the trainer's tensors is alive at a time, the
worker refuses a chunk of another version, and the load plan recorded over the chunks is replayed after (the
fake engine of tests/fakes/vllm.py calls the real ColomemWorkerExtension on CPU tensors)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from colomem.engines.vllm import transports
from colomem.engines.vllm.transports import DirectTransport
from colomem.engines.reports import SyncStats
from colomem.errors import PeerError
from fakes.vllm import FakeWorker, TinyModel, make, model_of, trainer_weights
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)

# trainer_weights: q, k, v, o_proj 64 bytes each, norm 16, embed 1280. At 100 bytes a chunk that is
# [q k] [v o] [norm embed], then an empty last call (the items ended on a chunk's edge).
CHUNK = 100
ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "norm", "embed")


def direct(**kw):
    return make(sync_transport="direct", engine_in_process=True, **kw)


def state(r) -> dict:
    return {n: p.detach().clone() for n, p in model_of(r).named_parameters()}


def trash(r) -> None:
    with torch.no_grad():
        for p in model_of(r).parameters():
            p.fill_(-1.0)


def comparable(report: dict) -> dict:
    """A worker's report without its timing."""
    return {k: v for k, v in report.items() if k != "total_apply_ms"}


@pytest.mark.parametrize("order", [ORDER, ORDER[:4] + ("embed", "norm")])   # ends on a chunk's edge / not
def test_chunks_load_every_tensor_with_the_report_of_one_call(monkeypatch, order):
    whole, chunked = direct(), direct()
    for version in (1, 2):
        w = trainer_weights(version)
        items = [(n, w[n]) for n in order]
        trash(whole)
        trash(chunked)
        ref = whole.load_weights(items, version=version)
        before = chunked.llm.calls.count("colomem_load_direct")
        with monkeypatch.context() as m:
            m.setattr(transports, "DIRECT_CHUNK_BYTES", CHUNK)
            got = chunked.load_weights(items, version=version)
        # three chunks and the last call (empty, or [norm])
        assert chunked.llm.calls.count("colomem_load_direct") - before == 4
        a, b = state(whole), state(chunked)
        assert all(torch.equal(a[n], b[n]) for n in a)
        assert torch.equal(b["o_proj"], w["o_proj"]) and torch.equal(b["embed"], w["embed"])
        assert comparable(chunked._worker._colomem().last_ack) == comparable(whole._worker._colomem().last_ack)
        for k in ("complete", "ntensors", "nbytes", "nmissing", "replayed_tensors"):
            assert getattr(got, k) == getattr(ref, k), k
        assert got.complete is True and got.replayed_tensors == (0 if version == 1 else 6)
    plan = chunked._worker._colomem().plan
    # one per call of the first sync that carried tensors, none after: the second sync replayed them all
    assert plan.recorded_calls == (3 if order == ORDER else 4)
    assert plan.summary() == whole._worker._colomem().plan.summary() and not plan.refused
    whole.close()
    chunked.close()


class AliasedModel(TinyModel):
    """TinyModel whose loader also writes "o_alias" into o_proj: which of the two comes last decides."""

    def load_weights(self, weights):
        return super().load_weights((("o_proj" if n == "o_alias" else n), t) for n, t in weights)


class AliasedWorker(FakeWorker):
    def __init__(self):
        super().__init__()
        self.model_runner.model = AliasedModel()


def test_names_writing_the_same_bytes_from_different_chunks_are_refused(monkeypatch):
    monkeypatch.setattr(transports, "DIRECT_CHUNK_BYTES", CHUNK)   # o_proj in the 2nd chunk, o_alias in the last
    r = direct(worker_cls=AliasedWorker)
    for version in (1, 2):
        w = trainer_weights(version)
        items = [(n, w[n]) for n in ORDER] + [("o_alias", w["q_proj"])]
        stats = r.load_weights(items, version=version)
        assert stats.complete is True and stats.replayed_tensors == (0 if version == 1 else 5)
        assert torch.equal(model_of(r).o_proj.detach(), w["q_proj"])    # o_alias came last, as load_weights does
    assert set(r._worker._colomem().plan.refused) == {"o_proj", "o_alias"}
    r.close()


def test_at_most_about_one_chunk_of_the_trainers_tensors_is_alive(monkeypatch):
    """Fresh tensors (as merged LoRA weights are made, one module at a time): while chunk k is made and when
    it reaches the worker, the tensors of earlier chunks are gone (but for the one last yielded, until the
    next is made)."""
    monkeypatch.setattr(transports, "DIRECT_CHUNK_BYTES", 128)    # two 4x4 float32 tensors a chunk
    r = direct()
    w = trainer_weights(3)
    names = ORDER[:4] * 3                                         # 6 chunks (names repeat: same layout each time)
    refs: list = []                                               # weakref per tensor made, in order
    at_make: list = []                                            # (i, tensors alive just before tensor i is made)
    at_call: list = []                                            # tensors alive when a chunk reaches the worker

    def alive() -> set:
        gc.collect()
        return {i for i, ref in enumerate(refs) if ref() is not None}

    worker = r._worker
    load = worker.colomem_load_direct

    def watching(named, version, first=True, last=True):
        at_call.append(alive())
        return load(named, version, first, last)

    worker.colomem_load_direct = watching

    def fresh():
        for i, name in enumerate(names):
            at_make.append((i, alive()))
            t = w[name].clone()
            refs.append(weakref.ref(t))
            yield name, t

    worker._colomem().fast_load = False   # a name twice in one version: fine for load_weights, not for a plan
    r.load_weights(fresh(), version=1)
    for i, before in at_make:
        assert all(j >= 2 * (i // 2) - 1 for j in before), (i, before)    # this chunk's, and the last yielded
    assert len(at_call) == len(names) // 2 + 1                            # a call per chunk, the empty last
    for k, now in enumerate(at_call):
        assert all(j >= 2 * k - 1 for j in now), (k, now)                 # chunk k, and the last yielded
    assert torch.equal(model_of(r).o_proj.detach(), w["o_proj"])
    r.close()


def test_a_chunk_of_another_version_is_refused_and_changes_nothing():
    r = direct()
    w1, w2 = trainer_weights(1), trainer_weights(2)
    r.load_weights(w1.items(), version=1)
    with pytest.raises(PeerError, match="no version is being loaded.*from its first chunk"):
        r.rpc("colomem_load_direct", [("o_proj", w2["o_proj"])], 2, False, True)
    r.rpc("colomem_load_direct", [("q_proj", w2["q_proj"])], 2, True, False)    # version 2 begun
    before = state(r)
    with pytest.raises(PeerError, match="chunk of weight version 3 came while version 2 is being loaded"):
        r.rpc("colomem_load_direct", [("o_proj", trainer_weights(3)["o_proj"]), ("norm", w2["norm"])], 3,
              False, True)
    after = state(r)
    assert all(torch.equal(before[n], after[n]) for n in before)                 # nothing of it was written
    assert torch.equal(after["o_proj"], w1["o_proj"])
    w4 = trainer_weights(4)
    stats = r.load_weights(w4.items(), version=4)                                # a whole sync after it works
    assert stats.complete is True and stats.replayed_tensors == 6
    assert torch.equal(model_of(r).o_proj.detach(), w4["o_proj"])
    r.close()


def test_a_chunk_that_fails_ends_its_version():
    r = direct()
    w = trainer_weights(1)
    with pytest.raises(PeerError):         # o_proj of the wrong shape: the model's copy raises
        r.rpc("colomem_load_direct", [("q_proj", w["q_proj"]), ("o_proj", torch.zeros(3, 3))], 1, True, False)
    with pytest.raises(PeerError, match="no version is being loaded"):
        r.rpc("colomem_load_direct", [("norm", w["norm"])], 1, False, True)
    stats = r.load_weights(w.items(), version=1)
    assert stats.complete is True
    r.close()


class _Calls:
    """EngineCalls' rpc, recording what each call was given (the list object itself)."""

    def __init__(self):
        self.got: list = []

    def rpc(self, method, named, version, first, last):
        self.got.append((method, named, version, first, last))
        return [{"total_tensors": len(named), "last": last}]


def test_an_empty_sync_is_one_call_and_chunks_are_new_lists(monkeypatch):
    calls = _Calls()
    t = DirectTransport(calls)   # type: ignore[arg-type]
    assert t.sync(iter(()), 7, SyncStats(version=7)) == [{"total_tensors": 0, "last": True}]
    assert calls.got == [("colomem_load_direct", [], 7, True, True)]
    monkeypatch.setattr(transports, "DIRECT_CHUNK_BYTES", 64)
    calls.got.clear()
    w = trainer_weights(1)
    reports = t.sync(iter([(n, w[n]) for n in ("q_proj", "norm", "k_proj", "norm")]), 8, SyncStats(version=8))
    assert [(len(c[1]), c[3], c[4]) for c in calls.got] == [(1, True, False), (2, False, False), (1, False, True)]
    assert [n for n, _ in calls.got[1][1]] == ["norm", "k_proj"]           # each list kept what it was sent
    assert reports == [{"total_tensors": 1, "last": True}]
