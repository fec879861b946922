"""VLLMRollout without vLLM, when its engine fails it: a hung engine times out and is killed, a dead one is
reported at once, a failed sync keeps the old weights, and the listener and direct transports (tests/fakes/vllm.py
calls the real ColomemWorkerExtension in-process on CPU tensors)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from colomem.errors import InvalidArgumentError, PeerError, PoolClosedError, TransferTimeoutError, WeightCheckError
from fakes.vllm import make, model_of, trainer_weights
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)


@pytest.fixture
def engine_proc():
    """A child process standing in for vLLM's engine process; killed after the test if it still runs."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_hung_engine_times_out_and_close_kills_it(engine_proc):
    proc = engine_proc
    r = make(proc=proc, rpc_timeout_s=0.5, shutdown_timeout_s=0.5)
    r.llm.hang = True
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="close\\(\\) kills it"):
        r.rpc("colomem_memory")
    with pytest.raises(PeerError, match="unusable"):
        r.rpc("colomem_memory")
    r.close()                                  # shutdown hangs too: bounded, then SIGKILL
    assert time.monotonic() - t0 < 15
    assert proc.wait(timeout=5) == -9
    with pytest.raises(PoolClosedError):
        r.generate([[1]])
    r.close()                                  # idempotent


def test_dead_engine_is_reported_not_waited_for():
    r = make()
    r.llm.llm_engine.engine_core.resources.engine_dead = True
    with pytest.raises(PeerError, match="died"):
        r.rpc("colomem_memory")
    r.close()


def test_an_engine_that_dies_mid_call_is_reported_at_once_not_at_the_timeout(engine_proc):
    # vLLM's synchronous client can wait forever once its engine died mid-call: the wait watches the engine
    proc = engine_proc
    r = make(proc=proc, rpc_timeout_s=60.0, shutdown_timeout_s=0.5)
    r.llm.hang = True

    def die():
        proc.kill()
        proc.wait()
        r.llm.llm_engine.engine_core.resources.engine_dead = True

    threading.Timer(0.3, die).start()
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="engine process died during colomem_memory"):
        r.rpc("colomem_memory")
    assert time.monotonic() - t0 < 10           # not the 60 s timeout
    with pytest.raises(PeerError, match="unusable"):
        r.rpc("colomem_memory")
    r.llm.block.set()
    r.close()


def test_a_failed_sync_keeps_the_old_version_and_the_next_sync_works():
    r = make()
    r.load_weights(trainer_weights(1).items(), version=1)
    bad = list(trainer_weights(2).items()) + [("no_such_param", torch.zeros(3))]
    with pytest.raises(PeerError, match="no_such_param"):
        r.load_weights(bad, version=2)
    assert r.weight_version == 1
    w = trainer_weights(3)
    r.load_weights(w.items(), version=2)
    assert torch.equal(model_of(r).embed.detach(), w["embed"])
    r.check()
    r.close()


def test_an_error_raised_by_the_call_itself_is_not_taken_for_our_timeout(monkeypatch):
    r = make(rpc_timeout_s=5.0)

    def boom(*a, **k):
        raise TimeoutError("vLLM's own collective_rpc timeout")

    with monkeypatch.context() as m:
        m.setattr(r.llm, "collective_rpc", boom)
        with pytest.raises(TimeoutError, match="vLLM's own"):
            r.rpc("colomem_memory")
    assert r.rpc("colomem_memory")                 # the engine is still usable
    r.close()


def test_bridge_sync_refuses_tensor_parallel_engines():
    r = make(tensor_parallel_size=2)
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size"):
        r.load_weights(trainer_weights(1).items(), version=1)
    r.close()


def test_trainer_tensors_of_another_dtype_are_not_compared_byte_for_byte():
    r = make()
    w = {n: t.double() for n, t in trainer_weights(1).items()}   # vLLM casts on load; bytes differ legitimately
    r.load_weights(w.items(), version=1)
    r.check()
    with pytest.raises(InvalidArgumentError, match="dtype"):
        r.check(reference=w.items())
    r.close()


def sync_over_trash(r, w: dict, version: int):
    """Overwrites vLLM's parameters (as a level-2 sleep leaves them), syncs `w`, checks every byte arrived."""
    m = model_of(r)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(-1.0)
    stats = r.load_weights(w.items(), version=version)
    assert torch.equal(m.qkv_proj.detach(), torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]]))
    assert torch.equal(m.o_proj.detach(), w["o_proj"]) and torch.equal(m.norm.detach(), w["norm"])
    assert torch.equal(m.embed.detach(), w["embed"])
    return stats


