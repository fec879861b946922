"""sleep(keep_weights=True) without vLLM: the KV cache released alone and mapped back, in the order vLLM's
bookkeeping needs (scheduling paused, prefix cache reset, scheduling resumed), the weights never touched,
vLLM's own sleep from that state unmapping nothing twice, an out-of-memory map-back undone, and the refusals.

The real ColomemWorkerExtension and kv_release run against a stand-in for vLLM's cumem allocator: a table of
allocations and the set of mapped addresses, whose unmap refuses an address that is not mapped (what
cuMemUnmap does) and whose map can be told to run out of memory. What the driver does with the memory is the
GPU test's (tests/gpu/test_vllm_kv_sleep_gpu.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from colomem.engines.vllm.worker import kv_release
from colomem.errors import (CudaOutOfMemoryError, InvalidArgumentError, NotAvailableError, PeerError,
                            PhaseOrderError, raise_payload)
from fakes.vllm import FakeLLM, FakeRollout, FakeWorker, model_of, trainer_weights
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)

KV_SIZES = (4096, 8192, 2048)
WEIGHT_SIZES = (1024, 512)


class Cumem:
    """vLLM's allocator table ({address: AllocationData}) with the two C calls over a set of mapped addresses."""

    def __init__(self):
        self.pointer_to_data: dict = {}
        self.mapped: set = set()
        self.fail_map_at: int = -1          # the n-th create_and_map (from 0) raises CUDA's out-of-memory
        self.fail_unmap_at: int = -1        # the n-th unmap_and_release raises a CUDA error
        self.maps = self.unmaps = 0
        ptr = 0x10000
        for tag, sizes in (("weights", WEIGHT_SIZES), ("kv_cache", KV_SIZES)):
            for n in sizes:
                self.pointer_to_data[ptr] = types.SimpleNamespace(handle=(0, n, ptr, ptr + 1), tag=tag,
                                                                  cpu_backup_tensor=None)
                self.mapped.add(ptr)
                ptr += 0x10000

    def create_and_map(self, handle):
        i, self.maps = self.maps, self.maps + 1
        if i == self.fail_map_at:
            raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:114")
        assert handle[2] not in self.mapped, "mapped twice"
        self.mapped.add(handle[2])

    def unmap_and_release(self, handle):
        i, self.unmaps = self.unmaps, self.unmaps + 1
        if i == self.fail_unmap_at:
            raise RuntimeError("CUDA Error: unknown error at cumem_allocator.cpp:156")
        if handle[2] not in self.mapped:
            raise RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp:156")
        self.mapped.discard(handle[2])

    def tagged(self, tag):
        return {p for p, d in self.pointer_to_data.items() if d.tag == tag}


class KvWorker(FakeWorker):
    def __init__(self):
        super().__init__()
        self.cumem = Cumem()
        self.post_wakes = 0
        self.model_runner.post_kv_cache_wake_up = self._post_wake

    def _post_wake(self):
        self.post_wakes += 1

    def _colomem_cumem(self):
        c = self.cumem
        return types.SimpleNamespace(allocator=c, create_and_map=c.create_and_map,
                                     unmap_and_release=c.unmap_and_release)

    def _colomem_is_mapped(self, ptr):
        return ptr in self.cumem.mapped


class KvLLM(FakeLLM):
    """FakeLLM whose sleep / wake_up also do what vLLM's do to the allocator: level 0 pauses scheduling
    only; a real level unmaps every entry of the table (failing on one unmapped already); wake_up maps the
    entries of the tags it names and resumes scheduling once nothing is asleep."""

    def __init__(self, worker, proc=None):
        super().__init__(worker, proc)
        self.paused = False
        self.asleep_tags: set = set()

    def sleep(self, level=1):
        if level == 0:
            self.calls.append("pause")
            self.paused = True
            return
        c = self.worker.cumem
        for data in c.pointer_to_data.values():
            c.unmap_and_release(data.handle)
        self.paused, self.asleep_tags = True, {"weights", "kv_cache"}
        super().sleep(level)

    def wake_up(self, tags=None):
        tags = list(tags or ["weights", "kv_cache"])
        if tags == ["scheduling"]:
            self.calls.append("resume")
            if not self.asleep_tags:
                self.paused = False
            return
        c = self.worker.cumem
        for data in c.pointer_to_data.values():
            if data.tag in tags:
                c.create_and_map(data.handle)
        self.asleep_tags -= set(tags)
        self.paused = bool(self.asleep_tags)
        super().wake_up(tags)

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        assert not self.paused, "generate while vLLM's scheduling is paused would wait forever"
        c = self.worker.cumem
        assert c.tagged("kv_cache") <= c.mapped, "a forward pass on an unmapped KV cache"
        return super().generate(prompts, params, use_tqdm, lora_request)


class KvRollout(FakeRollout):
    def __init__(self, *a, **kw):
        super().__init__(*a, worker_cls=KvWorker, **kw)

    def _build_llm(self, kwargs):
        self.built_with = kwargs
        return KvLLM(self._worker, self._proc)