def test_listener_transport_syncs_without_an_rpc_per_version():
    r = make(sync_transport="listener")
    for version in (1, 2, 3):
        w = trainer_weights(version)
        stats = sync_over_trash(r, w, version)
        assert stats.complete is True and stats.ntensors == 6 and stats.nbuckets >= 7
        assert stats.replayed_tensors == (0 if version == 1 else 6)
    assert r.llm.calls.count("colomem_listen") == 1 and "colomem_receive" not in r.llm.calls
    st = r._worker._colomem()
    assert st.listener.alive and st.listener.versions == 3
    r.check(reference=w.items())
    listener = st.listener
    r.close()
    assert not listener.alive and st.listener is None


def test_listener_refusal_fails_the_sync_and_keeps_serving():
    r = make(sync_transport="listener")
    r.load_weights(trainer_weights(1).items(), version=1)
    worker = r._worker
    original = worker._colomem_apply

    def broken(msg):
        raise WeightCheckError("bucket looked wrong")

    worker._colomem_apply = broken
    # the worker's class arrives intact over the listener too (the refusal's ACK carries the error payload)
    with pytest.raises(WeightCheckError, match="bucket looked wrong"):
        r.load_weights(trainer_weights(2).items(), version=2)
    worker._colomem_apply = original
    w = trainer_weights(3)
    r.load_weights(w.items(), version=3)
    assert torch.equal(model_of(r).o_proj.detach(), w["o_proj"]) and worker._colomem().listener.alive
    old = worker._colomem().listener
    r.set_bucket_bytes(512)                  # a new bridge: the old listener stops, a new one starts
    assert not old.alive
    w = trainer_weights(4)
    r.load_weights(w.items(), version=4)
    assert torch.equal(model_of(r).norm.detach(), w["norm"]) and worker._colomem().listener is not old
    r.close()


def test_a_stopped_listener_fails_the_next_sync_at_once_with_its_reason_and_the_one_after_works():
    r = make(rpc_timeout_s=60.0)
    assert r.sync_transport == "listener"                       # the default
    r.load_weights(trainer_weights(1).items(), version=1)
    st = r._worker._colomem()
    listener = st.listener

    def broken(*a, **k):
        raise RuntimeError("the bucket mapping went away")

    st.importer.receive = broken
    deadline = time.monotonic() + 10
    while listener.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not listener.alive and "mapping went away" in listener.error
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="listener in vLLM's worker stopped.*mapping went away"):
        r.load_weights(trainer_weights(2).items(), version=2)
    assert time.monotonic() - t0 < 10                           # not the 60 s timeout
    assert r.weight_version == 1
    w = trainer_weights(3)
    r.load_weights(w.items(), version=3)                        # attached again, a new listener
    assert st.listener is not listener and st.listener.alive
    assert torch.equal(model_of(r).o_proj.detach(), w["o_proj"])
    r.close()


def test_direct_transport_loads_the_trainers_tensors_in_process():
    with pytest.raises(InvalidArgumentError, match="engine_in_process"):
        make(sync_transport="direct")
    r = make(sync_transport="direct", engine_in_process=True)
    for version in (1, 2, 3):
        w = trainer_weights(version)
        if version == 3:
            w["o_proj"] = w["o_proj"].t().contiguous().t()     # non-contiguous: through load_weights
        stats = sync_over_trash(r, w, version)
        assert stats.complete is True and stats.ntensors == 6 and stats.nbuckets == 0
        assert stats.replayed_tensors == {1: 0, 2: 6, 3: 5}[version]
    assert r._bridge is None and r.llm.calls.count("colomem_load_direct") == 3
    r.check(reference=w.items())
    r.close()


def test_a_second_in_process_engine_with_sleep_mode_is_refused_before_vllm_builds_it(monkeypatch, fake_vllm):
    from colomem.engines.vllm.engine_calls import build_llm
    from colomem.errors import ConfigError

    held = {"bytes": 1 << 20}
    built = []
    cumem = types.ModuleType("vllm.device_allocator.cumem")   # vLLM's singleton, as an engine left it
    setattr(cumem, "CuMemAllocator", types.SimpleNamespace(
        instance=types.SimpleNamespace(get_current_usage=lambda: held["bytes"])))
    envs = types.ModuleType("vllm.envs")
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    setattr(fake_vllm, "envs", envs)
    setattr(fake_vllm, "LLM", lambda **kw: built.append(kw) or "engine")
    with pytest.raises(ConfigError, match="one such engine per process"):
        build_llm({"enable_sleep_mode": True}, True, lambda: None)
    assert built == []                       # refused before vLLM started anything
    assert build_llm({"enable_sleep_mode": False}, True, lambda: None) == "engine"  # no sleep mode: no allocator
    held["bytes"] = 0
    assert build_llm({"enable_sleep_mode": True}, True, lambda: None) == "engine"
    assert len(built) == 2