def make_kv(**kw) -> KvRollout:
    """The stand-in engine; its partial releases are whole layers (kv_tail: vLLM's scheduler and KV tensors,
    which the stand-in has not, decide whether a tail can be lent: tests/gpu/test_vllm_kv_sleep_gpu.py)."""
    kw.setdefault("bucket_bytes", 256)
    kw.setdefault("kv_tail", False)
    return KvRollout("/models/tiny", gpu_memory_utilization=0.3, max_model_len=256, **kw)


def engine_steps(r):
    return [c for c in r.llm.calls if c in ("pause", "resume", "reset_prefix_cache", "sleep1", "sleep2")
            or (isinstance(c, str) and c.startswith(("wake", "colomem_kv")))]


# ------------------------------------------------------------------------------------------------ tests
def test_kv_sleep_releases_the_cache_only_and_wake_kv_maps_it_back():
    r = make_kv()
    r.load_weights(trainer_weights(1).items(), version=1)
    c = r._worker.cumem
    kv, weights = c.tagged("kv_cache"), c.tagged("weights")
    params = {n: (p.data_ptr(), p.detach().clone()) for n, p in model_of(r).named_parameters()}
    r.llm.calls.clear()

    r.sleep(keep_weights=True)
    assert r.phase == "weights"
    assert not kv & c.mapped and weights <= c.mapped          # the cache unmapped, every weight still mapped
    assert r.timings["kv_released_bytes"] == sum(KV_SIZES)
    assert r.memory()["kv_released"] and r.memory()["kv_released_bytes"] == sum(KV_SIZES)
    for n, p in model_of(r).named_parameters():               # the trainer's views stay valid
        assert p.data_ptr() == params[n][0] and torch.equal(p.detach(), params[n][1])
    r.check()
    with pytest.raises(PhaseOrderError):
        r.wake_weights()                                       # the window skips it: the weights never slept
    with pytest.raises(PhaseOrderError):
        r.generate([[1]], max_new_tokens=2)

    r.load_weights(trainer_weights(2).items(), version=2)     # the sync of the window (the adapter, in a job)
    r.check()
    r.wake_kv()
    assert r.phase == "awake" and kv <= c.mapped and r._worker.post_wakes == 1
    assert r.timings["kv_mapped_bytes"] == sum(KV_SIZES) and not r.memory()["kv_released"]
    assert engine_steps(r) == ["pause", "colomem_kv_release", "colomem_kv_map", "reset_prefix_cache", "resume"]
    assert r.generate([[1]], max_new_tokens=2)
    r.close()


def test_several_kv_sleeps_in_a_row_then_a_full_sleep_still_works():
    r = make_kv(sleep_level=1)
    w = trainer_weights(3)
    r.load_weights(w.items(), version=1)
    c = r._worker.cumem
    for _ in range(3):
        r.sleep(keep_weights=True)
        r.check()
        r.wake_kv()
        assert r.generate([[1]], max_new_tokens=2)
    r.sleep()                                                  # vLLM's own level 1 from an awake engine
    assert not c.mapped and r.phase == "asleep"
    r.wake()
    r.check()
    assert c.mapped == set(c.pointer_to_data) and torch.equal(model_of(r).o_proj.detach(), w["o_proj"])
    assert r.generate([[1]], max_new_tokens=2)
    r.close()


def test_a_full_sleep_while_the_cache_is_released_unmaps_nothing_twice():
    r = make_kv(sleep_level=1)
    w = trainer_weights(4)
    r.load_weights(w.items(), version=1)
    c = r._worker.cumem
    r.sleep(keep_weights=True)
    r.sleep()                           # vLLM's sleep would fail on the released entries: they are lent out
    assert r.phase == "asleep" and not c.mapped and len(c.pointer_to_data) == len(KV_SIZES + WEIGHT_SIZES)
    assert not r.memory()["kv_released"]                      # vLLM counts the cache as asleep now
    r.wake_weights()
    r.check()
    r.wake_kv()                                                # vLLM's own wake maps the cache
    assert c.mapped == set(c.pointer_to_data) and torch.equal(model_of(r).o_proj.detach(), w["o_proj"])
    assert r.generate([[1]], max_new_tokens=2)
    r.close()


def test_keep_weights_after_vllms_own_sleep_and_wake_weights_changes_nothing():
    r = make_kv(sleep_level=1)
    r.sleep()
    r.wake_weights()
    before = list(r.llm.calls)
    r.sleep(keep_weights=True)                                 # the cache is out already
    assert r.phase == "weights" and r.timings["kv_released_bytes"] == 0
    assert [c for c in r.llm.calls[len(before):] if c != "colomem_param_checksums"] == []
    r.wake_kv()
    assert r._worker.cumem.mapped == set(r._worker.cumem.pointer_to_data)
    r.close()


def test_out_of_memory_while_mapping_back_leaves_the_cache_released_and_a_retry_works():
    r = make_kv()
    c = r._worker.cumem
    kv = c.tagged("kv_cache")
    r.sleep(keep_weights=True)
    c.fail_map_at = c.maps + 1                                 # the second KV allocation does not fit
    with pytest.raises(CudaOutOfMemoryError, match="stays released.*wake_kv"):
        r.wake_kv()
    assert r.phase == "weights" and not kv & c.mapped and r.llm.paused     # undone: wholly released
    r.wake_kv()
    assert kv <= c.mapped and r.phase == "awake" and not r.llm.paused
    r.close()


def test_a_precheck_refuses_the_map_back_when_the_gpu_lacks_the_memory(monkeypatch):
    from colomem.engines.vllm import wake_memory

    r = make_kv()
    r.sleep(keep_weights=True)
    monkeypatch.setattr(wake_memory, "free_bytes", lambda device: 1024)
    with pytest.raises(CudaOutOfMemoryError, match="KV cache"):
        r.wake_kv()
    assert "colomem_kv_map" not in r.llm.calls and r.phase == "weights"
    monkeypatch.undo()
    r.wake_kv()
    r.close()


def test_the_map_back_reads_the_rollouts_device_and_timeout_when_it_runs(monkeypatch):
    from colomem.engines.vllm import wake_memory

    r = make_kv()
    r.sleep(keep_weights=True)
    r.device, r.wake_timeout_s = 3, 12.5                   # changed after the engine was built
    asked = []
    monkeypatch.setattr(wake_memory, "free_bytes", lambda device: asked.append(device) or 1024)
    with pytest.raises(CudaOutOfMemoryError, match="cuda:3"):
        r.wake_kv()
    assert asked == [3] and r._kv.timeout_s == 12.5
    monkeypatch.undo()
    r.wake_kv()
    r.close()


def test_refused_when_vllm_has_no_sleep_mode():
    r = make_kv(llm_kwargs={"enable_sleep_mode": False})
    with pytest.raises(NotAvailableError, match="enable_sleep_mode"):
        r.sleep(keep_weights=True)
    assert r.phase == "awake" and "pause" not in r.llm.calls
    with pytest.raises(InvalidArgumentError, match="keep_weights"):
        r.sleep(keep_weights="yes")
    r.close()


def test_a_worker_that_cannot_release_resumes_scheduling_and_stays_awake():
    r = make_kv()
    r._worker.cumem.pointer_to_data = {p: d for p, d in r._worker.cumem.pointer_to_data.items()
                                       if d.tag == "weights"}                 # no KV allocation to release
    with pytest.raises(NotAvailableError, match="kv_cache"):
        r.sleep(keep_weights=True)
    assert r.phase == "awake" and not r.llm.paused
    assert r.generate([[1]], max_new_tokens=2)
    r.close()


def test_a_release_that_fails_partway_maps_back_what_it_released():
    r = make_kv()
    c = r._worker.cumem
    c.fail_unmap_at = c.unmaps + 1                             # the second KV allocation fails to unmap
    with pytest.raises(PeerError, match="unknown error"):
        r.sleep(keep_weights=True)
    assert c.mapped == set(c.pointer_to_data) and r.phase == "awake" and not r.llm.paused
    assert r.generate([[1]], max_new_tokens=2)
    r.close()


def test_the_worker_refuses_twice_and_a_cache_vllm_already_unmapped():
    w = KvWorker()
    w.colomem_kv_release()
    with pytest.raises(PhaseOrderError, match="already released"):
        raise_payload(w.colomem_kv_release(), "colomem_kv_release")
    w.colomem_kv_map()
    with pytest.raises(PhaseOrderError, match="not released"):
        raise_payload(w.colomem_kv_map(), "colomem_kv_map")
    w.cumem.mapped -= w.cumem.tagged("kv_cache")              # what vLLM's own sleep leaves
    with pytest.raises(PhaseOrderError, match="not mapped"):
        raise_payload(w.colomem_kv_release(), "colomem_kv_release")
    state = w.colomem_kv_state()
    assert [n for _, n, _ in state["kv_cache"]] == list(KV_SIZES) and all(m for _, _, m in state["weights"])


def test_the_allocator_must_be_vllms_cumem_allocator(monkeypatch):
    """kv_release.cumem_api on an engine built without sleep mode, and where no CuMemAllocator holds memory."""
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(enable_sleep_mode=False))
    with pytest.raises(NotAvailableError, match="enable_sleep_mode"):
        kv_release.cumem_api(types.SimpleNamespace(vllm_config=cfg))
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    setattr(cumem, "CuMemAllocator", types.SimpleNamespace(instance=None))
    setattr(cumem, "cumem_available", True)
    pkg = types.ModuleType("vllm.device_allocator")
    setattr(pkg, "cumem", cumem)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", pkg)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    cfg.model_config.enable_sleep_mode = True
    with pytest.raises(NotAvailableError, match="CuMemAllocator"):
        kv_release.cumem_api(types.SimpleNamespace(vllm_config=cfg))
